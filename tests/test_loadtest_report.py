"""Reports: percentiles agree with numpy, SLA verdict, Triton window, files readable, sweep."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inference.errors import InvalidInput
from loadtest.report import summarize, triton_window, write_comparison, write_run
from loadtest.runner import OK, RunConfig, RunResult, Sample
from loadtest.schedule import pacer_report
from loadtest.sweep import parse_sweep, sweep, write_sweep
from loadtest.targets import StubTarget


def _result(latencies_ms: np.ndarray, codes: list[str] | None = None, *, duration_s: float = 10.0,
            before: dict[str, dict[str, int]] | None = None,
            after: dict[str, dict[str, int]] | None = None) -> RunResult:
    n = len(latencies_ms)
    codes = codes or [OK] * n
    rate = n / duration_s
    samples = [Sample(i, i / rate, 0.0001, float(ms) / 1e3, codes[i], False,
                      {"tokenize": 20_000, "inference": int(ms * 1e6 * 0.8), "total": int(ms * 1e6)})
               for i, ms in enumerate(latencies_ms)]
    cfg = RunConfig(rate=rate, duration_s=duration_s, warmup_s=0)
    return RunResult({"target": "synthetic"}, cfg, samples, pacer_report(np.full(n, 1e-4)), duration_s, 0.5,
                     before, after, {c: f"example {c}" for c in set(codes) if c != OK})


def test_percentiles_agree_with_numpy_on_the_recorded_samples() -> None:
    rng = np.random.default_rng(0)
    lat = rng.lognormal(mean=1.5, sigma=0.6, size=997)
    s = summarize(_result(lat), name="x")
    for p in (50, 90, 95, 99):
        assert s["latency_ms"][f"p{p}"] == pytest.approx(np.percentile(lat, p), rel=1e-9)
    assert s["latency_ms"]["max"] == pytest.approx(lat.max())
    assert s["latency_ms"]["mean"] == pytest.approx(lat.mean())
    assert s["stages_ms"]["inference"]["p95"] == pytest.approx(np.percentile(lat * 0.8, 95), rel=1e-3)


def test_sla_needs_both_p95_within_budget_and_few_errors() -> None:
    lat = np.full(100, 5.0)
    assert summarize(_result(lat), name="x", sla_ms=20)["sla"]["pass"]
    assert not summarize(_result(lat), name="x", sla_ms=4)["sla"]["pass"]
    codes = [OK] * 90 + ["resource_exhausted"] * 10  # fast rejections must not pass the SLA
    s = summarize(_result(lat, codes), name="x", sla_ms=20, max_error_share=0.01)
    assert not s["sla"]["pass"]
    assert s["errors"] == {"resource_exhausted": 10}
    assert s["ok"] == 90


def test_triton_statistics_are_diffed_over_the_window() -> None:
    before = {"embedder": {"inference_count": 100, "execution_count": 100, "success_count": 100,
                           "success_ns": 10**8, "queue_count": 100, "queue_ns": 10**7},
              "encoder": {"inference_count": 100, "execution_count": 50, "success_count": 100,
                          "success_ns": 10**8, "queue_count": 100, "queue_ns": 0,
                          "compute_infer_count": 100, "compute_infer_ns": 3 * 10**8}}
    after = {"embedder": {"inference_count": 300, "execution_count": 300, "success_count": 300,
                          "success_ns": 10**8 + 200 * 4_000_000, "queue_count": 300, "queue_ns": 10**7 + 200 * 50_000},
             "encoder": {"inference_count": 500, "execution_count": 150, "success_count": 500,
                         "success_ns": 10**8, "queue_count": 500, "queue_ns": 400 * 100_000,
                         "compute_infer_count": 500, "compute_infer_ns": 3 * 10**8 + 400 * 2_000_000}}
    w = triton_window(before, after)
    assert w is not None
    assert w["embedder"]["requests"] == 200
    assert w["embedder"]["queue_us"] == pytest.approx(50.0)
    assert w["embedder"]["success_us"] == pytest.approx(4000.0)
    assert w["encoder"]["avg_batch"] == pytest.approx(4.0)  # 400 inferences in 100 executions
    assert w["encoder"]["compute_infer_us"] == pytest.approx(2000.0)
    assert triton_window(None, after) is None


def test_report_files_are_written_and_readable(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    rng = np.random.default_rng(1)
    lat = rng.gamma(3.0, 2.0, size=500)
    codes = [OK] * 495 + ["deadline_exceeded"] * 5
    before = {"embedder": {"inference_count": 0, "execution_count": 0, "success_count": 0, "success_ns": 0}}
    after = {"embedder": {"inference_count": 495, "execution_count": 400, "success_count": 495,
                          "success_ns": 495 * 3_000_000}}
    result = _result(lat, codes, before=before, after=after)
    summary = summarize(result, name="run1")
    paths = write_run(result, summary, tmp_path)
    loaded = json.loads(paths["json"].read_text())
    assert loaded["latency_ms"]["p95"] == pytest.approx(summary["latency_ms"]["p95"])
    assert loaded["errors"] == {"deadline_exceeded": 5}
    assert len(loaded["timeline"]) == 10
    md = paths["md"].read_text()
    assert "P95" in md and "deadline_exceeded" in md and "Triton per-model" in md and "avg batch" in md
    img = mpimg.imread(paths["png"])
    assert img.shape[0] > 300 and img.shape[1] > 300
    rows = paths["csv"].read_text().splitlines()
    assert rows[0].startswith("index,scheduled_s") and len(rows) == 501
    other = summarize(_result(lat * 2), name="run2")
    cmp_paths = write_comparison([summary, other], tmp_path, "side")
    table = cmp_paths["md"].read_text()
    assert "run1" in table and "run2" in table
    assert len(json.loads(cmp_paths["json"].read_text())["runs"]) == 2
    assert mpimg.imread(cmp_paths["png"]).shape[0] > 100


def test_parse_sweep() -> None:
    assert parse_sweep("50:100:25") == [50, 75, 100]
    for bad in ("50:100", "0:10:5", "100:50:10", "a:b:c"):
        with pytest.raises(InvalidInput):
            parse_sweep(bad)


async def test_sweep_reports_the_highest_rate_meeting_the_sla(tmp_path: Path) -> None:
    # An in-process stub answering in ~1 ms: every step passes a generous budget, and the sweep
    # stops at the first failing step (the impossible 0.01 ms budget fails at once).
    target = StubTarget(service_ms=1.0)
    texts = iter(range(10**6))
    base = RunConfig(duration_s=0.5, warmup_s=0)
    res = await sweep(target, [20, 40], base, lambda n: [f"q{next(texts)}" for _ in range(n)], name="sw",
                      sla_ms=250)
    assert [s["config"]["rate"] for s in res.steps] == [20, 40]
    assert res.best_rate == 40
    paths = write_sweep(res, tmp_path)
    assert "40 requests/s" in paths["md"].read_text()
    assert json.loads(paths["json"].read_text())["best_rate"] == 40
    strict = await sweep(target, [20, 40], base, lambda n: ["q"] * n, name="sw2", sla_ms=0.01)
    assert strict.best_rate is None and len(strict.steps) == 1
