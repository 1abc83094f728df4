"""The micro-batcher on the real ORT backend: merges what queues up per bucket, routes rows back."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from inference.errors import DeadlineExceeded
from inference.tokenizer import QueryTokenizer
from sidecar.batcher import MicroBatcher
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
        first = asyncio.create_task(b.submit(bucket, [ids[0]], None))
        for _ in range(2000):  # until the first pass is inside the (held) backend
            if probe_backend.calls:
                break
            await asyncio.sleep(0.005)
        # While the first forward pass runs, nine more arrive: they go out as 4 + 4 + 1.
        rest = [asyncio.create_task(b.submit(bucket, [x], None)) for x in ids[1:]]
        await asyncio.sleep(0.05)
        probe_backend.hold.set()
        results = await asyncio.gather(first, *rest)
    finally:
        await b.close()
    assert probe_backend.calls == 4 and probe_backend.rows == 10
    got = np.concatenate([r[0] for r in results])
    want = await probe_backend.inner.embed(tokenizer.batch(ids, length=bucket))
    assert np.abs(got - want).max() < 1e-5  # every row went back to its own caller


async def test_no_wait_at_low_traffic_and_buckets_stay_apart(probe_backend: ProbeBackend,
                                                             tokenizer: QueryTokenizer) -> None:
    # A 1000 s batching window: were a lone request to sit it out, this test could not finish.
    b = MicroBatcher(probe_backend, tokenizer, max_items=32, wait_us=10**9)
    b.start()
    try:
        short = tokenizer.encode(["milk"]).ids
        long = tokenizer.encode([" ".join(["bread"] * 40)]).ids
        await asyncio.wait_for(b.submit(16, short, None), 60)
        await asyncio.gather(b.submit(16, short, None), b.submit(64, long, None))
        assert probe_backend.calls == 3  # one pass per bucket, never mixed shapes
    finally:
        await b.close()


async def test_expired_item_is_dropped_before_the_backend(probe_backend: ProbeBackend,
                                                          tokenizer: QueryTokenizer) -> None:
    b = MicroBatcher(probe_backend, tokenizer, max_items=8, wait_us=0)
    b.start()
    try:
        ids = tokenizer.encode(["expired"]).ids
        with pytest.raises(DeadlineExceeded):
            await b.submit(16, ids, time.monotonic() - 0.001)
        assert probe_backend.calls == 0
    finally:
        await b.close()
