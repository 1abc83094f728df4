"""Build a prepared model directory from a model folder: ONNX variants, each checked, head, manifest.

The steps, for a Hugging Face / sentence-transformers folder (inference/model_folder.py reads it):
export ONNX from PyTorch, then derive fp32 (fused where ORT has a recipe), fp16 and int8; check each
on one mixed-length batch of real texts, with the model's own prompts, against the reference a user
would compare with: sentence-transformers' `encode` where the library and the folder's module files
are there, else PyTorch's hidden states through the same head. fp32 must agree (max abs diff <= 1e-3
on hidden states, cos >= 0.9999 on embeddings) or the model is refused; fp16 (>= 0.999) and int8
(>= 0.98) are left out when they miss, with their figures in the manifest. fp32 and int8 are also
checked for batch independence (each text alone vs in mixed batches padded to other lengths): int8
is left out when a text's vector moves with its batch-mates. An ONNX folder is checked the same way
against its own graph (there is no PyTorch model to compare with).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inference import export, runtimes
from inference.buckets import buckets_for_max_length
from inference.errors import ModelError
from inference.files import sha256_file
from inference.head import Dense, Head, save_dense
from inference.manifest import Manifest, Variant
from inference.model_folder import WEIGHT_FILES, DenseSpec, ModelFolder, read_model_folder
from inference.tokenizer import QueryTokenizer

ROLES = ("query", "document")
DENSE_FILE = "dense.npz"
Say = Callable[[str], None]

GOLDEN_TEXTS = (
    "best marathon training shoes for women",
    "running shoes",
    "organic gluten free pasta sauce under 5 dollars family size",
    "Greek yogurt",
    "crème fraîche 🍓 strawberries",
    "low sodium chicken broth for soup",
)


@dataclass(frozen=True, slots=True)
class _Tok:
    """What the served tokenizer needs, before a manifest exists."""

    file: Path
    max_length: int
    pad_id: int
    with_types: bool
    prompts: dict[str, str]
    prompt_lengths: dict[str, int]
    include_prompt: bool

    def for_role(self, role: str) -> QueryTokenizer:
        prompt = self.prompts.get(role, "")
        skip = 0 if self.include_prompt or not prompt else self.prompt_lengths[role]
        return QueryTokenizer(self.file, max_length=self.max_length, buckets=buckets_for_max_length(self.max_length),
                              pad_id=self.pad_id, with_token_type_ids=self.with_types, prompt=prompt, pool_skip=skip)


def _ours(graph: runtimes.Graph, tok: _Tok, head: Head, role: str, texts: tuple[str, ...]) -> npt.NDArray[np.float32]:
    """The served path's embeddings of `texts` as one padded batch: tokenizer (with the role's
    prompt) -> `graph` (a variant on the runtime that serves it) -> the head."""
    qt = tok.for_role(role)
    batch = qt.batch(qt.encode(list(texts)).ids)
    hidden = graph.hidden({k: v for k, v in batch.arrays().items() if k in graph.inputs})
    return head(hidden, batch.attention_mask, input_ids=batch.input_ids, skip=batch.pool_skip)


# Batch-mates for the batch check: a one-word text and a long one (a larger bucket, more padding).
BATCH_MATES = ("tea", "family size value pack of organic whole grain gluten free breakfast cereal with "
               "almonds and honey clusters, no artificial colours or flavours, 12 boxes of 14 ounces each")


def batch_drift(graph: runtimes.Graph, qt: QueryTokenizer, head: Head, texts: Sequence[str]) -> dict[str, float]:
    """Each text alone (exact length, no padding) against the same text in mixed batches padded to
    other lengths: the largest component difference of the unit vectors and the smallest cosine."""
    ids = qt.encode(list(texts)).ids

    def unit(rows: list[list[int]], length: int | None = None) -> npt.NDArray[np.float32]:
        batch = qt.batch(rows, length)
        hidden = graph.hidden({k: v for k, v in batch.arrays().items() if k in graph.inputs})
        emb = head(hidden, batch.attention_mask, input_ids=batch.input_ids, skip=batch.pool_skip)
        return np.asarray(emb / np.linalg.norm(emb, axis=1, keepdims=True), dtype=np.float32)

    alone = np.vstack([unit([x], len(x)) for x in ids])
    mates = qt.encode(list(BATCH_MATES)).ids
    together = unit(ids)  # one batch, padded to its longest's bucket
    mixed = unit([mates[1], *ids[::-1], mates[0]])[1:-1][::-1]  # reversed, a longer bucket
    diff = max(float(np.abs(together - alone).max()), float(np.abs(mixed - alone).max()))
    cos = min(float((together * alone).sum(axis=1).min()), float((mixed * alone).sum(axis=1).min()))
    return {"batch_max_abs": diff, "batch_min_cos": cos}


def calibration_feeds(tok: _Tok, inputs: tuple[str, ...], batch_size: int = 32) -> Iterator[export.Feed]:
    """The int8 calibration texts as the served path tokenizes them (each role with its prompt), in
    batches by length."""
    for role, texts in export.calibration_texts().items():
        qt = tok.for_role(role)
        ids = sorted(qt.encode(texts).ids, key=len)
        for i in range(0, len(ids), batch_size):
            yield {k: v for k, v in qt.batch(ids[i : i + batch_size]).arrays().items() if k in inputs}


def prompt_length(tokenizer_file: Path, prompt: str, special_ids: set[int]) -> int:
    """Tokens of `prompt` with [CLS], without a trailing special token: sentence-transformers'
    count of the leading tokens to leave out of pooling when `include_prompt` is false."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_file)).encode(prompt).ids
    return len(ids) - (1 if ids and ids[-1] in special_ids else 0)


