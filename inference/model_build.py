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
against its own graph (there is no PyTorch model to compare with). The checks themselves:
inference/model_checks.py.

`build_torch_dir` (`model prepare --torch-only`) exports nothing: its variants are the precisions the
torch backend computes from the kept PyTorch folder, each checked the same way on the torch encoder.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inference import export, runtimes
from inference.buckets import buckets_for_max_length
from inference.errors import EmbedcarError, ModelError
from inference.files import sha256_file
from inference.head import Dense, Head, save_dense
from inference.manifest import WEIGHTS_DIR, Manifest, Variant, tree_sha256
from inference.model_checks import (
    Checker,
    PrepTokenizer,
    calibration_feeds,
    describe,
    references,
    torch_figures,
    write_golden,
)
from inference.model_folder import WEIGHT_FILES, DenseSpec, ModelFolder, read_model_folder

ROLES = ("query", "document")
DENSE_FILE = "dense.npz"
Say = Callable[[str], None]
Figures = Callable[[Path, str], dict[str, float]]  # a variant's file and precision -> its check figures
TORCH_PRECISIONS = ("fp32", "fp16", "bf16")  # what the torch backend computes (inference/backends/torch.py)


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
    tokenizer_file = _copy_inputs(src, out, folder, say)
    enc = _export(src, out, folder, tokenizer_file, say)  # the encoder graph and the model's head
    checker = Checker.against_reference(src, folder, enc.model, enc.raw.path, enc.tok, enc.head, enc.inputs, say)
    built = _Built()
    _fp32_variant(src, out, enc, checker, built, say)  # or the model is refused
    _reduced_variants(out, enc, checker, built, say)  # fp16, int8: kept where they pass
    _add_bf16(out, enc, checker, built, say)  # where this CPU computes bf16
    enc.raw.path.unlink()
    manifest = _manifest(name, src, source, folder, out, enc, built)
    if with_golden and enc.model is not None:
        write_golden(enc.model, enc.tok, enc.head, enc.inputs, out / "golden.json")
    manifest.save(out)
    return manifest


def build_torch_dir(weights: Path, out: Path, *, name: str, source: dict[str, str], folder: ModelFolder,
                    say: Say = print) -> Manifest:
    """A torch-only model directory in `out` (a staging folder whose PyTorch folder `weights` is already
    in place, read as `folder`): the tokenizer, the head and a manifest whose variants are the precisions
    torch computes from the weights, no ONNX. Each is checked as the ONNX variants are (the torch encoder
    on the CPU against the reference): fp32 or the model is refused; fp16 and bf16 left out where they miss."""
    if folder.kind != "hf":
        raise ModelError(f"{folder.path}: an ONNX folder has no PyTorch weights for the torch backend: prepare it "
                         "without --torch-only")
    tokenizer_file = _copy_inputs(weights, out, folder, say)
    model = export.load_torch_model(weights, folder.model_type)
    max_len = folder.max_seq_length or export.default_max_length(model)
    parts = _parts(folder, tokenizer_file, model, export.model_inputs(model), int(model.config.hidden_size), max_len)
    # `raw` (Path()): read only for an ONNX folder
    refs, ref_name = references(weights, folder, model, Path(), parts.tok, parts.head, export.CHECK_TEXTS,
                                parts.inputs, say)
    parts.model = model = None  # the checks load the weights as the torch backend does
    built = _Built()
    digest = tree_sha256(weights)
    built.files = {p: (weights, p, False) for p in TORCH_PRECISIONS}
    built.checks = {p: {} for p in TORCH_PRECISIONS}
    _manifest(name, weights, source, folder, out, parts, built, torch_digest=digest).save(out)  # what they load
    for precision in TORCH_PRECISIONS:
        try:
            got = torch_figures(out, precision, parts.tok, refs)
        except EmbedcarError as exc:  # e.g. a non-finite embedding
            if precision == "fp32":
                raise
            say(f"{precision} (torch) refused: {exc}")
            got = {"min_cos": float("nan")}
        if export.passes(precision, got):
            built.checks[precision] = got
            say(f"{precision} (torch): {describe(got)} vs {ref_name}")
            continue
        if precision == "fp32":
            raise ModelError(f"{folder.path}: the torch encoder in fp32 disagrees with {ref_name} ({describe(got)}; "
                             f"needs min cos >= {export.MIN_COS['fp32']}): refusing the model")
        del built.files[precision], built.checks[precision]
        built.refused[precision] = got
        say(f"{precision} (torch) refused: {describe(got)} vs {ref_name}, needs min cos >= "
            f"{export.MIN_COS[precision]}")
    manifest = _manifest(name, weights, source, folder, out, parts, built, torch_digest=digest)
    manifest.save(out)
    return manifest


