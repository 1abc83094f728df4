"""The bench's typist and statistics, against a real demo server (in-process search)."""

from __future__ import annotations

import asyncio

import pytest

from demo_ui.ratecap import RateCap
from demo_ui.slot import LatestSlot
from loadtest.bench.demo import breakdown, format_summary, load_queries, percentile, run_bench, sample_queries
from tests.fixtures_demo import InProcessSearch, inprocess_search, running_demo

__all__ = ["inprocess_search"]  # fixture imported for pytest


async def test_bench_types_queries_and_times_every_answer(inprocess_search: InProcessSearch) -> None:
    queries = ["milk", "greek yogurt", "milk"]
    async with running_demo(inprocess_search) as addr:
        res = await run_bench(f"ws://{addr}/ws", queries, key_interval_ms=2.0, pause_ms=10.0)
    s = res.summary()
    assert s["keystrokes_sent"] == sum(len(q) for q in queries)
    assert s["answered"] + s["superseded"] == s["keystrokes_sent"]
    assert s["lost"] == 0 and not s["errors"]
    assert set(s["stages"]) == {"total", "sidecar", "hops", "network", "server", "cache", "tokenize", "queue",
                                "inference", "search", "lexical"}
    total = s["stages"]["total"]
    assert 0 < total["p50_ms"] <= total["p95_ms"] <= total["p99_ms"]
    assert "P95 per keystroke" in format_summary({**s}, 20.0)


def test_breakdown_adds_up_to_the_client_total() -> None:
    reply = {"server_ms": 6.0, "timings_ns": {"cache": 100_000, "tokenize": 200_000, "queue": 0,
                                              "inference": 3_000_000, "search": 700_000, "total": 4_500_000}}
    parts = breakdown(reply, 9.0)
    assert parts["network"] == pytest.approx(3.0)
    assert parts["server"] == pytest.approx(2.0)
    assert parts["sidecar"] == pytest.approx(4.5) and parts["hops"] == pytest.approx(4.5)
    assert sum(v for k, v in parts.items() if k not in ("total", "sidecar", "hops")) == pytest.approx(9.0)


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile([3.0], 95) == 3.0


def test_query_sampling_is_repeatable_and_repeats_popular_queries() -> None:
    pool = load_queries()
    assert len(pool) >= 100 and all(q == q.strip() and q for q in pool)
    a, b = sample_queries(200, seed=1), sample_queries(200, seed=1)
    assert a == b and len(a) == 200
    assert a.count(pool[0]) > a.count(pool[-1])


async def test_latest_slot_keeps_only_the_newest() -> None:
    slot: LatestSlot[int] = LatestSlot()
    assert slot.put(1) is None
    assert slot.put(2) == 1
    assert await slot.take() == 2 and len(slot) == 0
    waiter = asyncio.create_task(slot.take())
    await asyncio.sleep(0)
    slot.put(3)
    assert await asyncio.wait_for(waiter, 1) == 3


def test_rate_cap_refills_over_time() -> None:
    now = [0.0]
    cap = RateCap(2.0, clock=lambda: now[0])
    assert [cap.allow() for _ in range(3)] == [True, True, False]
    assert cap.refused_in_a_row == 1
    now[0] += 0.5
    assert cap.allow() and cap.refused_in_a_row == 0
    with pytest.raises(ValueError):
        RateCap(0)