def _load_dense(spec: DenseSpec) -> Dense:
    weights = next(spec.folder / w for w in WEIGHT_FILES if (spec.folder / w).exists())
    tensors: dict[str, Any]
    if weights.suffix == ".safetensors":
        from safetensors.numpy import load_file

        tensors = load_file(str(weights))
    else:
        import torch

        tensors = {k: v.numpy() for k, v in torch.load(str(weights), map_location="cpu", weights_only=True).items()}
    try:
        w = np.asarray(tensors["linear.weight"], dtype=np.float32)
        b = np.asarray(tensors["linear.bias"], dtype=np.float32) if spec.bias else None
    except KeyError as exc:
        raise ModelError(f"{weights}: no tensor {exc} (a sentence-transformers Dense layer's weights)") from exc
    if w.shape != (spec.out_features, spec.in_features):
        raise ModelError(f"{weights}: linear.weight is {w.shape}, its config says "
                         f"{(spec.out_features, spec.in_features)}")
    return Dense(w, b, spec.activation)


def _tokenizer_facts(tokenizer_file: Path) -> tuple[bool, tuple[int, ...]]:
    """(lowercases, special ids) read from tokenizer.json."""
    cfg = json.loads(tokenizer_file.read_text())
    normalizer = cfg.get("normalizer") or {}
    special = tuple(sorted({int(t["id"]) for t in cfg.get("added_tokens", []) if t.get("special")}))
    return bool(normalizer.get("lowercase", False)), special


