"""The micro-batcher on the real ORT backend: merges what queues up per bucket, routes rows back."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from inference.backends.base import Embeddings
from inference.backends.onnx import OnnxBackend
from inference.errors import DeadlineExceeded
from inference.manifest import Manifest
from inference.tokenizer import QueryTokenizer, TokenBatch
from sidecar.batcher import MicroBatcher
from sidecar.metrics import Metrics
from tests.fixtures_sidecar import ProbeBackend


async def test_queued_requests_share_one_forward_pass(probe_backend: ProbeBackend,
                                                      tokenizer: QueryTokenizer) -> None:
    texts = [f"queued query {i}" for i in range(10)]
    ids = tokenizer.encode(texts).ids
    bucket = tokenizer.buckets[0]
    b = MicroBatcher(probe_backend, tokenizer, max_items=4, wait_us=0)
    b.start()
    try:
        probe_backend.hold.clear()
        first = asyncio.create_task(b.run(bucket, [ids[0]], None))
        for _ in range(2000):  # until the first pass is inside the (held) backend
            if probe_backend.calls:
                break
            await asyncio.sleep(0.005)
        # While the first forward pass runs, nine more arrive: they go out as 4 + 4 + 1.
        rest = [asyncio.create_task(b.run(bucket, [x], None)) for x in ids[1:]]
        await asyncio.sleep(0.05)
        probe_backend.hold.set()
        results = await asyncio.gather(first, *rest)
    finally:
        await b.close()
    assert probe_backend.calls == 4 and probe_backend.rows == 10
    got = np.concatenate([r[0] for r in results])
    want = await probe_backend.inner.embed(tokenizer.batch(ids, length=bucket))
    assert np.abs(got - want).max() < 1e-5  # every row went back to its own caller


class FakeClock:
    """A monotonic clock the test moves: every reading advances it by `step` seconds."""

    def __init__(self, start: float, step: float) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


async def test_no_wait_at_low_traffic_on_a_freshly_booted_clock(probe_backend: ProbeBackend,
                                                               tokenizer: QueryTokenizer) -> None:
    # A clock 5 s after boot and arrivals 2000 s apart against a 1000 s batching window: were a
    # lone request to sit the window out, this test could not finish.
    b = MicroBatcher(probe_backend, tokenizer, max_items=32, wait_us=10**9, clock=FakeClock(5.0, 2000.0))
    b.start()
    try:
        short = tokenizer.encode(["milk"]).ids
        long = tokenizer.encode([" ".join(["bread"] * 40)]).ids
        await asyncio.wait_for(b.run(16, short, None), 60)
        await asyncio.wait_for(b.run(16, short, None), 60)
        await asyncio.wait_for(b.run(64, long, None), 60)
        assert not b.dense()
        assert probe_backend.calls == 3 and probe_backend.rows == 3
    finally:
        await b.close()


async def test_dense_arrivals_wait_for_company_until_the_batch_is_full(probe_backend: ProbeBackend,
                                                                      tokenizer: QueryTokenizer) -> None:
    # Arrivals 1 µs apart against a 1000 s window: the batcher waits, and the fourth arrival (a full
    # batch) ends the wait at once: one forward pass of four rows, long before the window closes.
    b = MicroBatcher(probe_backend, tokenizer, max_items=4, wait_us=10**9, clock=FakeClock(5.0, 1e-6))
    b.start()
    try:
        ids = tokenizer.encode([f"dense {i}" for i in range(4)]).ids
        first = [asyncio.create_task(b.run(16, [x], None)) for x in ids[:2]]
        await asyncio.sleep(0.05)
        assert b.dense() and probe_backend.calls == 0  # two rows queued, waiting for company
        rest = [asyncio.create_task(b.run(16, [x], None)) for x in ids[2:]]
        await asyncio.wait_for(asyncio.gather(*first, *rest), 60)
        assert probe_backend.calls == 1 and probe_backend.rows == 4
    finally:
        await b.close()


async def test_the_wait_never_outlasts_the_oldest_deadline(probe_backend: ProbeBackend,
                                                           tokenizer: QueryTokenizer) -> None:
    # Dense traffic and a 1000 s window, but the queued request's deadline is 2 s away: the wait
    # ends in time to compute it, and it is answered, not expired.
    b = MicroBatcher(probe_backend, tokenizer, max_items=8, wait_us=10**9, clock=FakeClock(5.0, 1e-6))
    b.start()
    try:
        ids = tokenizer.encode(["deadline bound"]).ids
        await b.run(16, ids, None)  # one forward pass: the batcher learns what one costs
        await asyncio.wait_for(b.run(16, ids, b._clock() + 2.0), 60)
        assert b.dense() and probe_backend.calls == 2
    finally:
        await b.close()


async def test_expired_item_is_dropped_before_the_backend(probe_backend: ProbeBackend,
                                                          tokenizer: QueryTokenizer) -> None:
    b = MicroBatcher(probe_backend, tokenizer, max_items=8, wait_us=0)
    b.start()
    try:
        ids = tokenizer.encode(["expired"]).ids
        with pytest.raises(DeadlineExceeded):
            await b.run(16, ids, time.monotonic() - 0.001)
        assert probe_backend.calls == 0
    finally:
        await b.close()


class InlineProbe(ProbeBackend):
    """The probe with the in-process model's inline path: records which thread computed."""

    runs_inline = True

    def __init__(self, inner: ProbeBackend) -> None:
        super().__init__(inner.inner)
        self.inline_threads: list[int] = []

    def embed_sync(self, batch: TokenBatch) -> Embeddings:
        self.inline_threads.append(threading.get_ident())
        return self.inner.embed_sync(batch)


