"""The bf16 variant: OpenVINO on the fp32 graph, built, checked and served only where the CPU
computes bf16 natively (AMX or AVX512-BF16); elsewhere it is not built and a bf16 variant prepared
on another host is refused with the reason, never run in f32 under its name."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from embedcar_client.client import Client
from embedcar_settings import Settings
from inference import runtimes
from inference.backends.onnx import OnnxBackend
from inference.embedder import Embedder, load_tokenizer
from inference.errors import ModelError
from inference.manifest import Manifest, Variant
from inference.prepare import prepare_model
from loadtest.bench import model_report
from sidecar.app import SidecarThread
from tests.fixtures_models import st_reference, tiny_st_folder
from tests.fixtures_sidecar import sidecar_settings

TEXTS = ["best marathon training shoes for women", "milk",
         "organic gluten free pasta sauce family size under 5 dollars with wireless headphones for travel"]
NO_BF16 = "this CPU computes bf16 neither with AMX nor with AVX512-BF16 (a test stand-in)"


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.asarray((a * b).sum(axis=1))


def _embed(model_dir: Path, manifest: Manifest, variant: str) -> np.ndarray:
    backend = OnnxBackend(model_dir, manifest, variant=variant, threads=1)
    return asyncio.run(Embedder(load_tokenizer(model_dir, manifest), backend).embed(TEXTS)).embeddings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Manifest]:
    """(the sentence-transformers folder, the models folder, the manifest) of a tiny BERT prepared here."""
    root = tmp_path_factory.mktemp("bf16")
    src = tiny_st_folder(root / "st", "bert", pooling="mean", prompts={"query": "query: "})
    return src, root / "models", prepare_model(root / "models", "tiny", from_dir=src, say=lambda _m: None)


@pytest.fixture
def without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host as one without AMX / AVX512-BF16 (what OpenVINO reports there, stood in for)."""
    monkeypatch.setattr(runtimes, "bf16_unavailable", lambda: NO_BF16)
    monkeypatch.setattr(model_report, "bf16_unavailable", lambda: NO_BF16)


def _with_bf16(manifest: Manifest) -> Manifest:
    """The manifest as a host with bf16 would have prepared it: bf16 on the fp32 file."""
    fp32 = manifest.variants["fp32"]
    bf16 = Variant(fp32.file, fp32.sha256, "bf16", fp32.fused, {"min_cos": 0.99999})
    return dataclasses.replace(manifest, variants={**manifest.variants, "bf16": bf16})


def test_bf16_is_built_checked_and_served_in_bf16_where_the_cpu_computes_it(tiny: tuple[Path, Path, Manifest]) -> None:
    why = runtimes.bf16_unavailable()
    if why:
        pytest.skip(f"this host cannot run bf16: {why}")
    src, models, m = tiny
    bf16 = m.variants["bf16"]
    assert bf16.precision == "bf16" and bf16.file == m.variants["fp32"].file  # no second copy of the weights
    assert bf16.check["min_cos"] >= 0.999
    got, fp32 = _embed(models / "tiny", m, "bf16"), _embed(models / "tiny", m, "fp32")
    assert _cos(got, st_reference(src, TEXTS, "query: ")).min() >= 0.999
    # computed in bf16, not quietly in f32: close to fp32, yet not the same numbers
    assert np.abs(got - fp32).max() > 1e-5


def test_a_sidecar_serves_the_bf16_variant(settings: Settings, tiny: tuple[Path, Path, Manifest]) -> None:
    why = runtimes.bf16_unavailable()
    if why:
        pytest.skip(f"this host cannot run bf16: {why}")
    src, models, m = tiny
    s = sidecar_settings(settings)
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, models_dir=models, name="tiny", variant="bf16"))
    with SidecarThread(s) as sc, Client(sc.grpc_target) as client:
        out = client.embed(TEXTS)
    assert out.model == m.variant_id("bf16") and out.backend == "embedded"
    assert _cos(out.embeddings, st_reference(src, TEXTS, "query: ")).min() >= 0.999


@pytest.mark.usefixtures("without_bf16")
def test_a_host_without_bf16_builds_none_and_refuses_one_made_elsewhere(tmp_path: Path,
                                                                       tiny: tuple[Path, Path, Manifest]) -> None:
    said: list[str] = []
    src = tiny_st_folder(tmp_path / "st", "bert", pooling="cls")
    m = prepare_model(tmp_path / "models", "plain", from_dir=src, say=said.append)
    assert "bf16" not in m.variants and "bf16" not in m.refused  # not a verdict on the model: another host may
    assert any(line.startswith("bf16 variant not built: ") and NO_BF16 in line for line in said), said

    _src, models, made_elsewhere = tiny
    elsewhere = _with_bf16(made_elsewhere)
    with pytest.raises(ModelError, match=r"bf16 variant cannot run here: .*AMX.*EMBEDCAR_MODEL_VARIANT"):
        _embed(models / "tiny", elsewhere, "bf16")
    chosen, skipped = model_report.variants_to_measure(elsewhere, ())
    assert "bf16" not in chosen and skipped["bf16"] == NO_BF16


def test_triton_refuses_the_bf16_variant_by_name(settings: Settings, tiny: tuple[Path, Path, Manifest],
                                                 tmp_path: Path) -> None:
    from inference.triton.repository import generate_repository

    _src, models, m = tiny
    with pytest.raises(ModelError, match=r"bf16 variant of tiny runs on the embedded backend only.*"
                                         r"EMBEDCAR_MODEL_VARIANT"):
        generate_repository(settings, _with_bf16(m), models / "tiny", out_dir=tmp_path / "repo", target="cpu",
                            variant="bf16")
    assert not (tmp_path / "repo").exists()
