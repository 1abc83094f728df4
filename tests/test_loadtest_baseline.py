"""The naive baseline server (real ORT, padded to 256) and the CLI end to end against it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from inference.backends.onnx import OnnxBackend
from inference.cli_main import main as cli_main
from inference.tokenizer import QueryTokenizer
from loadtest.baseline import BaselineServer


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> Iterator[BaselineServer]:
    with BaselineServer(model_dir, variant="fp32", threads=1) as server:
        yield server


def test_baseline_answers_like_the_embedded_backend(baseline: BaselineServer, tokenizer: QueryTokenizer,
                                                    onnx_backend: OnnxBackend) -> None:
    texts = ["organic gluten free pasta sauce under 5 dollars family size", "dog food"]
    r = httpx.post(f"{baseline.url}/v1/embeddings", json={"input": texts}, timeout=30, trust_env=False)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["model"].endswith("/fp32")
    emb = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert emb.shape == (2, 384)
    # Padding to 256 changes the cost, not the answer: the mask keeps pads out of the mean.
    enc = tokenizer.encode(texts)
    for i in range(2):
        ref = onnx_backend.embed_sync(tokenizer.batch([enc.ids[i]]))[0]
        assert float(emb[i] @ ref) > 0.999
    assert r.json()["usage"]["prompt_tokens"] == sum(enc.lengths)


def test_baseline_rejects_empty_input(baseline: BaselineServer) -> None:
    r = httpx.post(f"{baseline.url}/v1/embeddings", json={"input": ["  "]}, timeout=30, trust_env=False)
    assert r.status_code == 400


def test_cli_runs_a_short_load_test_against_the_baseline(baseline: BaselineServer, tmp_path: Path,
                                                         model_dir: Path) -> None:
    rc = cli_main(["loadtest", "--target", "baseline", "--baseline-url", baseline.url, "--rate", "4",
                   "--duration", "2", "--warmup", "0.5", "--no-cache", "--sla-ms", "30000", "--deadline-ms", "30000",
                   "--models-dir", str(model_dir.parent), "--out", str(tmp_path), "--name", "smoke"])
    summary = json.loads((tmp_path / "smoke.json").read_text())
    assert summary["requests"] == 8
    assert summary["errors"] == {}, summary["error_examples"]
    assert rc == 0 and summary["sla"]["pass"]  # end to end, not speed: 30 s leaves a busy machine out of it
    assert (tmp_path / "smoke.png").stat().st_size > 0 and (tmp_path / "smoke.md").exists()


def test_cli_compare_and_sweep_with_the_stub_target(tmp_path: Path, model_dir: Path) -> None:
    common = ["--rate", "20", "--duration", "0.5", "--warmup", "0", "--sla-ms", "1000",
              "--models-dir", str(model_dir.parent), "--out", str(tmp_path)]
    assert cli_main(["loadtest", "--compare", "stub,stub", *common, "--name", "cmp"]) == 0
    assert "| stub |" in (tmp_path / "cmp.md").read_text()
    assert cli_main(["loadtest", "--target", "stub", "--sweep", "10:20:10", *common, "--name", "sw"]) == 0
    sweep = json.loads(next(tmp_path.glob("sw-*sweep*.json")).read_text())
    assert sweep["best_rate"] == 20
