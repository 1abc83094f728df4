"""The torch backend (inference/backends/torch.py, inference/torch_encoder.py) against the embedded ONNX
fp32 variant of the same prepared model: every pooling mode, a Dense head, prompts, BERT and ModernBERT;
a non-finite vector refused; a real sidecar on it; CUDA graphs on a GPU."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedcar_settings import Settings
from inference.backends.factory import make_backend
from inference.backends.onnx import OnnxBackend
from inference.embedder import load_tokenizer
from inference.errors import FailedPrecondition, Internal
from inference.export import MIN_COS
from inference.manifest import Manifest, load_manifest, verify_files
from inference.pooling import POOLING_MODES
from inference.prepare import prepare_model
from inference.tokenizer import TokenBatch
from tests.fixtures_models import tiny_st_folder
from tests.fixtures_sidecar import sidecar_settings

torch = pytest.importorskip("torch", reason="the torch backend needs the torch extra")
from inference.backends.torch import TorchBackend  # noqa: E402

TEXTS = ["running shoes", "organic gluten free pasta sauce family size under 5 dollars", "", "green tea",
         "best marathon training shoes for women wireless noise cancelling headphones with long battery life"]
# (architecture, Dense width, prompts, include_prompt): BERT with a Dense head and a prompt pooled without;
# ModernBERT (sliding-window attention, no token types) with a prompt pooled with.
MODELS = {"bert": ("bert", 16, {"query": "query: "}, False), "modernbert": ("modernbert", None, {"query": "q: "}, True)}


def _quiet(_msg: str) -> None:
    pass


def _prepared(root: Path, arch: str) -> Path:
    _, dense, prompts, include = MODELS[arch]
    src = tiny_st_folder(root / "st", arch, dense=dense, prompts=prompts, include_prompt=include)
    prepare_model(root / "models", "tiny", from_dir=src, say=_quiet)
    return root / "models" / "tiny"


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _prepared(tmp_path_factory.mktemp("torch-bert"), "bert")


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "bert":
        return Path(request.getfixturevalue("bert"))
    return _prepared(tmp_path_factory.mktemp(f"torch-{request.param}"), request.param)


def _with_head(model_dir: Path, **changes: Any) -> Manifest:
    """The model's manifest with another head (pooling, normalisation), saved: both backends read it."""
    m = dataclasses.replace(load_manifest(model_dir), **changes).with_version()
    m.save(model_dir)
    return m


def _batches(model_dir: Path, manifest: Manifest) -> list[TokenBatch]:
    tok = load_tokenizer(model_dir, manifest, role="query")
    encoded = tok.encode(TEXTS)
    # the texts as one batch, padded to their bucket, and the shortest alone
    return [tok.batch(encoded.ids), tok.batch(encoded.ids[:1])]


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.asarray((a * b).sum(axis=1))


@pytest.mark.slow
def test_the_torch_backend_agrees_with_onnx_fp32_for_every_head(tiny: Path) -> None:
    original = load_manifest(tiny)
    assert original.weights == "weights" and (tiny / "weights" / "config.json").is_file()
    heads = [{"pooling": mode} for mode in POOLING_MODES] + [{"pooling": "mean", "normalize": False}]
    try:
        for head in heads:
            manifest = _with_head(tiny, **head)
            onnx = OnnxBackend(tiny, manifest, variant="fp32", threads=1)
            torch_backend = TorchBackend(tiny, manifest, device="cpu", threads=1)
            torch_backend.warm_up()
            assert torch_backend.ready() and torch_backend.runs_inline and not torch_backend.graphs
            assert torch_backend.version_id == manifest.variant_id("fp32")
            for batch in _batches(tiny, manifest):
                want, got = onnx.embed_sync(batch), torch_backend.embed_sync(batch)
                assert got.dtype == np.float32 and got.shape == want.shape == (batch.shape[0], manifest.dim)
                assert _cos(want, got).min() >= MIN_COS["fp32"], (head, _cos(want, got))
                if not manifest.normalize:  # lengths too, not only directions
                    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-4)
    finally:
        original.save(tiny)


