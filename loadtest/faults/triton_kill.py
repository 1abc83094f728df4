"""Triton SIGKILLed under load and restarted: the embedded fallback hides the outage; without it,
callers see only UNAVAILABLE during the outage and the sidecar recovers on its own.

Real processes: tritonserver (its own process group, SIGKILL for the whole group) and the sidecar
(`embedcar sidecar serve`), open-loop Embed at a fixed rate of cache misses from this process.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from embedcar_settings import Settings
from inference.triton.launcher import TritonServer, triton_unavailable_reason
from loadtest.faults.common import Phase, RecordingEmbedTarget, check_no_key_material, fmt, fresh_queries, load_during
from loadtest.faults.result import ScenarioResult
from loadtest.runner import OK, RunConfig
from loadtest.stack import SidecarProcess

NAME = "triton-kill"
TITLE = "Triton SIGKILLed under load, restarted later: with and without the embedded fallback"


def _sidecar(settings: Settings, triton: TritonServer, work: Path, *, fallback: bool,
             budget_ms: float) -> SidecarProcess:
    return SidecarProcess(settings, backend="triton", variant=triton.variant, triton_url=triton.grpc_url,
                          log_file=work / f"sidecar-fallback-{'on' if fallback else 'off'}-{budget_ms:g}.log",
                          extra_env={"EMBEDCAR_SIDECAR_EMBEDDED_FALLBACK": "1" if fallback else "0",
                                     "EMBEDCAR_SIDECAR_ADMISSION_BUDGET_MS": str(budget_ms)})


async def _outage(settings: Settings, triton: TritonServer, work: Path, *, fallback: bool, rate: float,
                  kill_at: float, outage_s: float, after_s: float, seed: int, budget_ms: float = 0.0) -> dict[str, Any]:
    duration = kill_at + outage_s + after_s
    config = RunConfig(rate=rate, duration_s=duration, warmup_s=2.0, deadline_ms=2000.0, seed=seed)
    texts = fresh_queries(settings, config.requests, seed)
    with _sidecar(settings, triton, work, fallback=fallback, budget_ms=budget_ms) as sc:
        target = RecordingEmbedTarget(sc.grpc_target)
        await target.start()
        try:
            # start() keeps the ports and returns once ready and warm
            result, when = await load_during(target, texts, config, (kill_at, triton.kill),
                                             (kill_at + outage_s, triton.start))
        finally:
            await target.close()
    phase = Phase.of(result)
    ready_at = when.get("start", duration)
    failures = [s for s in phase.samples if s.code != OK]
    last_fail_end = max((s.scheduled_s + s.latency_s for s in failures), default=None)
    first_fail = min((s.scheduled_s for s in failures), default=None)
    return {
        "requests": phase.n, "ok": phase.ok, "failed": phase.failed, "codes": phase.codes,
        "answered_by": dict(target.answered), "killed_at_s": kill_at, "triton_ready_at_s": round(ready_at, 3),
        "first_failure_at_s": None if first_fail is None else round(first_fail, 3),
        "failures": [(round(f.scheduled_s, 3), f.code) for f in failures[:20]],
        "recovered_s_after_ready": None if last_fail_end is None else round(max(last_fail_end - ready_at, 0.0), 3),
        "p50_ms": phase.pct(50), "p95_ms": phase.pct(95), "p99_ms": phase.pct(99),
    }


def run(settings: Settings, work: Path, *, quick: bool) -> ScenarioResult:
    res = ScenarioResult(NAME, TITLE)
    t0 = time.perf_counter()
    reason = triton_unavailable_reason()
    if reason:
        res.notes.append(f"skipped: {reason}")
        res.check("tritonserver runs here", "yes", reason, False)
        return res
    rate, kill_at, outage_s, after_s = (20.0, 3.0, 3.0, 4.0) if quick else (50.0, 10.0, 10.0, 10.0)
    s = settings.with_section("triton", repo_dir=work / "triton" / "repo")  # backends/ beside it
    triton = TritonServer(s, variant=settings.model.variant, log_file=work / "tritonserver.log")
    triton.start()
    try:
        on = asyncio.run(_outage(s, triton, work, fallback=True, rate=rate, kill_at=kill_at, outage_s=outage_s,
                                 after_s=after_s, seed=1))
        if not triton.running():
            triton.start()
        off = asyncio.run(_outage(s, triton, work, fallback=False, rate=rate, kill_at=kill_at, outage_s=outage_s,
                                  after_s=after_s, seed=2))
        budget = settings.sidecar.admission_budget_ms
        default = None
        if not quick and budget:
            if not triton.running():
                triton.start()
            default = asyncio.run(_outage(s, triton, work, fallback=True, rate=rate, kill_at=kill_at,
                                          outage_s=outage_s, after_s=after_s, seed=3, budget_ms=budget))
    finally:
        triton.stop()
    res.figures = {"rate": rate, "outage_s": outage_s, "fallback_on": on, "fallback_off": off,
                   "fallback_on_with_admission_budget": default}
    res.notes.append("The checked runs have admission's latency budget off: they measure the outage. Here "
                     "tritonserver shares the sidecar's 2 cores, and its restart (model load, warm-up) "
                     "slows every forward pass for a second or two, which the budget rightly sheds as overload.")
    if default is not None:
        res.notes.append(f"Same outage with the default {budget:g} ms budget: {default['failed']} of "
                         f"{default['requests']} refused ({default['codes']}), at "
                         f"{sorted({round(f[0]) for f in default['failures']})} s; Triton was ready again at "
                         f"{default['triton_ready_at_s']} s.")
    res.check("fallback on: failed requests", "0", f"{on['failed']} of {on['requests']}", on["failed"] == 0)
    res.check("fallback on: the fallback answered during the outage", "> 0 answers",
              str(on["answered_by"].get("embedded-fallback", 0)), on["answered_by"].get("embedded-fallback", 0) > 0)
    bad = {c: n for c, n in off["codes"].items() if c not in (OK, "unavailable")}
    res.check("fallback off: failures are UNAVAILABLE only", "only unavailable",
              ", ".join(f"{c} {n}" for c, n in off["codes"].items() if c != OK) or "none", not bad)
    rec = off["recovered_s_after_ready"]
    res.check("fallback off: recovery after Triton is ready", "<= 2 s", f"{fmt(rec, 2)} s",
              rec is not None and rec <= 2.0)
    res.notes.append(f"fallback on: P50/P95/P99 {fmt(on['p50_ms'])}/{fmt(on['p95_ms'])}/{fmt(on['p99_ms'])} ms "
                     f"over the whole run, answered by {on['answered_by']}")
    check_no_key_material(res, settings.triton, work)
    res.seconds = time.perf_counter() - t0
    return res
