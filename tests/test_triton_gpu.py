"""The TensorRT path: engine build/caching, and the GPU repository served end to end.

The `gpu` tests need an NVIDIA GPU, trtexec and a full tritonserver (with the TensorRT backend) on
PATH, e.g. inside nvcr.io/nvidia/tritonserver:24.10-py3 with the project installed; elsewhere they
skip and say which of these is missing. The engine cache logic itself is tested everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from inference.backends.onnx import OnnxBackend
from inference.backends.triton import TritonBackend
from inference.manifest import Manifest
from inference.ports import free_port
from inference.settings import Settings
from inference.tokenizer import QueryTokenizer
from inference.triton.names import served_names
from inference.triton.repository import PLAN_FILE, RepoModel, generate_models, generate_repository
from inference.triton.trt_engine import (
    EngineBuildError,
    Profile,
    build_engine,
    cache_key,
    install_repository,
    trtexec_command,
)

ROOT = Path(__file__).resolve().parent.parent


def gpu_missing() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU here (nvidia-smi not found)"
    if subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0:
        return "nvidia-smi finds no usable GPU"
    if shutil.which("trtexec") is None and not Path("/usr/src/tensorrt/bin/trtexec").exists():
        return "trtexec (TensorRT) not installed"
    if shutil.which("tritonserver") is None:
        return "no full tritonserver on PATH (the pytriton wheel has no TensorRT backend)"
    return None


def _trtexec() -> str:
    return shutil.which("trtexec") or "/usr/src/tensorrt/bin/trtexec"


# --- engine cache: runs everywhere ---------------------------------------------------------------
def test_cache_key_changes_with_model_tensorrt_and_gpu() -> None:
    base = cache_key("a" * 64, "10.5.0", "NVIDIA A10G")
    assert base == cache_key("a" * 64, "10.5.0", "NVIDIA A10G")
    assert base != cache_key("b" * 64, "10.5.0", "NVIDIA A10G")
    assert base != cache_key("a" * 64, "10.6.0", "NVIDIA A10G")
    assert base != cache_key("a" * 64, "10.5.0", "NVIDIA H100 80GB HBM3")
    assert base != cache_key("a" * 64, "10.5.0", "NVIDIA A10G", Profile(max=(128, 256)))
    assert "/" not in base and " " not in base


def test_trtexec_command_covers_the_shape_range(manifest: Manifest) -> None:
    cmd = trtexec_command(Path("m.onnx"), Path("e.plan"), inputs=manifest.inputs)
    flags = dict(c.split("=", 1) for c in cmd[1:] if "=" in c)
    assert "--fp16" in cmd
    for name in manifest.inputs:
        assert f"{name}:1x16" in flags["--minShapes"]
        assert f"{name}:8x32" in flags["--optShapes"]
        assert f"{name}:256x512" in flags["--maxShapes"]


def _fake_trtexec(tmp: Path) -> Path:
    """Stands in for trtexec where TensorRT cannot run: writes its --saveEngine file, counts calls."""
    script = tmp / "trtexec"
    script.write_text('#!/bin/sh\necho call >> "$(dirname "$0")/calls"\n'
                      'for a in "$@"; do case "$a" in --saveEngine=*) echo plan > "${a#--saveEngine=}";; esac; done\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_engine_is_built_once_then_reused(tmp_path: Path) -> None:
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"onnx-bytes")
    fake = str(_fake_trtexec(tmp_path))

    def build(gpu: str = "Test GPU") -> Path:
        return build_engine(onnx, tmp_path / "cache", trtexec=fake, gpu=gpu, trt_version="10.5.0", log=False)

    first = build()
    assert build() == first and first.read_text() == "plan\n"
    assert (tmp_path / "calls").read_text().count("call") == 1
    assert build("Other GPU") != first and (tmp_path / "calls").read_text().count("call") == 2
    onnx.write_bytes(b"changed model")
    assert build() != first


def test_every_encoder_of_a_gpu_repository_gets_its_engine(settings: Settings, manifest: Manifest, model_dir: Path,
                                                          tmp_path: Path) -> None:
    """What the compose engine step runs: the plans go into the versioned encoder folders the
    repository lists, one per model version, built from each model's own ONNX."""
    other = dataclasses.replace(manifest, version_id=manifest.version_id + "x")
    repo = generate_models(settings, [RepoModel(manifest, model_dir, "fp16"), RepoModel(other, model_dir, "fp16")],
                           out_dir=tmp_path / "repo", target="gpu")
    fake = str(_fake_trtexec(tmp_path))
    engines = install_repository(repo, model_dir.parent, tmp_path / "cache", trtexec=fake, gpu="g", trt_version="1")
    assert len(engines) == 2 and engines[0] == engines[1]  # the same ONNX: one engine, reused
    for m in (manifest, other):
        assert (repo / served_names(m, "fp16").encoder / "1" / PLAN_FILE).read_text() == "plan\n"
    (repo / "ENGINES").unlink()
    with pytest.raises(EngineBuildError, match="generate the GPU repository first"):
        install_repository(repo, model_dir.parent, tmp_path / "cache", trtexec=fake, gpu="g", trt_version="1")


