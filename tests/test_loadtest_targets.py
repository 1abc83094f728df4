"""Target specs and the in-process (no server) target over the real ORT backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.errors import FailedPrecondition, InvalidInput
from inference.tokenizer import QueryTokenizer
from loadtest.queries import query_stream
from loadtest.report import summarize
from loadtest.runner import OK, RunConfig, run_load
from loadtest.stack import TargetSpec
from loadtest.targets import InProcessTarget


def test_target_specs() -> None:
    assert TargetSpec.parse("sidecar-embed:triton") == TargetSpec("sidecar-embed", "triton")
    assert TargetSpec.parse("http", "triton").label == "http:triton"
    assert TargetSpec.parse("baseline").label == "baseline"
    with pytest.raises(InvalidInput):
        TargetSpec.parse("nope")
    with pytest.raises(FailedPrecondition):  # an unknown backend, as make_backend says it
        TargetSpec.parse("sidecar-embed:gpu")
    pool = TargetSpec.parse("sidecar-stream@2")
    assert (pool.processes, pool.label) == (2, "sidecar-stream:embedded@2")
    assert TargetSpec.parse("http:triton@1").label == "http:triton"
    for bad in ("inprocess@2", "sidecar-embed@0", "sidecar-embed@two"):  # @N: N sidecar processes only
        with pytest.raises(InvalidInput, match="@"):
            TargetSpec.parse(bad)


async def test_in_process_target_runs_real_onnx_runtime(model_dir: Path, tokenizer: QueryTokenizer) -> None:
    cfg = RunConfig(rate=10, duration_s=1.0, warmup_s=0.3, deadline_ms=30_000)
    target = InProcessTarget(model_dir, variant="fp32", threads=1)
    await target.start()
    try:
        result = await run_load(target, query_stream(tokenizer, cfg.requests, seed=3, unique=True), cfg)
    finally:
        await target.close()
    assert all(s.code == OK for s in result.samples), result.errors_seen
    summary = summarize(result, name="inproc", sla_ms=30_000)
    assert summary["ok"] == 10
    assert summary["target"]["model"].endswith("/fp32")
    assert summary["stages_ms"]["inference"]["mean"] > 0