@dataclass(slots=True)
class _Parts:
    """What the manifest and the checks read about the encoder, whatever runs it."""

    model: Any  # the PyTorch model; None for an adopted ONNX graph (nothing to compare with)
    inputs: tuple[str, ...]
    width: int  # the encoder's hidden size
    max_len: int
    dense: tuple[Dense, ...]
    head: Head
    tok: PrepTokenizer
    lowercase: bool
    special: tuple[int, ...]

    @property
    def dim(self) -> int:
        return self.dense[-1].weight.shape[0] if self.dense else self.width


@dataclass(slots=True)
class _Encoder(_Parts):
    """The exported (or adopted) encoder graph, with its parts."""

    raw: export.ExportedGraph = field(kw_only=True)


@dataclass(slots=True)
class _Built:
    """The variants kept (file, precision, fused) with their figures, and those refused with theirs."""

    files: dict[str, tuple[Path, str, bool]] = field(default_factory=dict)
    checks: dict[str, dict[str, float]] = field(default_factory=dict)
    refused: dict[str, dict[str, float]] = field(default_factory=dict)
    fused: bool = False


def _copy_inputs(src: Path, out: Path, folder: ModelFolder, say: Say) -> Path:
    """The tokenizer and the folder's licence and config into `out`; the folder's notes said."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_file = out / "tokenizer.json"
    shutil.copyfile(src / "tokenizer.json", tokenizer_file)
    for extra in ("LICENSE", "NOTICE", "config.json"):
        if (src / extra).exists():
            shutil.copyfile(src / extra, out / extra)
    for note in folder.notes:
        say(note)
    return tokenizer_file


def _parts(folder: ModelFolder, tokenizer_file: Path, model: Any, inputs: tuple[str, ...], width: int,
           max_len: int) -> _Parts:
    """The model's head and served tokenizer around an encoder of `width` taking `inputs`."""
    lowercase, special = _tokenizer_facts(tokenizer_file)
    lengths = {role: prompt_length(tokenizer_file, p, set(special)) for role, p in folder.prompts.items()}
    dense = tuple(_load_dense(d) for d in folder.dense)
    if dense and dense[0].weight.shape[1] != width:
        raise ModelError(f"{folder.dense[0].folder}: in_features {dense[0].weight.shape[1]} != the encoder's hidden "
                         f"size {width}")
    head = Head(folder.pooling, special, dense, folder.normalize)
    tok = PrepTokenizer(tokenizer_file, max_len, export.pad_id(tokenizer_file), "token_type_ids" in inputs,
                        folder.prompts, lengths, folder.include_prompt)
    return _Parts(model, inputs, width, max_len, dense, head, tok, lowercase, special)


