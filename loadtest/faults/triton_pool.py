"""Two Triton URLs behind one sidecar, one SIGKILLed under load: no request fails.

The embedded fallback is off here, so what is measured is the Triton client steering around the
dead server (a call that meets it is retried on the other URL; embeddings are idempotent).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from embedcar_settings import Settings
from inference.triton.launcher import TritonServer, triton_unavailable_reason
from loadtest.faults.common import Phase, RecordingEmbedTarget, check_no_key_material, fmt, fresh_queries, load_during
from loadtest.faults.result import ScenarioResult
from loadtest.runner import RunConfig
from loadtest.stack import SidecarProcess

NAME = "triton-pool"
TITLE = "Two Triton URLs, one SIGKILLed under load (fallback off)"


async def _run(settings: Settings, a: TritonServer, b: TritonServer, work: Path, *, rate: float, kill_at: float,
               after_s: float) -> Phase:
    config = RunConfig(rate=rate, duration_s=kill_at + after_s, warmup_s=2.0, deadline_ms=2000.0, seed=3)
    texts = fresh_queries(settings, config.requests, 3)
    with SidecarProcess(settings, backend="triton", variant=a.variant, triton_url=f"{a.grpc_url},{b.grpc_url}",
                        log_file=work / "sidecar.log",
                        extra_env={"EMBEDCAR_SIDECAR_EMBEDDED_FALLBACK": "0", "EMBEDCAR_SIDECAR_ADMISSION_BUDGET_MS":
                                   str(settings.sidecar.admission_budget_ms)}) as sc:
        target = RecordingEmbedTarget(sc.grpc_target)
        await target.start()
        try:
            result, _ = await load_during(target, texts, config, (kill_at, a.kill))
        finally:
            await target.close()
    return Phase.of(result)


def run(settings: Settings, work: Path, *, quick: bool) -> ScenarioResult:
    res = ScenarioResult(NAME, TITLE)
    t0 = time.perf_counter()
    reason = triton_unavailable_reason()
    if reason:
        res.check("tritonserver runs here", "yes", reason, False)
        return res
    rate, kill_at, after_s = (20.0, 3.0, 4.0) if quick else (50.0, 10.0, 20.0)
    servers = []
    for name in ("a", "b"):
        s = settings.with_section("triton", repo_dir=work / name / "repo")  # backends/ beside it
        servers.append(TritonServer(s, variant=settings.model.variant, log_file=work / f"tritonserver-{name}.log"))
    try:
        for srv in servers:
            srv.start()
        phase = asyncio.run(_run(settings, servers[0], servers[1], work, rate=rate, kill_at=kill_at, after_s=after_s))
    finally:
        for srv in servers:
            srv.stop()
    res.figures = {"rate": rate, "killed_at_s": kill_at, "requests": phase.n, "codes": phase.codes,
                   "p50_ms": phase.pct(50), "p95_ms": phase.pct(95), "p99_ms": phase.pct(99),
                   "max_ms": phase.pct(100)}
    res.check("failed requests", "0", f"{phase.failed} of {phase.n}", phase.n > 0 and phase.failed == 0)
    res.notes.append(f"P50/P95/max {fmt(phase.pct(50))}/{fmt(phase.pct(95))}/{fmt(phase.pct(100))} ms, "
                     "the kill included")
    check_no_key_material(res, settings.triton, work)
    res.seconds = time.perf_counter() - t0
    return res
