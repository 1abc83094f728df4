"""The runner against a tiny real HTTP server: schedule kept, latency from schedule, errors by code."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from inference.errors import DeadlineExceeded
from loadtest.faults.common import Phase, deadline_kind
from loadtest.report import markdown, summarize
from loadtest.runner import OK, RunConfig, run_load, settled_stats
from loadtest.targets import HttpEmbedTarget, StubTarget, Target, Timings
from tests.fixtures_loadtest import StubBehaviour, stub_http_server

TEXTS = [f"organic gluten free pasta sauce number {i}" for i in range(50)]


async def _run(url: str, config: RunConfig):  # type: ignore[no-untyped-def]
    target = HttpEmbedTarget(url)
    await target.start()
    try:
        return await run_load(target, TEXTS, config)
    finally:
        await target.close()


async def test_every_scheduled_request_is_sent_once_in_order() -> None:
    # How close to its time each request leaves is the pacer's job (test_loadtest_schedule.py, on a
    # virtual clock) and a measured figure (`embedcar loadtest --target stub`, docs/bench/loadtest.md):
    # on a shared machine it is not something a test can promise.
    cfg = RunConfig(rate=40, duration_s=1.0, warmup_s=0.25)
    async with stub_http_server() as server:
        result = await _run(server.url, cfg)
    assert server.count == len(result.samples) == 50
    assert [s.index for s in result.samples] == list(range(50))
    # The schedule itself: 1/40 s apart, the warm-up before the measured window's zero.
    assert np.allclose(np.diff([s.scheduled_s for s in result.samples]), 1 / 40)
    assert result.samples[10].scheduled_s == 0.0
    # Warm-up requests are sent but flagged and left out of the stats.
    assert sum(s.warmup for s in result.samples) == 10
    assert len(result.measured) == 40
    assert all(s.code == OK for s in result.samples)
    assert all(0 <= s.send_lag_s <= s.latency_s for s in result.samples)
    summary = summarize(result, name="t")
    assert summary["requests"] == 40 and summary["ok"] == 40
    assert summary["offered_rate"] == 40


async def test_a_server_stall_shows_in_the_latency_of_every_request_sent_during_it() -> None:
    # The server stalls at its 11th request, and the stall ends only when ten more requests have
    # arrived behind it: a closed-loop client would never send them (and the run would time out).
    # An open-loop one keeps sending, and each stalled request carries its wait in its latency.
    stall_over = asyncio.Event()
    stalled: dict[int, float] = {}  # sample index -> server arrival
    ended: list[float] = []

    async def stall(n: int, texts: list[str]) -> None:
        if n < 11 or stall_over.is_set():
            return
        if len(stalled) == 10:  # the 21st request: ten arrived while the stall was on
            ended.append(time.perf_counter())
            stall_over.set()
            return
        stalled[int(texts[0].rsplit(" ", 1)[1])] = time.perf_counter()
        await stall_over.wait()

    texts = [f"organic gluten free pasta sauce number {i}" for i in range(100)]
    cfg = RunConfig(rate=50, duration_s=1.5, warmup_s=0, deadline_ms=60_000)
    async with stub_http_server(StubBehaviour(on_request=stall)) as server:
        target = HttpEmbedTarget(server.url)
        await target.start()
        try:
            result = await asyncio.wait_for(run_load(target, texts, cfg), 60)
        finally:
            stall_over.set()
            await target.close()
    assert ended and len(stalled) == 10, "the stall did not end by requests arriving behind it"
    assert all(s.code == OK for s in result.samples)
    lat = {s.index: s.latency_s for s in result.samples}
    for i, arrived in stalled.items():
        # Latency runs from the scheduled time (<= the arrival) to the reply (>= the stall's end).
        assert lat[i] >= ended[0] - arrived, (i, lat[i], ended[0] - arrived)


async def test_errors_are_counted_by_code() -> None:
    def status(n: int) -> int:
        return 429 if n % 4 == 0 else 503 if n % 7 == 0 else 200

    cfg = RunConfig(rate=60, duration_s=1.0, warmup_s=0)
    async with stub_http_server(StubBehaviour(status_for=status)) as server:
        result = await _run(server.url, cfg)
    summary = summarize(result, name="t", max_error_share=0.05)
    assert summary["errors"] == {"resource_exhausted": server.statuses[429], "unavailable": server.statuses[503]}
    assert summary["ok"] == server.statuses[200]
    assert summary["error_share"] > 0.05 and not summary["sla"]["pass"]
    assert "HTTP 429" in summary["error_examples"]["resource_exhausted"]


async def test_a_server_that_never_answers_ends_every_request_at_its_deadline() -> None:
    never = asyncio.Event()

    async def hang(n: int, texts: list[str]) -> None:
        await never.wait()

    cfg = RunConfig(rate=20, duration_s=0.5, warmup_s=0, deadline_ms=60)
    async with stub_http_server(StubBehaviour(on_request=hang)) as server:
        try:
            result = await asyncio.wait_for(_run(server.url, cfg), 60)
        finally:
            never.set()
    assert len(result.samples) == 10
    assert {s.code for s in result.samples} == {"deadline_exceeded"}
    assert all(s.latency_s >= 0.060 - 1e-6 for s in result.samples)  # never given up early


class _RecordingTarget(Target):
    """Answers after `service_s`; records the timeout each call was given."""

    name = "recording"

    def __init__(self, service_s: float) -> None:
        self.service_s = service_s
        self.timeouts: dict[str, float] = {}  # first text -> the timeout its call got

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        self.timeouts[texts[0]] = timeout_s
        await asyncio.sleep(self.service_s)
        return None


async def test_deadline_is_counted_from_the_scheduled_time() -> None:
    # One at a time, 30 ms each, offered every 25 ms: later requests wait behind the cap, and the
    # wait is spent from their deadline (a request's budget starts at its scheduled time).
    target = _RecordingTarget(0.03)
    cfg = RunConfig(rate=40, duration_s=0.5, warmup_s=0, concurrency=1, deadline_ms=5_000)
    result = await run_load(target, TEXTS, cfg)
    assert all(s.code == OK for s in result.samples)
    assert len(target.timeouts) == len(result.samples) == 20
    for s in result.samples:  # request i sends TEXTS[i]
        assert target.timeouts[TEXTS[s.index]] == pytest.approx(5.0 - s.send_lag_s, abs=1e-9)
    assert result.samples[-1].send_lag_s > 0  # the case is not vacuous: the last one did wait


async def test_concurrency_cap_queues_requests_and_the_wait_counts_as_latency() -> None:
    cfg = RunConfig(rate=40, duration_s=0.5, warmup_s=0, concurrency=1)
    async with stub_http_server(StubBehaviour(service_s=0.05)) as server:
        result = await _run(server.url, cfg)
    assert all(s.code == OK for s in result.samples)
    lags = [s.send_lag_s for s in result.samples]
    # One at a time at 50 ms each, offered every 25 ms: each waits longer than the one before.
    assert lags[-1] > lags[1] + 0.2
    assert all(s.latency_s >= s.send_lag_s for s in result.samples)


class _LoopBlockingTarget(Target):
    """Blocks the generator's own event loop once (as a CPU-starved generator would stall)."""

    name = "blocking"

    def __init__(self) -> None:
        self.calls = 0

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        self.calls += 1
        if self.calls == 10:
            time.sleep(0.25)  # noqa: ASYNC251 - deliberately blocks the loop, like a starved generator
        return None