async def test_inline_forward_runs_on_the_loop_only_when_nothing_else_waits(probe_backend: ProbeBackend,
                                                                          tokenizer: QueryTokenizer) -> None:
    backend = InlineProbe(probe_backend)
    # Arrivals 2000 s apart: sparse, so only what is queued decides.
    b = MicroBatcher(backend, tokenizer, max_items=4, wait_us=0, inline=True, clock=FakeClock(5.0, 2000.0))
    b.start()
    try:
        short = tokenizer.encode(["milk"]).ids
        long = tokenizer.encode([" ".join(["bread"] * 40)]).ids
        alone = await b.run(16, short, None)
        assert backend.inline_threads == [threading.get_ident()] and backend.calls == 0
        # Two buckets queued at once: the first pass leaves the loop free for the one behind it
        # (the thread hop), the last one, with nothing left waiting, runs inline.
        both = await asyncio.gather(b.run(16, short, None), b.run(64, long, None))
        assert backend.calls == 1 and len(backend.inline_threads) == 2
    finally:
        await b.close()
    want = await probe_backend.inner.embed(tokenizer.batch(short, length=16))
    assert np.abs(alone.embeddings - want).max() < 1e-5
    assert np.abs(both[0].embeddings - want).max() < 1e-5


async def test_inline_forward_leaves_the_loop_once_arrivals_come_faster_than_passes(
        probe_backend: ProbeBackend, tokenizer: QueryTokenizer) -> None:
    # Arrivals 1 µs apart, one at a time (nothing queued): the first pass, with no gap known yet,
    # runs inline; once a pass is known to take more than half the gap, passes leave the loop, so
    # the loop stays free for cache hits, admission and refusals while the host is busy.
    backend = InlineProbe(probe_backend)
    metrics = Metrics()
    b = MicroBatcher(backend, tokenizer, max_items=4, wait_us=0, inline=True, clock=FakeClock(5.0, 1e-6),
                     metrics=metrics.for_model("m", "v"))
    b.start()
    try:
        ids = tokenizer.encode(["milk"]).ids
        for _ in range(3):
            await b.run(16, ids, None)
    finally:
        await b.close()
    assert len(backend.inline_threads) == 1 and backend.calls == 2
    passes = {t: metrics.registry.get_sample_value("embedcar_forward_passes_total",
                                                   {"model": "m", "version": "v", "thread": t})
              for t in ("loop", "worker")}
    assert passes == {"loop": 1.0, "worker": 2.0}


