"""Overload at 2x and 5x the sidecar's SLA capacity with 50 ms client deadlines.

What a search node wants from an overloaded sidecar: the requests it accepts are still answered
within the SLA, the excess is refused at once (RESOURCE_EXHAUSTED / 429 + Retry-After) so the
caller can fall back, useful throughput stays near capacity, memory stays flat, and the first
normal call afterwards is normal. The SLA capacity is measured first, in the same run: the highest
rate of a short step sweep whose P95 stays within 20 ms with at most 1 % errors.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from demo_ui.settings import Settings
from loadtest.faults.common import Phase, RecordingEmbedTarget, fmt, fresh_queries, load_during, rss_mb
from loadtest.faults.result import ScenarioResult
from loadtest.runner import RunConfig, run_load
from loadtest.stack import SidecarProcess

NAME = "overload"
TITLE = "Overload at 2x and 5x the SLA capacity, 50 ms client deadlines (embedded backend)"
SLA_MS = 20.0
DEADLINE_MS = 50.0
REJECTED = "resource_exhausted"


async def _phase(target: RecordingEmbedTarget, settings: Settings, rate: float, seconds: float, seed: int,
                 warmup_s: float = 1.0) -> Phase:
    config = RunConfig(rate=rate, duration_s=seconds, warmup_s=warmup_s, deadline_ms=DEADLINE_MS, seed=seed,
                       concurrency=4096, spin_ms=0.0 if rate > 300 else 1.0)
    texts = fresh_queries(settings, config.requests, seed)
    result = await run_load(target, texts, config)
    return Phase.of(result)


async def _retry_after_probe(http_url: str, n: int) -> dict[str, Any]:
    """A burst of HTTP calls in the middle of the overload: do 429s carry Retry-After?"""
    async with httpx.AsyncClient(base_url=http_url, timeout=5.0) as client:
        async def one(i: int) -> tuple[int, str | None]:
            r = await client.post("/v1/embeddings", json={"input": f"retry after probe {i} {time.time_ns()}"})
            return r.status_code, r.headers.get("retry-after")

        got = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    answers = [g for g in got if isinstance(g, tuple)]
    too_many = [ra for code, ra in answers if code == 429]
    return {"calls": n, "answered": len(answers), "http_429": len(too_many),
            "with_retry_after": sum(1 for ra in too_many if ra is not None),
            "codes": sorted({code for code, _ in answers})}


def _watch_rss(pid: int | None, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        v = rss_mb(pid)
        if v is not None:
            out.append(v)
        stop.wait(0.25)


async def _scenario(settings: Settings, work: Path, quick: bool) -> dict[str, Any]:
    sweep = (100.0, 150.0) if quick else (100.0, 125.0, 150.0, 175.0, 200.0, 225.0, 250.0)
    step_s, over_s = (4.0, 5.0) if quick else (8.0, 30.0)
    factors = (2.0,) if quick else (2.0, 5.0)
    out: dict[str, Any] = {"sweep": {}, "overload": {}}
    with SidecarProcess(settings, backend="embedded", variant=settings.model.variant,
                        log_file=work / "sidecar-overload.log") as sc:
        target = RecordingEmbedTarget(sc.grpc_target)
        await target.start()
        try:
            unloaded = await _phase(target, settings, 20.0, 4.0 if quick else 10.0, seed=20)
            out["unloaded"] = {"rate": 20.0, "p50_ms": unloaded.pct(50), "p95_ms": unloaded.pct(95),
                               "codes": unloaded.codes}
            capacity = 0.0
            for i, rate in enumerate(sweep):
                ph = await _phase(target, settings, rate, step_s, seed=30 + i)
                p95 = ph.pct(95)
                ok = p95 is not None and p95 <= SLA_MS and ph.failed <= 0.01 * ph.n
                out["sweep"][f"{rate:g}"] = {"p95_ms": p95, "codes": ph.codes, "meets_sla": ok}
                if not ok:
                    break
                capacity = rate
            out["capacity"] = capacity
            rss_before = rss_mb(sc.pid)
            for j, factor in enumerate(factors):
                rate = max(capacity, sweep[0]) * factor
                samples: list[float] = []
                stop = threading.Event()
                watcher = threading.Thread(target=_watch_rss, args=(sc.pid, stop, samples), daemon=True)
                watcher.start()
                probe: dict[str, Any] = {}

                def probe_retry_after(box: dict[str, Any] = probe, url: str = sc.http_url) -> None:
                    box.update(asyncio.run(_retry_after_probe(url, 64)))

                config = RunConfig(rate=rate, duration_s=over_s, warmup_s=1.0, deadline_ms=DEADLINE_MS,
                                   seed=40 + j, concurrency=4096, spin_ms=0.0)
                texts = fresh_queries(settings, config.requests, 40 + j)
                target.deadlines.clear()
                result, _ = await load_during(target, texts, config, (over_s / 2, probe_retry_after))
                stop.set()
                watcher.join(2)
                ph = Phase.of(result)
                # Refused = RESOURCE_EXHAUSTED or a deadline the sidecar saw it could not meet, before any
                # backend time was spent; everything else was admitted (client-side expiries included).
                refused_deadline = target.deadlines["refused_at_admission"]
                rejected = ph.codes.get(REJECTED, 0) + refused_deadline
                admitted = ph.n - rejected
                missed = ph.codes.get("deadline_exceeded", 0) - refused_deadline
                out["overload"][f"{factor:g}x"] = {
                    "rate": rate, "requests": ph.n, "codes": ph.codes,
                    "accepted_p50_ms": ph.pct(50), "accepted_p95_ms": ph.pct(95), "accepted_p99_ms": ph.pct(99),
                    "admitted": admitted, "admitted_missed_deadline": missed,
                    "refused_for_deadline_at_admission": refused_deadline, "deadline_failures": dict(target.deadlines),
                    "admitted_missed_share": missed / admitted if admitted else 0.0,
                    "goodput_per_s": ph.ok / over_s,
                    "rejected_p50_ms": ph.pct(50, REJECTED), "rejected_p95_ms": ph.pct(95, REJECTED),
                    "pacer_late_share": result.pacer.late_share, "pacer_lag_p99_ms": result.pacer.lag_p99_ms,
                    "rss_mb_before": rss_before, "rss_mb_peak": max(samples, default=None),
                    "retry_after_probe": probe,
                }
            after = []
            for i in range(20):
                t = time.perf_counter()
                await target.call([f"a normal query after the storm {i}"], timeout_s=2.0)
                after.append((time.perf_counter() - t) * 1e3)
            out["after"] = {"median_ms": statistics.median(after), "max_ms": max(after)}
        finally:
            await target.close()
    return out


def run(settings: Settings, work: Path, *, quick: bool) -> ScenarioResult:
    res = ScenarioResult(NAME, TITLE)
    t0 = time.perf_counter()
    fig = asyncio.run(_scenario(settings, work, quick))
    res.figures = fig
    unloaded_p95 = fig["unloaded"]["p95_ms"] or 0.0
    cap = fig["capacity"]
    limit = max(SLA_MS, 1.5 * unloaded_p95)
    for name, o in fig["overload"].items():
        p95 = o["accepted_p95_ms"]
        res.check(f"{name}: accepted P95", f"<= {limit:.1f} ms (max(20, 1.5 x unloaded {unloaded_p95:.1f}))",
                  f"{fmt(p95)} ms", p95 is not None and p95 <= limit)
        res.check(f"{name}: admitted requests that missed their deadline", "<= 1 %",
                  f"{o['admitted_missed_share']:.2%} ({o['admitted_missed_deadline']} of {o['admitted']})",
                  o["admitted_missed_share"] <= 0.01)
        res.check(f"{name}: goodput", f">= 80 % of the SLA capacity {cap:g}/s",
                  f"{o['goodput_per_s']:.0f}/s", cap > 0 and o["goodput_per_s"] >= 0.8 * cap)
        rp95 = o["rejected_p95_ms"]
        res.check(f"{name}: rejections are fast", f"P95 <= unloaded answer P95 ({unloaded_p95:.1f} ms)",
                  f"{fmt(rp95, 2)} ms", rp95 is None or rp95 <= unloaded_p95)
        probe = o["retry_after_probe"]
        res.check(f"{name}: HTTP 429 carries Retry-After", "every 429",
                  f"{probe.get('with_retry_after', 0)} of {probe.get('http_429', 0)} (codes {probe.get('codes')})",
                  probe.get("with_retry_after", 0) == probe.get("http_429", 0))
        peak, before = o["rss_mb_peak"], o["rss_mb_before"]
        res.check(f"{name}: sidecar RSS bounded", "peak <= before + 150 MiB", f"{fmt(before)} -> {fmt(peak)} MiB",
                  peak is not None and before is not None and peak <= before + 150)
    base = fig["unloaded"]["p50_ms"] or 0.0
    after = fig["after"]["median_ms"]
    res.check("next normal call is normal", f"median <= 2 x unloaded P50 ({base:.1f}) + 2 ms", f"{after:.1f} ms",
              after <= 2 * base + 2.0)
    res.seconds = time.perf_counter() - t0
    return res
