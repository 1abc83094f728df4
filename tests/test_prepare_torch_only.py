"""`model prepare --torch-only` (inference/prepare.py, model_build.build_torch_dir): a tiny BERT and a tiny
ModernBERT prepared without ONNX, their variants the torch precisions; the torch backend answers as the
fully prepared folder's fp32 ONNX variant; the embedded backend and Triton's ONNX/TensorRT repository
refuse such a folder in one line, Triton's torch encoder takes it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference.backends.factory import make_backend
from inference.backends.onnx import OnnxBackend
from inference.embedder import load_tokenizer
from inference.errors import FailedPrecondition, ModelError
from inference.export import MIN_COS
from inference.manifest import WEIGHTS_DIR, load_manifest, verify_files
from inference.prepare import prepare_model
from inference.settings import Settings
from inference.triton.repository import generate_repository
from tests.fixtures_models import tiny_st_folder

torch = pytest.importorskip("torch", reason="a torch-only model needs the torch extra")
from inference.backends.torch import TorchBackend  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["running shoes", "organic gluten free pasta sauce family size under 5 dollars", "green tea",
         "best marathon training shoes for women wireless noise cancelling headphones with long battery life"]
# BERT with a Dense head and a prompt pooled without it; ModernBERT (sliding-window attention) plain.
MODELS: dict[str, dict[str, Any]] = {
    "bert": {"dense": 16, "prompts": {"query": "query: "}, "include_prompt": False}, "modernbert": {}}


def _quiet(_msg: str) -> None:
    pass


def _cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "inference.cli_main", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module", params=sorted(MODELS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the torch-only model directory, the same folder fully prepared): BERT's through the CLI flag."""
    root = tmp_path_factory.mktemp(f"torch-only-{request.param}")
    src = tiny_st_folder(root / "st", request.param, **MODELS[request.param])
    if request.param == "bert":
        out = _cli("model", "prepare", "--from", str(src), "--model", "tiny", "--models-dir", str(root / "torch"),
                   "--torch-only")
        assert "ready in" in out and "fp32 (torch)" in out
    else:
        prepare_model(root / "torch", "tiny", from_dir=src, torch_only=True, say=_quiet)
    prepare_model(root / "full", "tiny", from_dir=src, say=_quiet)
    return root / "torch" / "tiny", root / "full" / "tiny"


def test_no_onnx_and_the_variants_are_torch_precisions(models: tuple[Path, Path]) -> None:
    torch_dir, full_dir = models
    assert not list(torch_dir.rglob("*.onnx"))
    m = load_manifest(torch_dir)
    assert m.torch_only and m.weights == WEIGHTS_DIR and (torch_dir / WEIGHTS_DIR / "config.json").is_file()
    assert "fp32" in m.variants and set(m.variants) <= {"fp32", "fp16", "bf16"}
    assert set(m.variants) | set(m.refused) == {"fp32", "fp16", "bf16"}
    assert all(v.file == WEIGHTS_DIR and v.precision == k for k, v in m.variants.items())
    assert m.variants["fp32"].check["min_cos"] >= MIN_COS["fp32"]  # against sentence-transformers
    assert m.default_variant == "fp32" and verify_files(torch_dir, m) == []
    full = load_manifest(full_dir)
    assert not full.torch_only and m.version_id != full.version_id
    assert (m.dim, m.pooling, m.inputs, m.prompts) == (full.dim, full.pooling, full.inputs, full.prompts)
    # idempotent, and a changed weight file is noticed
    assert prepare_model(torch_dir.parent, "tiny", torch_only=True, say=_quiet,
                         from_dir=Path(m.source["folder"])).version_id == m.version_id
    (torch_dir / WEIGHTS_DIR / "extra.bin").write_bytes(b"x")
    try:
        assert any("fp32" in p for p in verify_files(torch_dir, m))
    finally:
        (torch_dir / WEIGHTS_DIR / "extra.bin").unlink()


def test_the_torch_backend_answers_as_the_full_fp32(models: tuple[Path, Path]) -> None:
    torch_dir, full_dir = models
    m, full = load_manifest(torch_dir), load_manifest(full_dir)
    backend = TorchBackend(torch_dir, m, device="cpu", threads=1)
    backend.warm_up()
    assert backend.version_id == m.variant_id("fp32")
    onnx = OnnxBackend(full_dir, full, variant="fp32", threads=1)
    tok = load_tokenizer(torch_dir, m, role="query")
    batch = tok.batch(tok.encode(TEXTS).ids)
    want, got = onnx.embed_sync(batch), backend.embed_sync(batch)
    a = want / np.linalg.norm(want, axis=1, keepdims=True)
    b = got / np.linalg.norm(got, axis=1, keepdims=True)
    assert float((a * b).sum(axis=1).min()) >= MIN_COS["fp32"]


def test_the_onnx_consumers_refuse_it_in_one_line(models: tuple[Path, Path], tmp_path: Path) -> None:
    torch_dir, _ = models
    m = load_manifest(torch_dir)
    s = Settings.load(environ={}, overrides={"model": {"models_dir": torch_dir.parent, "name": "tiny"}})
    with pytest.raises(FailedPrecondition, match="torch only") as err:
        make_backend(s, "embedded")
    assert "\n" not in str(err.value) and "model prepare --force" in str(err.value)
    assert "without --torch-only" in str(err.value) and "--from " in str(err.value)
    for target, encoder in (("cpu", None), ("gpu", None), ("cpu", "onnx")):
        with pytest.raises(ModelError, match="torch only") as refused:
            generate_repository(s, m, torch_dir, out_dir=tmp_path / "repo", target=target, encoder=encoder)
        assert "\n" not in str(refused.value) and "model prepare --force" in str(refused.value)
    # Triton's torch encoder takes it (fp32 on a CPU)
    repo = generate_repository(s, m, torch_dir, out_dir=tmp_path / "repo", target="cpu", encoder="torch")
    assert any(repo.glob("encoder.*/config.pbtxt"))


def test_an_onnx_folder_cannot_be_prepared_torch_only(models: tuple[Path, Path], tmp_path: Path) -> None:
    _, full_dir = models
    folder = tmp_path / "onnx-folder"
    folder.mkdir()
    for name, copy in (("model.fp32.onnx", "model.onnx"), ("tokenizer.json", "tokenizer.json"),
                       ("config.json", "config.json")):
        shutil.copyfile(full_dir / name, folder / copy)
    with pytest.raises(ModelError, match="no PyTorch weights") as err:
        prepare_model(tmp_path / "models", "x", from_dir=folder, pooling="mean", torch_only=True, say=_quiet)
    assert "without --torch-only" in str(err.value)