def test_a_non_finite_vector_is_an_error_not_an_answer(bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = load_manifest(bert)
    backend = TorchBackend(bert, manifest, device="cpu", threads=1)
    enc = backend.load()
    batch = _batches(bert, manifest)[0]
    monkeypatch.setattr(enc, "forward", lambda *a, **k: torch.full((batch.shape[0], manifest.dim), float("nan")))
    with pytest.raises(Internal, match="non-finite"):
        backend.embed_sync(batch)


def test_prepare_keeps_the_weights_and_notices_them_gone(bert: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tiny"
    shutil.copytree(bert, copy)
    manifest = load_manifest(copy)
    assert verify_files(copy, manifest) == []
    shutil.rmtree(copy / "weights")
    assert any("weights" in p for p in verify_files(copy, manifest))
    with pytest.raises(FailedPrecondition, match="model prepare --force"):
        TorchBackend(copy, manifest, device="cpu").load()


def test_the_factory_builds_it_and_names_the_extra_when_torch_is_missing(
        bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings.load(environ={}, overrides={"model": {"models_dir": bert.parent, "name": "tiny"}})
    assert isinstance(make_backend(s, "torch"), TorchBackend)
    with pytest.raises(FailedPrecondition, match="int8"):
        make_backend(s.with_section("model", variant="int8"), "torch")
    real = importlib.import_module

    def no_torch(name: str, *args: Any) -> Any:
        if name == "inference.backends.torch":
            raise ImportError("No module named 'torch'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_torch)
    with pytest.raises(FailedPrecondition, match=r"embedcar\[torch\]") as err:
        make_backend(s, "torch")
    assert "\n" not in str(err.value)


@pytest.fixture()
def tiny_settings(bert: Path) -> Iterator[Settings]:
    yield Settings.load(environ={}, overrides={"model": {"models_dir": bert.parent, "name": "tiny", "variant": "fp32",
                                                         "intra_op_threads": 1}})


@pytest.mark.slow
def test_a_sidecar_on_the_torch_backend_answers_as_the_embedded_one(tiny_settings: Settings) -> None:
    from embedcar_client.client import Client
    from sidecar.app import SidecarThread

    got = {}
    for kind in ("embedded", "torch"):
        with SidecarThread(sidecar_settings(tiny_settings, backend=kind)) as car, Client(car.grpc_target) as c:
            got[kind] = c.embed([t for t in TEXTS if t])  # the sidecar refuses an empty text
    assert got["torch"].backend == "torch" and got["embedded"].backend == "embedded"
    assert got["torch"].model == got["embedded"].model  # fp32 both: one version id, one cache, one index
    assert _cos(got["embedded"].embeddings, got["torch"].embeddings).min() >= MIN_COS["fp32"]


@pytest.mark.gpu
def test_cuda_graphs_for_every_bucket_agree_with_fp32(bert: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the torch backend's CUDA graphs need a GPU")
    manifest = load_manifest(bert)
    backend = TorchBackend(bert, manifest, device="cuda", max_batch=8)
    assert not backend.ready() and not backend.runs_inline
    asyncio.run(backend.start())  # captured on the backend's worker thread, where it replays them
    assert backend.ready()
    buckets = {(b, n) for b in backend.batch_buckets for n in manifest.buckets}
    assert set(backend.graphs) == buckets and backend.eager_buckets == {}
    assert backend.version_id == manifest.variant_id("fp16")
    onnx = OnnxBackend(bert, manifest, variant="fp32", threads=1)
    tok = load_tokenizer(bert, manifest, role="query")
    for rows in (1, 3, 5, 8):
        batch = tok.batch(tok.encode((TEXTS * 2)[:rows]).ids)
        want, got = onnx.embed_sync(batch), backend.embed_sync(batch)
        assert got.shape == want.shape
        assert _cos(want, got).min() >= MIN_COS["fp16"], (rows, _cos(want, got))
    asyncio.run(backend.close())
