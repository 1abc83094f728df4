"""Read a user's model folder into what `model prepare` needs: the folder is the contract.

Two kinds, as text-embeddings-inference and Vespa take them:

    Hugging Face / sentence-transformers folder   config.json (model_type), model.safetensors or
        pytorch_model.bin, tokenizer.json, and when present the sentence-transformers files:
        modules.json (Transformer, Pooling, Dense, Normalize), 1_Pooling/config.json,
        sentence_bert_config.json (max_seq_length), config_sentence_transformers.json (prompts,
        similarity_fn_name), 2_Dense/ (config.json + weights)
    ONNX folder   model.onnx (or onnx/model.onnx) with a [batch, sequence, hidden] output,
        tokenizer.json, and the same pooling/prompt files (or --pooling)

Whatever is there is read; whatever is not supported is refused here, naming the file and field,
never silently replaced: no pooling file and no --pooling is an error (not a guess at CLS or mean),
a Dense head is served (not ignored), several pooling flags at once are refused (sentence-
transformers would concatenate them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.errors import ModelError
from inference.head import activation_name
from inference.pooling import POOLING_MODES

# Architectures the export path has a tested recipe for (tests/test_model_folder*.py).
ARCHITECTURES = ("bert", "roberta", "xlm-roberta", "camembert", "mpnet", "distilbert", "modernbert", "electra")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
ONNX_FILES = ("model.onnx", "onnx/model.onnx")
# sentence-transformers' pooling flags -> our modes; the others are refused by name.
_FLAG_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
}
_UNSUPPORTED_FLAGS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
# Module types we run (the class name; the package path differs between versions).
_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
# Prompt names tried for each role when the caller names none (sentence-transformers conventions).
QUERY_PROMPT_NAMES = ("query", "search_query")
DOCUMENT_PROMPT_NAMES = ("document", "passage", "search_document", "corpus", "doc")


@dataclass(frozen=True, slots=True)
class DenseSpec:
    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a key of inference.head.ACTIVATIONS


@dataclass(frozen=True, slots=True)
class ModelFolder:
    path: Path
    kind: str  # "hf" | "onnx"
    model_type: str  # config.json's, "" for an ONNX folder without one
    pooling: str
    pooling_from: str  # where the mode came from: the file, or the --pooling flag
    include_prompt: bool
    normalize: bool
    dense: tuple[DenseSpec, ...]
    max_seq_length: int | None
    prompts: dict[str, str]  # role ("query", "document") -> text
    similarity: str
    onnx_file: Path | None = None
    notes: list[str] = field(default_factory=list)  # what was decided and why, for the command's output

    @property
    def is_sentence_transformers(self) -> bool:
        return (self.path / "modules.json").exists()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read it as JSON: {exc}") from exc


def _json(path: Path) -> dict[str, Any]:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


def _modules(src: Path) -> list[dict[str, Any]]:
    path = src / "modules.json"
    if not path.exists():
        return []
    mods = _read_json(path)
    if not isinstance(mods, list):
        raise ModelError(f"{path}: expected a list of modules")
    for m in mods:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _MODULES:
            raise ModelError(f"{path}: module {m.get('path') or m.get('name')!r} of type {m.get('type')!r} is not "
                             f"supported (supported: {', '.join(_MODULES)})")
        m["kind"] = kind
    kinds = [m["kind"] for m in mods]
    if kinds[:1] != ["Transformer"] or kinds.count("Pooling") != 1:
        raise ModelError(f"{path}: expected a Transformer first and exactly one Pooling module, got {kinds}")
    order = kinds.index("Pooling")
    if any(k != "Dense" for k in kinds[order + 1:] if k != "Normalize") or (
            "Normalize" in kinds and kinds.index("Normalize") != len(kinds) - 1):
        raise ModelError(f"{path}: after Pooling only Dense layers and a final Normalize are supported, got {kinds}")
    return mods


def _pooling(src: Path, folder: str, override: str | None) -> tuple[str, bool, str]:
    """(mode, include_prompt, where it came from)."""
    path = src / folder / "config.json"
    cfg = _json(path) if path.exists() else {}
    include_prompt = bool(cfg.get("include_prompt", True))
    if override is not None:
        if override not in POOLING_MODES:
            raise ModelError(f"--pooling {override!r}: expected one of {', '.join(POOLING_MODES)}")
        return override, include_prompt, "--pooling"
    if not cfg:
        raise ModelError(f"{src}: no pooling configuration ({folder}/config.json); say how the model pools with "
                         f"--pooling ({', '.join(POOLING_MODES)}): guessing would give wrong vectors silently")
    for flag in _UNSUPPORTED_FLAGS:
        if cfg.get(flag):
            raise ModelError(f"{path}: {flag} is not supported (supported: {', '.join(_FLAG_MODES)})")
    modes = [mode for flag, mode in _FLAG_MODES.items() if cfg.get(flag)]
    if len(modes) != 1:
        raise ModelError(f"{path}: expected exactly one pooling flag set, got {modes or 'none'} "
                         "(several are concatenated by sentence-transformers: not supported)")
    return modes[0], include_prompt, str(path.relative_to(src))


def _dense(src: Path, folder: str) -> DenseSpec:
    path = src / folder / "config.json"
    cfg = _json(path)
    try:
        spec = DenseSpec(src / folder, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)),
                         activation_name(cfg.get("activation_function")))
    except KeyError as exc:
        raise ModelError(f"{path}: missing field {exc}") from exc
    except ModelError as exc:
        raise ModelError(f"{path}: activation_function: {exc}") from exc
    if not any((src / folder / w).exists() for w in WEIGHT_FILES):
        raise ModelError(f"{src / folder}: no Dense weights ({' or '.join(WEIGHT_FILES)})")
    return spec


def _prompts(src: Path, query_name: str | None, document_name: str | None) -> tuple[dict[str, str], str, list[str]]:
    path = src / "config_sentence_transformers.json"
    cfg = _json(path) if path.exists() else {}
    prompts = {str(k): str(v) for k, v in (cfg.get("prompts") or {}).items()}
    notes: list[str] = []
    chosen: dict[str, str] = {}
    for role, name, defaults in (("query", query_name, QUERY_PROMPT_NAMES),
                                 ("document", document_name, DOCUMENT_PROMPT_NAMES)):
        if name is not None:
            if name == "":
                continue  # explicitly none
            if name not in prompts:
                raise ModelError(f"{path}: no prompt named {name!r} for {role} texts "
                                 f"(has: {', '.join(prompts) or 'none'})")
            chosen[role] = prompts[name]
            continue
        # sentence-transformers saves empty "query"/"document" prompts by default: skip those.
        found = next((n for n in defaults if prompts.get(n)), None)
        if found is None and role == "query" and prompts.get(str(cfg.get("default_prompt_name"))):
            found = str(cfg["default_prompt_name"])
        if found is not None and prompts[found]:
            chosen[role] = prompts[found]
            notes.append(f"{role} prompt: {prompts[found]!r} ({path.name}: prompts.{found})")
    similarity = str(cfg.get("similarity_fn_name") or "cosine")
    if similarity not in ("cosine", "dot", "dot_product"):
        raise ModelError(f"{path}: similarity_fn_name {similarity!r} is not supported (cosine, dot): the catalog "
                         "index ranks by inner product")
    return chosen, similarity, notes


def read_model_folder(src: Path, *, pooling: str | None = None, query_prompt: str | None = None,
                      document_prompt: str | None = None) -> ModelFolder:
    """Everything `model prepare` reads from `src`; ModelError naming the file and field otherwise.

    `pooling` overrides the folder's pooling config; `query_prompt` / `document_prompt` name the
    prompt (a key of config_sentence_transformers.json's `prompts`) for each role ("" for none).
    """
    if not src.is_dir():
        raise ModelError(f"{src}: not a folder")
    if not (src / "tokenizer.json").exists():
        raise ModelError(f"{src}: no tokenizer.json (a fast tokenizer's file; the tokenizer's other files are "
                         "not read)")
    onnx_file = next((src / f for f in ONNX_FILES if (src / f).exists()), None)
    has_weights = any((src / w).exists() for w in WEIGHT_FILES) or any(src.glob("model-*.safetensors"))
    kind = "hf" if has_weights else "onnx" if onnx_file else ""
    if not kind:
        raise ModelError(f"{src}: no weights ({', '.join(WEIGHT_FILES)}) and no ONNX file ({', '.join(ONNX_FILES)})")
    model_type = ""
    if (src / "config.json").exists():
        model_type = str(_json(src / "config.json").get("model_type", ""))
    if kind == "hf":
        if not model_type:
            raise ModelError(f"{src / 'config.json'}: missing, or no model_type in it")
        if model_type not in ARCHITECTURES:
            raise ModelError(f"{src / 'config.json'}: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    mods = _modules(src)
    pool_folder = next((m.get("path", "") for m in mods if m["kind"] == "Pooling"), "1_Pooling")
    mode, include_prompt, pooling_from = _pooling(src, pool_folder, pooling)
    dense = tuple(_dense(src, str(m.get("path", ""))) for m in mods if m["kind"] == "Dense")
    prompts, similarity, notes = _prompts(src, query_prompt, document_prompt)
    # No Normalize module: the model's vectors are served as they are only for a dot-product model;
    # for a cosine model, normalising changes no ranking and makes the index's inner product cosine.
    has_normalize = any(m["kind"] == "Normalize" for m in mods)
    normalize = has_normalize or similarity == "cosine"
    if mods and not has_normalize:
        how = "normalised (similarity cosine)" if normalize else "served as the model makes them (similarity dot)"
        notes.append(f"no Normalize module: vectors are {how}")
    max_len: int | None = None
    st_cfg = src / "sentence_bert_config.json"
    if st_cfg.exists():
        raw = _json(st_cfg).get("max_seq_length")
        if raw is not None:
            max_len = int(raw)
    if pooling_from == "--pooling":
        notes.append(f"pooling {mode} (from --pooling)")
    return ModelFolder(src, kind, model_type, mode, pooling_from, include_prompt, normalize, dense, max_len,
                       prompts, "dot" if similarity == "dot_product" else similarity, onnx_file, notes)