async def test_generator_reports_its_own_lag_and_warns_when_it_slips() -> None:
    cfg = RunConfig(rate=50, duration_s=1.0, warmup_s=0)
    result = await run_load(_LoopBlockingTarget(), TEXTS, cfg)
    assert result.pacer.lag_max_ms > 150
    assert not result.pacer.kept and result.pacer.warning() is not None
    summary = summarize(result, name="t")
    assert summary["generator"]["warning"] and "fell behind" in markdown(summary)
    # The releases that were late carry their lag in their latency (measured from the schedule).
    late = [s for s in result.samples if s.send_lag_s > 0.1]
    assert late and all(s.latency_s >= s.send_lag_s for s in late)


class _LaggingStats(StubTarget):
    """Server statistics that catch up with the last requests a few reads late (as Triton's do)."""

    def __init__(self, catch_up: int) -> None:
        super().__init__()
        self.reads = 0
        self.catch_up = catch_up

    async def server_stats(self) -> dict[str, dict[str, int]] | None:
        self.reads += 1
        return {"embedder": {"requests": 15 - max(self.catch_up - self.reads + 1, 0)}}


async def test_the_window_statistics_are_read_once_they_stop_moving() -> None:
    lagging = _LaggingStats(catch_up=2)
    assert await settled_stats(lagging, pause_s=0.001) == {"embedder": {"requests": 15}}
    assert await settled_stats(StubTarget()) is None  # no statistics: no waiting either
    stuck = _LaggingStats(catch_up=10_000)  # never settles: gives up after max_s with the last read
    t0 = time.perf_counter()
    got = await asyncio.wait_for(settled_stats(stuck, pause_s=0.01, max_s=0.05), 60)  # it does give up
    # ... not before max_s, and with the last of its reads (a stopwatch ceiling would flake).
    assert time.perf_counter() - t0 >= 0.05 and stuck.reads >= 2
    assert got == {"embedder": {"requests": 15 - (stuck.catch_up - stuck.reads + 1)}}


class _DeadlineTarget(Target):
    """Every call fails with a DEADLINE_EXCEEDED whose message says where (as the sidecar's do)."""

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        n = int(texts[0].rsplit(" ", 1)[1])
        raise DeadlineExceeded("deadline leaves 1.0 ms, a pass needs 3.0 ms" if n % 2 else
                               "deadline expired waiting for a shared inference")


async def test_each_failure_keeps_its_message_and_a_phase_counts_only_its_own_window() -> None:
    # Warm-up failures must not count in the measured window's figures: the overload scenario's
    # "admitted that missed their deadline" is the window's DEADLINE_EXCEEDED less the window's
    # refusals at admission, and a count over the whole run once made it negative.
    cfg = RunConfig(rate=200, duration_s=0.1, warmup_s=0.05)
    result = await run_load(_DeadlineTarget(), TEXTS, cfg)
    assert len(result.samples) == 30 and len(result.measured) == 20
    assert all(s.message.startswith("deadline ") for s in result.samples)
    kinds = Phase.of(result).deadline_kinds()
    assert kinds == {"refused_at_admission": 10, "expired_in_sidecar": 10}
    assert deadline_kind("no answer within the deadline (client-side guard)") == "expired_client_side"