def build_model_dir(src: Path, out: Path, *, name: str, source: dict[str, str] | None = None,
                    folder: ModelFolder | None = None, say: Say = print, with_golden: bool = True) -> Manifest:
    """Export and check the model folder `src` into `out` (a staging folder) and write its manifest."""
    folder = folder or read_model_folder(src)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_file = out / "tokenizer.json"
    shutil.copyfile(src / "tokenizer.json", tokenizer_file)
    for extra in ("LICENSE", "NOTICE", "config.json"):
        if (src / extra).exists():
            shutil.copyfile(src / extra, out / extra)
    for note in folder.notes:
        say(note)
    lowercase, special = _tokenizer_facts(tokenizer_file)
    special_set = set(special)
    lengths = {role: prompt_length(tokenizer_file, p, special_set) for role, p in folder.prompts.items()}
    dense = tuple(_load_dense(d) for d in folder.dense)

    model: Any = None
    if folder.kind == "hf":
        model = export.load_torch_model(src, folder.model_type)
        width = int(model.config.hidden_size)
        max_len = folder.max_seq_length or export.default_max_length(model)
        say(f"exporting {folder.model_type} to ONNX (opset {export.OPSET}, eager attention, max length {max_len})")
        raw = export.export_onnx(model, tokenizer_file, out / "model.raw.onnx", max_len)
        inputs = raw.inputs
    else:
        assert folder.onnx_file is not None
        raw_path, inputs, width = export.adopt_onnx(folder.onnx_file, out / "model.raw.onnx", tokenizer_file)
        heads = int(json.loads((src / "config.json").read_text()).get("num_attention_heads", 0)) \
            if (src / "config.json").exists() else 0
        # 0/0: the optimizer detects both itself
        raw = export.ExportedGraph(raw_path, inputs, heads, width if heads else 0, folder.model_type)
        max_len = folder.max_seq_length or 512
        say(f"adopted {folder.onnx_file.name}: inputs {', '.join(inputs)}, hidden size {width}, max length {max_len}")
    if dense and dense[0].weight.shape[1] != width:
        raise ModelError(f"{folder.dense[0].folder}: in_features {dense[0].weight.shape[1]} != the encoder's hidden "
                         f"size {width}")
    dim = dense[-1].weight.shape[0] if dense else width
    head = Head(folder.pooling, special, dense, folder.normalize)
    tok = _Tok(tokenizer_file, max_len, export.pad_id(tokenizer_file), "token_type_ids" in inputs,
               folder.prompts, lengths, folder.include_prompt)

    # References: PyTorch's hidden states (plain texts, one padded batch) and, per role, the
    # embeddings a user would compare with.
    texts = export.CHECK_TEXTS
    if model is not None:
        ref_hidden, feed = export.torch_hidden(model, tokenizer_file, texts, inputs, max_len)
    else:
        plain = tok.for_role("none")
        feed = {k: v for k, v in plain.batch(plain.encode(list(texts)).ids).arrays().items() if k in inputs}
        ref_hidden = runtimes.hidden_once(raw.path, "fp32", feed)
    refs, ref_name = _references(src, folder, model, raw.path, tok, head, texts, inputs, say)

    def figures(path: Path, precision: str) -> dict[str, float]:
        got: dict[str, float] = {}
        if precision == "fp32":
            got["max_abs_diff"] = export.hidden_diff(path, ref_hidden, feed)
        graph = runtimes.open_graph(path, precision, 0)  # once for every role
        got["min_cos"] = min(float(export.cosines(_ours(graph, tok, head, r, texts), refs[r]).min()) for r in refs)
        if precision in ("fp32", "int8"):
            got.update(batch_drift(graph, tok.for_role("query"), head, texts))
        return got

    checks: dict[str, dict[str, float]] = {}
    fp32 = out / "model.fp32.onnx"
    fused = export.optimize_fused(raw, fp32)
    if fused:
        checks["fp32"] = figures(fp32, "fp32")
        if not export.passes("fp32", checks["fp32"]):
            say(f"fused graph disagrees ({_fmt(checks['fp32'])}): serving the plain export instead")
            fused = False
    if not fused:
        shutil.copyfile(raw.path, fp32)
        checks["fp32"] = figures(fp32, "fp32")
    if not export.passes("fp32", checks["fp32"]):
        raise ModelError(f"{src}: the fp32 ONNX export disagrees with {ref_name} ({_fmt(checks['fp32'])}; needs "
                         f"max abs diff <= {export.FP32_MAX_ABS} and min cos >= {export.MIN_COS['fp32']}): "
                         "refusing the model")
    say(f"fp32 {'fused' if fused else 'unfused'}: {_fmt(checks['fp32'])} vs {ref_name}")

    files = {"fp32": (fp32, "fp32", fused)}
    refused: dict[str, dict[str, float]] = {}
    def int8(src: Path, dst: Path) -> None:
        export.quantize_int8(src, dst, list(calibration_feeds(tok, inputs)))

    for precision, convert in (("fp16", export.convert_fp16), ("int8", int8)):
        path = out / f"model.{precision}.onnx"
        try:
            convert(fp32, path)
            got = figures(path, precision)
        except ModelError as exc:  # e.g. a non-finite embedding: the variant is left out
            say(f"{precision} variant refused: {exc}")
            refused[precision] = {"min_cos": float("nan")}
            path.unlink(missing_ok=True)
            continue
        if export.passes(precision, got):
            checks[precision] = got
            files[precision] = (path, precision, fused)
            say(f"{precision}: {_fmt(got)} vs {ref_name}")
        else:
            refused[precision] = got
            path.unlink()
            batch = f" and batch max abs <= {export.BATCH_MAX_ABS}" if precision == "int8" else ""
            say(f"{precision} variant refused: {_fmt(got)} vs {ref_name}, needs min cos >= "
                f"{export.MIN_COS[precision]}{batch}")
    bf16 = _bf16_variant(fp32, raw.path, out / "model.bf16.onnx", figures, say, ref_name)
    if bf16 is not None:
        bf16_file, got = bf16
        if bf16_file is None:
            refused["bf16"] = got
        else:
            checks["bf16"] = got
            files["bf16"] = (bf16_file, "bf16", bf16_file == fp32 and fused)
    raw.path.unlink()

    dense_file = dense_sha = ""
    if dense:
        save_dense(out / DENSE_FILE, dense)
        dense_file, dense_sha = DENSE_FILE, sha256_file(out / DENSE_FILE)
    default = "int8" if "int8" in files else "fp32"
    reason = (f"int8 within its tolerance (min cos {checks['int8']['min_cos']:.4f} >= {export.MIN_COS['int8']}, "
              f"batch max abs {checks['int8']['batch_max_abs']:.1e} <= {export.BATCH_MAX_ABS})"
              if default == "int8" else "int8 refused: fp32, the exact model")
    weights = next((src / w for w in WEIGHT_FILES if (src / w).exists()), folder.onnx_file)
    manifest = Manifest(
        name=name,
        source=source or {"requirement": "local", "folder": str(src.resolve()),
                          "sha256": sha256_file(weights) if weights else ""},
        architecture=folder.model_type or "onnx",
        dim=dim,
        max_length=max_len,
        pooling=folder.pooling,
        lowercase=lowercase,
        buckets=buckets_for_max_length(max_len),
        inputs=inputs,
        special_ids=special,
        pad_id=tok.pad_id,
        tokenizer_sha256=sha256_file(tokenizer_file),
        variants={k: Variant(p.name, sha256_file(p), prec, fz, checks[k]) for k, (p, prec, fz) in files.items()},
        default_variant=default,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        hidden_size=width,
        normalize=folder.normalize,
        dense_file=dense_file,
        dense_sha256=dense_sha,
        dense_activations=tuple(d.activation for d in dense),
        prompts=dict(folder.prompts),
        prompt_lengths=lengths,
        include_prompt=folder.include_prompt,
        similarity=folder.similarity,
        refused=refused,
        default_reason=reason,
    ).with_version()
    if with_golden and model is not None:
        write_golden(model, tok, head, inputs, out / "golden.json")
    manifest.save(out)
    return manifest


