"""The hot-query cache: LRU order, TTL on read, and entries the garbage collector need not traverse."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from sidecar.cache import EmbeddingCache, Entry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _entry(i: int) -> Entry:
    return Entry(np.full(4, i, dtype=np.float32), i % 2 == 1, i + 3)


def test_a_hit_returns_what_was_put_read_only() -> None:
    c = EmbeddingCache("v1", 10, 60.0)
    c.put(c.key("milk"), _entry(5))
    e = c.get(c.key("milk"))
    assert e is not None and e.vector.tolist() == [5.0] * 4 and e.truncated and e.tokens == 8
    with pytest.raises(ValueError):
        e.vector[0] = 1.0  # shared by every later hit
    assert c.get(c.key("bread")) is None
    assert c.key("milk") != EmbeddingCache("v2", 10, 60.0).key("milk")  # per model version


def test_the_least_recently_used_entry_goes_first() -> None:
    c = EmbeddingCache("v", 3, 60.0)
    for i in range(3):
        c.put(c.key(f"q{i}"), _entry(i))
    assert c.get(c.key("q0")) is not None  # q0 used: q1 is now the oldest
    c.put(c.key("q3"), _entry(3))
    assert len(c) == 3
    assert c.get(c.key("q1")) is None
    assert all(c.get(c.key(q)) is not None for q in ("q0", "q2", "q3"))


def test_an_entry_expires_after_its_ttl() -> None:
    clock = Clock()
    c = EmbeddingCache("v", 10, 30.0, clock=clock)
    c.put(c.key("eggs"), _entry(1))
    clock.now += 29.9
    assert c.get(c.key("eggs")) is not None
    clock.now += 0.2
    assert c.get(c.key("eggs")) is None and len(c) == 0  # dropped when found expired
    c.put(c.key("eggs"), _entry(2))  # a fresh put starts a new lifetime
    e = c.get(c.key("eggs"))
    assert e is not None and e.tokens == 5


def test_a_disabled_cache_keeps_nothing() -> None:
    c = EmbeddingCache("v", 0, 60.0)
    c.put(c.key("milk"), _entry(1))
    assert not c.enabled and c.get(c.key("milk")) is None and len(c) == 0


def test_a_full_cache_adds_nothing_for_the_collector_to_traverse() -> None:
    """Stored as tracked objects, 100k entries made each full collection of the sidecar ~40-50 ms."""
    c = EmbeddingCache("v", 5_000, 60.0)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(5_000):
        c.put(c.key(f"query {i}"), _entry(i))
    gc.collect()  # exact tuples of untracked values are untracked on the collector's first look
    assert len(gc.get_objects()) - before < 50
    assert c.get(c.key("query 4999")) is not None