def _export(src: Path, out: Path, folder: ModelFolder, tokenizer_file: Path, say: Say) -> _Encoder:
    """ONNX from PyTorch (a Hugging Face folder) or the folder's own graph, with the model's head."""
    model: Any = None
    if folder.kind == "hf":
        model = export.load_torch_model(src, folder.model_type)
        width = int(model.config.hidden_size)
        max_len = folder.max_seq_length or export.default_max_length(model)
        say(f"exporting {folder.model_type} to ONNX (opset {export.OPSET}, eager attention, max length {max_len})")
        raw = export.export_onnx(model, tokenizer_file, out / "model.raw.onnx", max_len)
    else:
        assert folder.onnx_file is not None
        raw_path, inputs, width = export.adopt_onnx(folder.onnx_file, out / "model.raw.onnx", tokenizer_file)
        heads = int(json.loads((src / "config.json").read_text()).get("num_attention_heads", 0)) \
            if (src / "config.json").exists() else 0
        # 0/0: the optimizer detects both itself
        raw = export.ExportedGraph(raw_path, inputs, heads, width if heads else 0, folder.model_type)
        max_len = folder.max_seq_length or 512
        say(f"adopted {folder.onnx_file.name}: inputs {', '.join(inputs)}, hidden size {width}, max length {max_len}")
    p = _parts(folder, tokenizer_file, model, raw.inputs, width, max_len)
    return _Encoder(p.model, p.inputs, p.width, p.max_len, p.dense, p.head, p.tok, p.lowercase, p.special, raw=raw)


def _fp32_variant(src: Path, out: Path, enc: _Encoder, checker: Checker, built: _Built, say: Say) -> None:
    """fp32: the fused graph where ORT has a recipe and it agrees, else the plain export; the model
    is refused when even that disagrees with the reference."""
    fp32 = out / "model.fp32.onnx"
    fused = export.optimize_fused(enc.raw, fp32)
    if fused:
        built.checks["fp32"] = checker(fp32, "fp32")
        if not export.passes("fp32", built.checks["fp32"]):
            say(f"fused graph disagrees ({describe(built.checks['fp32'])}): serving the plain export instead")
            fused = False
    if not fused:
        shutil.copyfile(enc.raw.path, fp32)
        built.checks["fp32"] = checker(fp32, "fp32")
    if not export.passes("fp32", built.checks["fp32"]):
        raise ModelError(f"{src}: the fp32 ONNX export disagrees with {checker.ref_name} "
                         f"({describe(built.checks['fp32'])}; needs max abs diff <= {export.FP32_MAX_ABS} and "
                         f"min cos >= {export.MIN_COS['fp32']}): refusing the model")
    say(f"fp32 {'fused' if fused else 'unfused'}: {describe(built.checks['fp32'])} vs {checker.ref_name}")
    built.files["fp32"] = (fp32, "fp32", fused)
    built.fused = fused


def _reduced_variants(out: Path, enc: _Encoder, checker: Checker, built: _Built, say: Say) -> None:
    """fp16 and int8 from fp32, each kept only within its tolerance (int8 also batch-independent)."""
    fp32 = built.files["fp32"][0]

    def int8(src: Path, dst: Path) -> None:
        export.quantize_int8(src, dst, list(calibration_feeds(enc.tok, enc.inputs)))

    for precision, convert in (("fp16", export.convert_fp16), ("int8", int8)):
        path = out / f"model.{precision}.onnx"
        try:
            convert(fp32, path)
            got = checker(path, precision)
        except ModelError as exc:  # e.g. a non-finite embedding: the variant is left out
            say(f"{precision} variant refused: {exc}")
            built.refused[precision] = {"min_cos": float("nan")}
            path.unlink(missing_ok=True)
            continue
        if export.passes(precision, got):
            built.checks[precision] = got
            built.files[precision] = (path, precision, built.fused)
            say(f"{precision}: {describe(got)} vs {checker.ref_name}")
        else:
            built.refused[precision] = got
            path.unlink()
            batch = f" and batch max abs <= {export.BATCH_MAX_ABS}" if precision == "int8" else ""
            say(f"{precision} variant refused: {describe(got)} vs {checker.ref_name}, needs min cos >= "
                f"{export.MIN_COS[precision]}{batch}")