def _bf16_variant(fp32: Path, raw: Path, own: Path, figures: Callable[[Path, str], dict[str, float]], say: Say,
                  ref_name: str) -> tuple[Path | None, dict[str, float]] | None:
    """(the file the bf16 variant runs, its figures): OpenVINO on the fp32 graph, or on the plain
    export copied to `own` where OpenVINO cannot read the fused one; the file is None where bf16
    misses its tolerance. None where this host cannot run bf16 (said, not recorded: another may)."""
    why = runtimes.bf16_unavailable()
    if why:
        say(f"bf16 variant not built: {why}")
        return None
    for path in (fp32, raw):
        try:
            got = figures(path, "bf16")
        except ModelError as exc:
            say(f"bf16 on {path.name}: {exc}")
            continue
        if not export.passes("bf16", got):
            say(f"bf16 variant refused: {_fmt(got)} vs {ref_name}, needs min cos >= {export.MIN_COS['bf16']}")
            return None, got
        say(f"bf16 (OpenVINO): {_fmt(got)} vs {ref_name}")
        if path == raw:
            shutil.copyfile(raw, own)
            return own, got
        return path, got
    say("bf16 variant refused: OpenVINO cannot compile the graph")
    return None, {"min_cos": float("nan")}


def _references(src: Path, folder: ModelFolder, model: Any, raw: Path, tok: _Tok, head: Head,
                texts: tuple[str, ...], inputs: tuple[str, ...], say: Say) -> tuple[dict[str, Any], str]:
    """Reference embeddings per role (the roles with a prompt, and the query role) and their name."""
    roles = sorted({"query", *folder.prompts})
    if model is None:
        graph = runtimes.open_graph(raw, "fp32", 0)
        return {r: _ours(graph, tok, head, r, texts) for r in roles}, "the given ONNX graph"
    # sentence-transformers pools as its own files say: not the reference once --pooling overrides them.
    if folder.is_sentence_transformers and folder.pooling_from != "--pooling":
        st = {r: export.st_embeddings(src, texts, folder.prompts.get(r, "")) for r in roles}
        if all(v is not None for v in st.values()):
            return st, "sentence-transformers"
        say("sentence-transformers is not installed: checking against PyTorch + the model's head instead")
    refs = {}
    for r in roles:
        qt = tok.for_role(r)
        prompted = [qt.prompt + t for t in texts]
        hidden, feed = export.torch_hidden(model, tok.file, prompted, inputs, tok.max_length)
        refs[r] = head(hidden, feed["attention_mask"], input_ids=feed["input_ids"], skip=qt.pool_skip)
    return refs, "PyTorch"


