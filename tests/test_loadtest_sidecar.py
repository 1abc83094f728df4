"""Short load runs against a real Sidecar (embedded backend) through the gRPC and HTTP targets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from inference.cli_main import main as cli_main
from inference.tokenizer import QueryTokenizer
from loadtest.queries import query_stream
from loadtest.report import summarize
from loadtest.runner import OK, RunConfig, run_load
from loadtest.targets import HttpEmbedTarget, SidecarEmbedTarget, Target
from tests.components import require_triton

# Low rate, generous deadline: this checks the machinery on a shared box, not speed.
CONFIG = RunConfig(rate=10, duration_s=1.5, warmup_s=0.3, deadline_ms=30_000)


async def _run(target: Target, texts: list[str]) -> Any:
    await target.start()
    try:
        return await run_load(target, texts, CONFIG)
    finally:
        await target.close()


async def test_grpc_embed_target_against_a_real_sidecar(sidecar_embedded: Any, tokenizer: QueryTokenizer) -> None:
    texts = query_stream(tokenizer, CONFIG.requests, seed=11, unique=True)
    result = await _run(SidecarEmbedTarget(sidecar_embedded.grpc_target), texts)
    assert all(s.code == OK for s in result.samples), result.errors_seen
    summary = summarize(result, name="sidecar", sla_ms=30_000)
    assert summary["ok"] == summary["requests"] == 15
    assert summary["target"]["model"].endswith("/fp32")
    # The sidecar reports its stages; they land in the report to show where the time goes.
    assert {"tokenize", "inference", "total"} <= set(summary["stages_ms"])
    # Latency from the schedule is never below the server's own total.
    for s in result.measured:
        assert s.timings_ns is not None and s.latency_s * 1e9 >= s.timings_ns["total"]


def test_several_addresses_are_a_pool_spread_round_robin(sidecar_embedded: Any, tmp_path: Path, model_dir: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`--sidecar a,b` (running sidecars): one connection each, requests alternating over them."""
    a = sidecar_embedded.grpc_target
    b = f"localhost:{sidecar_embedded.grpc_port}"  # the same sidecar under a second name: a second connection
    rc = cli_main(["loadtest", "--target", "sidecar-stream", "--sidecar", f"{a}, {b}", "--rate", "10",
                   "--duration", "1", "--warmup", "0.4", "--no-cache", "--deadline-ms", "30000", "--sla-ms", "30000",
                   "--models-dir", str(model_dir.parent), "--out", str(tmp_path), "--name", "remote-pool"])
    summary = json.loads((tmp_path / "remote-pool.json").read_text())
    assert rc == 0 and summary["ok"] == 10, summary["error_examples"]
    assert [(m["address"], m["requests"]) for m in summary["target"]["pool"]] == [(a, 7), (b, 7)]  # 14 with warm-up
    rc = cli_main(["loadtest", "--target", "sidecar-stream@2", "--sidecar", a, "--duration", "1",
                   "--models-dir", str(model_dir.parent), "--out", str(tmp_path)])
    assert rc == 2 and "@N starts N sidecars" in capsys.readouterr().err  # a pool of running ones: addresses


async def test_http_target_against_a_real_sidecar(sidecar_embedded: Any, tokenizer: QueryTokenizer) -> None:
    texts = query_stream(tokenizer, CONFIG.requests, seed=12, unique=True)
    result = await _run(HttpEmbedTarget(f"http://127.0.0.1:{sidecar_embedded.http_port}"), texts)
    assert all(s.code == OK for s in result.samples), result.errors_seen
    assert result.target["model"].endswith("/fp32")


@pytest.mark.slow
def test_start_stack_runs_a_sidecar_process_and_stops_it(tmp_path: Path, model_dir: Path) -> None:
    # --start-stack: the sidecar runs as `embedcar sidecar serve` in a child process on free ports.
    rc = cli_main(["loadtest", "--start-stack", "--target", "http:embedded", "--rate", "5", "--duration", "1",
                   "--warmup", "0.4", "--no-cache", "--deadline-ms", "30000", "--sla-ms", "30000",
                   "--models-dir", str(model_dir.parent), "--out", str(tmp_path), "--name", "stack",
                   "--log-dir", str(tmp_path / "logs")])
    summary = json.loads((tmp_path / "stack.json").read_text())
    assert summary["errors"] == {}, summary["error_examples"]
    assert rc == 0 and summary["ok"] == 5
    assert summary["target"]["spec"] == "http:embedded"
    assert (tmp_path / "logs" / "sidecar-embedded.log").exists()


@pytest.mark.slow
def test_a_pool_of_sidecar_processes_shares_the_load_and_the_cores(tmp_path: Path, model_dir: Path) -> None:
    """`target@2`: two sidecars, each with half the model's threads, requests spread round-robin."""
    rc = cli_main(["loadtest", "--start-stack", "--target", "sidecar-stream:embedded@2", "--threads", "2",
                   "--rate", "10", "--duration", "1", "--warmup", "0.4", "--no-cache", "--deadline-ms", "30000",
                   "--sla-ms", "30000", "--models-dir", str(model_dir.parent), "--out", str(tmp_path),
                   "--name", "pool", "--log-dir", str(tmp_path / "logs")])
    summary = json.loads((tmp_path / "pool.json").read_text())
    assert rc == 0 and summary["ok"] == 10, summary["error_examples"]
    assert summary["target"]["spec"] == "sidecar-stream:embedded@2"
    addresses = {m["address"] for m in summary["target"]["pool"]}
    assert len(addresses) == 2
    cpu = summary["cpu_ms_per_request"]
    assert set(cpu) == {"load generator", "sidecar", "sidecar-2"}
    assert cpu["sidecar"] > 0.5 and cpu["sidecar-2"] > 0.5  # both computed forwards
    for name in ("sidecar-embedded.log", "sidecar-embedded-2.log"):
        assert '"intra_op_threads": "1",' in (tmp_path / "logs" / name).read_text()  # half of --threads 2


@pytest.mark.slow
def test_stream_over_triton_reports_triton_phases_and_cpu_per_process(tmp_path: Path, model_dir: Path) -> None:
    require_triton()
    trace = tmp_path / "trace.json"
    rc = cli_main(["loadtest", "--start-stack", "--target", "sidecar-stream:triton", "--rate", "10", "--duration",
                   "1.5", "--warmup", "0.5", "--no-cache", "--deadline-ms", "30000", "--sla-ms", "30000",
                   "--models-dir", str(model_dir.parent), "--out", str(tmp_path), "--name", "traced",
                   "--log-dir", str(tmp_path / "logs"), "--triton-trace", str(trace)])
    summary = json.loads((tmp_path / "traced.json").read_text())
    assert rc == 0 and summary["ok"] == 15, summary["error_examples"]
    phases = summary["triton_phases_us"]
    ensemble = next((m for m in phases if m.startswith("embedder.")), None)  # embedder.<model>.<hash>
    encoder = next((m for m in phases if m.startswith("encoder.")), None)
    assert ensemble is not None and encoder is not None, phases
    whole = phases[ensemble]["whole request in the server"]
    execute = phases[encoder]["execute (Python-backend round trip)"]
    assert 0 < execute[0] < whole[0]  # the encoder's forward is part of the request's time in Triton
    cpu = summary["cpu_ms_per_request"]
    assert set(cpu) == {"load generator", "sidecar", "tritonserver"}
    assert cpu["tritonserver"] > 1.0  # the forward runs in Triton's stub: milliseconds of CPU per query
    assert "Inside Triton" in (tmp_path / "traced.md").read_text()