def _add_bf16(out: Path, enc: _Encoder, checker: Checker, built: _Built, say: Say) -> None:
    fp32 = built.files["fp32"][0]
    bf16 = _bf16_variant(fp32, enc.raw.path, out / "model.bf16.onnx", checker, say, checker.ref_name)
    if bf16 is None:
        return
    bf16_file, got = bf16
    if bf16_file is None:
        built.refused["bf16"] = got
    else:
        built.checks["bf16"] = got
        built.files["bf16"] = (bf16_file, "bf16", bf16_file == fp32 and built.fused)


def _default_variant(built: _Built, torch_only: bool) -> tuple[str, str]:
    """int8 where it passed (about half fp32's latency), else fp32; and why."""
    if torch_only:
        return "fp32", "prepared for torch only: fp32, the exact model (the torch backend computes fp16 on a GPU " \
                       "where model.variant is empty)"
    if "int8" not in built.files:
        return "fp32", "int8 refused: fp32, the exact model"
    got = built.checks["int8"]
    return "int8", (f"int8 within its tolerance (min cos {got['min_cos']:.4f} >= {export.MIN_COS['int8']}, "
                    f"batch max abs {got['batch_max_abs']:.1e} <= {export.BATCH_MAX_ABS})")


def _manifest(name: str, src: Path, source: dict[str, str] | None, folder: ModelFolder, out: Path,
              enc: _Parts, built: _Built, *, torch_digest: str = "") -> Manifest:
    """The manifest of what was built (the Dense layers written beside it), with its version id.
    `torch_digest`: a torch-only model's, the tree_sha256 of its weights/ (`src`), every variant's file."""
    dense_file = dense_sha = ""
    if enc.dense:
        save_dense(out / DENSE_FILE, enc.dense)
        dense_file, dense_sha = DENSE_FILE, sha256_file(out / DENSE_FILE)
    default, reason = _default_variant(built, bool(torch_digest))
    weights = next((src / w for w in WEIGHT_FILES if (src / w).exists()), folder.onnx_file)
    return Manifest(
        name=name,
        source=source or {"requirement": "local", "folder": str(src.resolve()),
                          "sha256": sha256_file(weights) if weights else ""},
        architecture=folder.model_type or "onnx",
        dim=enc.dim,
        max_length=enc.max_len,
        pooling=folder.pooling,
        lowercase=enc.lowercase,
        buckets=buckets_for_max_length(enc.max_len),
        inputs=enc.inputs,
        special_ids=enc.special,
        pad_id=enc.tok.pad_id,
        tokenizer_sha256=sha256_file(enc.tok.file),
        variants={k: Variant(p.name, torch_digest or sha256_file(p), prec, fz, built.checks[k])
                  for k, (p, prec, fz) in built.files.items()},
        default_variant=default,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        hidden_size=enc.width,
        normalize=folder.normalize,
        dense_file=dense_file,
        dense_sha256=dense_sha,
        dense_activations=tuple(d.activation for d in enc.dense),
        prompts=dict(folder.prompts),
        prompt_lengths=dict(enc.tok.prompt_lengths),
        include_prompt=folder.include_prompt,
        similarity=folder.similarity,
        refused=built.refused,
        default_reason=reason,
        weights=WEIGHTS_DIR if torch_digest else "",
        torch_only=bool(torch_digest),
    ).with_version()


def _bf16_variant(fp32: Path, raw: Path, own: Path, figures: Figures, say: Say,
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
            say(f"bf16 variant refused: {describe(got)} vs {ref_name}, needs min cos >= {export.MIN_COS['bf16']}")
            return None, got
        say(f"bf16 (OpenVINO): {describe(got)} vs {ref_name}")
        if path == raw:
            shutil.copyfile(raw, own)
            return own, got
        return path, got
    say("bf16 variant refused: OpenVINO cannot compile the graph")
    return None, {"min_cos": float("nan")}