def test_failed_build_leaves_no_engine(tmp_path: Path) -> None:
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"x")
    with pytest.raises(EngineBuildError, match="trtexec failed"):
        build_engine(onnx, tmp_path / "cache", trtexec="false", gpu="g", trt_version="1", log=False)
    assert not list((tmp_path / "cache").rglob(PLAN_FILE))
    with pytest.raises(EngineBuildError, match="no ONNX model"):
        build_engine(tmp_path / "missing.onnx", tmp_path / "cache", gpu="g", trt_version="1", log=False)


# --- the real TensorRT path ---------------------------------------------------------------------
def _ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def _gpu_server(settings: Settings, manifest: Manifest, model_dir: Path, tmp: Path) -> Iterator[str]:
    """A full tritonserver on the GPU repository of `model_dir`'s fp16 variant (engine built or reused)."""
    repo = generate_repository(settings, manifest, model_dir, out_dir=tmp / "repo", target="gpu", variant="fp16")
    engine = build_engine(model_dir / manifest.variants["fp16"].file, tmp / "engines", inputs=manifest.inputs,
                          trtexec=_trtexec())
    shutil.copyfile(engine, repo / served_names(manifest, "fp16").encoder / "1" / PLAN_FILE)
    grpc, http = free_port(), free_port()
    log = (tmp / "tritonserver.log").open("wb")
    proc = subprocess.Popen(["tritonserver", f"--model-repository={repo}", f"--grpc-port={grpc}",
                             f"--http-port={http}", "--allow-metrics=false", "--grpc-address=127.0.0.1",
                             "--http-address=127.0.0.1"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _ready(http):
            if proc.poll() is not None:
                pytest.fail(f"tritonserver (GPU) exited during start-up (status {proc.returncode}); log tail:\n"
                            f"{(tmp / 'tritonserver.log').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("tritonserver (GPU) not ready after 300 s; log tail:\n"
                            f"{(tmp / 'tritonserver.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"127.0.0.1:{grpc}"
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def gpu_triton(settings: Settings, manifest: Manifest, model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reason = gpu_missing()
    if reason:
        pytest.skip(reason)
    if "fp16" not in manifest.variants:
        pytest.skip("the model has no fp16 variant")
    with _gpu_server(settings, manifest, model_dir, tmp_path_factory.mktemp("gpu")) as url:
        yield url


@pytest.mark.gpu
def test_engine_cache_reused_on_restart(model_dir: Path, manifest: Manifest, tmp_path: Path) -> None:
    reason = gpu_missing()
    if reason:
        pytest.skip(reason)
    onnx = model_dir / manifest.variants["fp16"].file
    first = build_engine(onnx, tmp_path, inputs=manifest.inputs, trtexec=_trtexec())
    mtime = first.stat().st_mtime_ns
    assert build_engine(onnx, tmp_path, inputs=manifest.inputs, trtexec=_trtexec()) == first
    assert first.stat().st_mtime_ns == mtime


@pytest.mark.gpu
async def test_tensorrt_ensemble_matches_embedded(gpu_triton: str, manifest: Manifest, onnx_backend: OnnxBackend,
                                                  tokenizer: QueryTokenizer) -> None:
    b = TritonBackend([gpu_triton], manifest, variant="fp16", timeout_s=30.0)
    await b.start()
    try:
        for bucket in manifest.buckets:
            texts = ["milk", "organic whole milk", " ".join(["apple"] * (bucket - 2))]
            batch = tokenizer.batch(tokenizer.encode(texts).ids, length=bucket)
            got, want = await b.embed(batch), onnx_backend.embed_sync(batch)
            assert float(np.min(np.sum(got * want, axis=1))) >= 0.999, bucket  # fp16 engine vs fp32 ORT
        stats = await b.statistics()
        assert stats[b.names.encoder]["success_count"] > 0
    finally:
        await b.close()


@pytest.mark.gpu
async def test_a_modernbert_folder_builds_a_tensorrt_engine_and_serves(settings: Settings, tmp_path: Path) -> None:
    """The reference deployment's architecture from a user's folder: a tiny ModernBERT (local sliding
    window shorter than the texts, no token_type_ids) prepared, its fp16 engine built, served by the
    GPU ensemble, and agreeing with sentence-transformers; padded rows whose local window is all
    padding must not turn the batch's vectors into NaN (the head pools with a select)."""
    reason = gpu_missing()
    if reason:
        pytest.skip(reason)
    from inference.embedder import load_tokenizer
    from inference.prepare import prepare_model
    from tests.fixtures_models import st_reference, tiny_st_folder

    src = tiny_st_folder(tmp_path / "st", "modernbert", pooling="mean", prompts={"query": "query: "})
    m = prepare_model(tmp_path / "models", "mine", from_dir=src, say=lambda _m: None)
    assert "fp16" in m.variants and "token_type_ids" not in m.inputs
    s = dataclasses.replace(settings, model=dataclasses.replace(settings.model, models_dir=tmp_path / "models",
                                                                   name="mine", variant="fp16"))
    texts = ["milk", "organic gluten free pasta sauce family size under 5 dollars with wireless headphones"]
    with _gpu_server(s, m, tmp_path / "models" / "mine", tmp_path) as url:
        b = TritonBackend([url], m, variant="fp16", timeout_s=30.0)
        await b.start()
        try:
            tok = load_tokenizer(tmp_path / "models" / "mine", m)
            got = await b.embed(tok.batch(tok.encode(texts).ids, length=64))
        finally:
            await b.close()
    ref = st_reference(src, texts, "query: ")
    ref = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    assert np.isfinite(got).all()
    assert float(np.min(np.sum(got * ref, axis=1))) >= 0.999
