"""The torch encoder (`embedcar triton repo --encoder torch`): its generated configs, and the CPU layout
served by the real tritonserver, answering the sidecar's Triton client as the embedded ONNX backend does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from inference.backends.onnx import OnnxBackend
from inference.backends.triton import TritonBackend
from inference.embedder import load_tokenizer
from inference.errors import InvalidInput, ModelError
from inference.manifest import Manifest, load_manifest
from inference.prepare import prepare_model
from inference.settings import Settings
from inference.triton import cli
from inference.triton.launcher import TritonServer
from inference.triton.repository import (
    ENCODERS,
    ENGINES_FILE,
    GPU_INSTANCES,
    PLAN_FILE,
    RepoModel,
    generate_models,
    generate_repository,
    load_config,
)
from tests.components import require_triton
from tests.fixtures_models import tiny_st_folder
from tests.fixtures_triton import triton_settings

pytestmark = pytest.mark.triton

TEXTS = ["milk", "organic whole milk 1 gallon", "gluten free bread", "dark chocolate 85% cocoa bar",
         "best marathon training shoes for women", "wireless noise cancelling headphones with long battery life"]
MODELS = Path(__file__).resolve().parent.parent / "models"
# A full-size model beside the tiny one: the bundled MiniLM where it was prepared with its weights/, else a
# MiniLM tuned here (`model tune` keeps its weights), where there is one.
REAL_MODELS = ("all-MiniLM-L6-v2", "grocery-tuned", "grocery-tuned-hn")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    """(the models folder, the manifest) of a tiny random BERT prepared with its weights/, whose query
    prompt is pooled without (every request carries a pooling skip)."""
    root = tmp_path_factory.mktemp("torch-tiny")
    src = tiny_st_folder(root / "st", "bert", pooling="mean", prompts={"query": "query: "}, include_prompt=False)
    return root / "models", prepare_model(root / "models", "tiny", from_dir=src, say=lambda _m: None)


def _configs(repo: Path) -> dict[str, mc.ModelConfig]:
    """kind (encoder, pooling, embedder) -> config of a one-version repository."""
    return {d.name.split(".")[0]: load_config(d / "config.pbtxt") for d in repo.iterdir()
            if (d / "config.pbtxt").exists()}


def test_gpu_torch_repository_needs_no_tensorrt(settings: Settings, tiny: tuple[Path, Manifest],
                                                tmp_path: Path) -> None:
    models, m = tiny
    repo = generate_repository(settings, m, models / "tiny", out_dir=tmp_path, target="gpu", variant="fp16",
                               encoder="torch")
    cfg = _configs(repo)
    assert set(cfg) == {"encoder", "embedder"}, "the torch encoder pools itself: no pooling step"
    enc, ens = cfg["encoder"], cfg["embedder"]
    assert enc.backend == "python" and enc.platform == ""
    (group,) = enc.instance_group
    assert group.kind == mc.ModelInstanceGroup.KIND_GPU and group.count == GPU_INSTANCES
    assert enc.parameters["dtype"].string_value == "float16"
    assert "threads" not in enc.parameters
    assert list(enc.dynamic_batching.preferred_batch_size) and not enc.dynamic_batching.HasField("default_queue_policy")
    # The ensemble the client knows: the same ids in (int32, as the CPU layouts'), `embedding` out.
    assert [(o.name, list(o.dims)) for o in enc.output] == [("embedding", [m.dim])]
    assert {i.data_type for i in enc.input} == {i.data_type for i in ens.input} == {mc.TYPE_INT32}
    assert [s.output_map["embedding"] for s in ens.ensemble_scheduling.step] == ["embedding"]
    code = (repo / next(d.name for d in repo.iterdir() if d.name.startswith("encoder.")) / "1")
    assert (code / "model.py").read_text().startswith('"""Triton Python-backend `encoder` on PyTorch')
    assert not (code / PLAN_FILE).exists() and not (repo / ENGINES_FILE).exists(), "nothing for trtexec to build"
    s = settings.with_section("triton", instances=2)
    again = _configs(generate_repository(s, m, models / "tiny", out_dir=tmp_path, target="gpu", variant="fp16",
                                         encoder="torch"))
    assert again["encoder"].instance_group[0].count == 2