def _fmt(figures: dict[str, float]) -> str:
    parts = []
    if "max_abs_diff" in figures:
        parts.append(f"max abs diff {figures['max_abs_diff']:.1e}")
    parts.append(f"min cos {figures['min_cos']:.6f}")
    if "batch_max_abs" in figures:
        parts.append(f"alone vs in a batch max abs {figures['batch_max_abs']:.1e}")
    return ", ".join(parts)


def write_golden(model: Any, tok: _Tok, head: Head, inputs: tuple[str, ...], path: Path) -> None:
    """Reference embeddings from PyTorch + the model's head, each query text alone."""
    qt = tok.for_role("query")
    rows = []
    for text in GOLDEN_TEXTS:
        hidden, feed = export.torch_hidden(model, tok.file, [qt.prompt + text], inputs, tok.max_length)
        emb = head(hidden, feed["attention_mask"], input_ids=feed["input_ids"], skip=qt.pool_skip)[0]
        rows.append({"text": text, "embedding": [round(float(x), 7) for x in emb]})
    path.write_text(json.dumps({
        "made_by": "embedcar model prepare: PyTorch (transformers, eager) last_hidden_state + the model's "
                   "head (its pooling, Dense layers, normalisation), each text alone",
        "texts": rows,
    }, indent=1))
