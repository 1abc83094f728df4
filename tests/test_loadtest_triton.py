"""A short run straight at Triton's ensemble, with its per-model statistics over the window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inference.tokenizer import QueryTokenizer
from loadtest.queries import query_stream
from loadtest.report import summarize
from loadtest.runner import OK, RunConfig, run_load
from loadtest.targets import TritonStats, TritonTarget

pytestmark = pytest.mark.triton


async def test_triton_target_reports_per_model_statistics(triton_server: Any, model_dir: Path,
                                                          tokenizer: QueryTokenizer) -> None:
    cfg = RunConfig(rate=10, duration_s=1.5, warmup_s=0.3, deadline_ms=30_000)
    target = TritonTarget([triton_server.grpc_url], model_dir, variant="fp32")
    await target.start()
    try:
        result = await run_load(target, query_stream(tokenizer, cfg.requests, seed=21, unique=True), cfg)
    finally:
        await target.close()
    assert all(s.code == OK for s in result.samples), result.errors_seen
    summary = summarize(result, name="triton", sla_ms=30_000)
    triton = summary["triton"]
    assert triton, "no Triton statistics over the window"
    # Only the measured window counts (warm-up left out). Triton counts a request when it finishes,
    # so a warm-up request whose reply came after the window opened may count inside it: at most
    # those (from the samples' own times, so this holds on a busy machine too), never the others.
    assert summary["requests"] == 15
    late_warmups = sum(1 for s in result.samples if s.warmup and s.scheduled_s + s.latency_s > 0)
    assert 15 <= triton[triton_server.ensembles[0]]["requests"] <= 15 + late_warmups
    assert any(r["executions"] > 0 and r["avg_batch"] >= 1 for r in triton.values())


async def test_triton_stats_reader_used_for_sidecar_runs(triton_server: Any) -> None:
    stats = TritonStats(triton_server.grpc_url)
    await stats.start()
    try:
        snap = await stats.read()
    finally:
        await stats.close()
    ensemble = triton_server.ensembles[0]
    assert snap is not None and ensemble in snap
    assert {"inference_count", "execution_count", "queue_ns", "compute_infer_ns"} <= set(snap[ensemble])