def test_cpu_torch_repository_sized_to_the_cores(settings: Settings, tiny: tuple[Path, Manifest],
                                                 tmp_path: Path) -> None:
    models, m = tiny
    s = settings.with_section("triton", instances=3, ort_threads=1)
    enc = _configs(generate_repository(s, m, models / "tiny", out_dir=tmp_path, target="cpu", variant="fp32",
                                       encoder="torch"))["encoder"]
    (group,) = enc.instance_group
    assert group.kind == mc.ModelInstanceGroup.KIND_CPU and group.count == 3
    assert enc.parameters["threads"].string_value == "1" and enc.parameters["dtype"].string_value == "float32"


def test_what_the_torch_encoder_refuses(settings: Settings, tiny: tuple[Path, Manifest], manifest: Manifest,
                                        model_dir: Path, tmp_path: Path) -> None:
    models, m = tiny

    def gen(mf: Manifest, d: Path, variant: str, **kw: object) -> Path:
        return generate_models(settings, [RepoModel(mf, d, variant)], out_dir=tmp_path, **kw)  # type: ignore[arg-type]

    with pytest.raises(ModelError, match="int8"):
        gen(m, models / "tiny", "int8", target="gpu", encoder="torch")
    with pytest.raises(ModelError, match="fp32"):  # half precision on a CPU: emulated, slower than fp32
        gen(m, models / "tiny", "fp16", target="cpu", encoder="torch")
    with pytest.raises(InvalidInput, match="pooling step"):
        gen(m, models / "tiny", "fp32", target="cpu", encoder="torch", pooling_step=True)
    with pytest.raises(InvalidInput, match="tensorrt"):
        gen(m, models / "tiny", "fp32", target="cpu", encoder="tensorrt")
    with pytest.raises(InvalidInput, match="onnx"):
        gen(m, models / "tiny", "fp16", target="gpu", encoder="onnx")
    if manifest.weights_dir(model_dir) is None:
        with pytest.raises(ModelError, match="no PyTorch weights"):
            gen(manifest, model_dir, "fp32", target="cpu", encoder="torch")
    assert cli.ENCODERS == ENCODERS  # the CLI's own copy (it starts without importing the generator)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return out


@pytest.fixture(scope="module")
def served(tiny: tuple[Path, Manifest], settings: Settings, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[TritonServer]:
    """One tritonserver serving the tiny model and, where it has its weights, MiniLM on the torch encoder."""
    require_triton()
    models, _ = tiny
    names = ["tiny"]
    real = [MODELS / n for n in REAL_MODELS if (MODELS / n / "manifest.json").exists()
            and load_manifest(MODELS / n).weights_dir(MODELS / n) is not None]
    if real:
        (models / real[0].name).symlink_to(real[0], target_is_directory=True)
        names.append(real[0].name)
    s = triton_settings(settings, tmp_path_factory.mktemp("triton-torch")).with_section("model", models_dir=models)
    server = TritonServer(s, variant="fp32", models=names, encoder="torch")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def client(served: TritonServer) -> AsyncIterator[tuple[TritonServer, list[TritonBackend]]]:
    server = served.ensure_running()
    backends = [TritonBackend([server.grpc_url], m.manifest, variant="fp32", timeout_s=30.0) for m in server.served]
    for b in backends:
        await b.start()
    yield server, backends
    for b in backends:
        await b.close()


async def test_torch_encoder_answers_as_the_embedded_onnx_backend(
        client: tuple[TritonServer, list[TritonBackend]]) -> None:
    server, backends = client
    assert len(server.served) == 2 or not any((MODELS / n / "weights").is_dir() for n in REAL_MODELS)
    for served_model, backend in zip(server.served, backends, strict=True):
        m, model_dir = served_model.manifest, served_model.model_dir
        tok = load_tokenizer(model_dir, m)
        onnx = OnnxBackend(model_dir, m, variant="fp32", threads=1)
        assert backend.version_id == onnx.version_id
        assert server.repo is not None
        enc = load_config(server.repo / served_model.names.encoder / "config.pbtxt")
        assert enc.parameters["dtype"].string_value == "float32", "served by the torch encoder"
        assert tok.pool_skip > 0 or m.name != "tiny", "the tiny model's requests carry a pooling skip"
        ids = tok.encode(TEXTS).ids
        for bucket in [b for b in m.buckets if b >= max(map(len, ids))][:2]:
            batch = tok.batch(ids, length=bucket)
            got = await backend.embed(batch)
            want = onnx.embed_sync(batch)
            assert got.shape == (len(TEXTS), m.dim) and got.dtype == np.float32
            assert _cos(got, want).min() >= 0.9999, (m.name, bucket)