def test_inline_needs_a_pass_under_half_the_gap(probe_backend: ProbeBackend, tokenizer: QueryTokenizer) -> None:
    # An arrival during an inline pass is seen when the pass ends, so under load the measured gap
    # tends to the pass itself: a rule of "pass <= gap" held the loop inline at 2x overload (one
    # query per pass, the queue invisible to admission). Half the gap keeps the margin.
    b = MicroBatcher(InlineProbe(probe_backend), tokenizer, max_items=4, wait_us=0, inline=True)
    b._forward_s = 0.004
    b._gap_s = 0.004  # the gap a blocked loop reads: the pass itself
    assert not b._inline_now()
    b._gap_s = 0.0079
    assert not b._inline_now()
    b._gap_s = 0.010  # 100 queries/s against 4 ms passes
    assert b._inline_now()


async def test_inline_is_off_for_a_backend_that_cannot_compute_in_the_callers_thread(
        probe_backend: ProbeBackend, tokenizer: QueryTokenizer) -> None:
    b = MicroBatcher(probe_backend, tokenizer, max_items=4, wait_us=0, inline=True)
    assert not b.inline  # ProbeBackend keeps the base class's runs_inline = False
    b.start()
    try:
        await b.run(16, tokenizer.encode(["milk"]).ids, None)
    finally:
        await b.close()
    assert probe_backend.calls == 1


@pytest.mark.parametrize("lanes", [1, 2])
async def test_lanes_bound_the_forward_passes_in_flight(probe_backend: ProbeBackend, tokenizer: QueryTokenizer,
                                                       lanes: int) -> None:
    """With two lanes a request that arrives while a pass runs gets its own pass at once; with one
    it waits for the running one (and then shares the next)."""
    probe_backend.lanes = lanes
    ids = tokenizer.encode([f"lane query {i}" for i in range(3)]).ids
    bucket = tokenizer.buckets[0]
    b = MicroBatcher(probe_backend, tokenizer, max_items=8, wait_us=0)
    assert b.lanes == lanes
    b.start()
    try:
        probe_backend.hold.clear()
        tasks = [asyncio.create_task(b.run(bucket, [ids[0]], None))]
        for i in (1, 2):
            for _ in range(2000):  # until the pass before is inside the (held) backend
                if probe_backend.calls >= min(i, lanes):
                    break
                await asyncio.sleep(0.005)
            tasks.append(asyncio.create_task(b.run(bucket, [ids[i]], None)))
        await asyncio.sleep(0.05)
        assert probe_backend.calls == lanes  # passes in flight while the backend holds them
        probe_backend.hold.set()
        results = await asyncio.gather(*tasks)
    finally:
        await b.close()
    assert probe_backend.rows == 3 and probe_backend.calls == (2 if lanes == 1 else 3)
    want = await probe_backend.inner.embed(tokenizer.batch(ids, length=bucket))
    assert np.abs(np.concatenate([r[0] for r in results]) - want).max() < 1e-5


async def test_a_two_lane_backend_runs_concurrent_calls_on_its_share_of_the_threads(
        onnx_backend: OnnxBackend, model_dir: Path, manifest: Manifest, tokenizer: QueryTokenizer) -> None:
    two = OnnxBackend(model_dir, manifest, variant="fp32", threads=2, lanes=2)
    await two.start()
    try:
        assert (two.lanes, two.threads) == (2, 1)
        # No forward on the event loop beside other lanes: it would hold their next batches back.
        assert not MicroBatcher(two, tokenizer, max_items=8, wait_us=0, inline=True).inline
        assert MicroBatcher(onnx_backend, tokenizer, max_items=8, wait_us=0, inline=True).inline
        batches = [tokenizer.batch(tokenizer.encode([f"concurrent {i} milk"]).ids) for i in range(8)]
        got = await asyncio.gather(*(two.embed(x) for x in batches))
    finally:
        await two.close()
    for x, g in zip(batches, got, strict=True):
        assert np.abs(g - await onnx_backend.embed(x)).max() < 1e-5  # 1 thread or 2: the same vectors
