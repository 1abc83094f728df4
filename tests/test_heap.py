"""inference.heap: the sidecar freezes its startup heap out of full collections; the load generator
runs without full collections; and an index a reload replaces leaves no cycles to freeze."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from catalog.index import ProductIndex
from catalog.publish import publish_index
from catalog.settings import Settings
from catalog.sources import Product
from inference import heap
from sidecar.search_index import IndexHolder


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Leave the test process's collector as it was found."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settle_freezes_what_exists_and_leaves_later_objects_to_the_collector(unfrozen: None) -> None:
    frozen = heap.settle()
    assert frozen > 1000 and 0 < gc.get_freeze_count() <= frozen  # frozen objects still die by refcount
    later = [[i] for i in range(100)]
    tracked = {id(o) for o in gc.get_objects()}
    assert all(id(x) in tracked for x in later)  # new objects are still collected as usual


def test_no_full_collections_within_and_the_collector_restored_after(unfrozen: None) -> None:
    young, middle, old = gc.get_threshold()
    with heap.no_full_collections():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[:2] == (young, middle) and gc.get_threshold()[2] >= 2**30
    assert gc.get_threshold() == (young, middle, old) and gc.get_freeze_count() == 0


def test_watch_pauses_reports_each_collection_until_stopped() -> None:
    seen: list[tuple[int, float]] = []
    stop = heap.watch_pauses(lambda gen, s: seen.append((gen, s)))
    try:
        gc.collect()
        gc.collect(0)
    finally:
        stop()
    assert [g for g, _ in seen[-2:]] == [2, 0] and all(s >= 0 for _, s in seen)
    n = len(seen)
    gc.collect()
    assert len(seen) == n


def test_a_sidecar_in_its_own_process_exports_its_pauses() -> None:
    from sidecar.metrics import Metrics

    m = Metrics()
    stop = heap.watch_pauses(m.observe_gc_pause)
    try:
        gc.collect()
    finally:
        stop()
    text = m.render().decode()
    assert 'embedcar_gc_pause_seconds_count{generation="2"} 1.0' in text


def _publish(s: Settings, n: int, seed: int) -> Path:
    x = np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    products = [Product(f"p{seed}-{i}", {"title": f"item {i}"}, i) for i in range(n)]
    version, _ = publish_index(s, x, products, {"model_id": "test-model"}, index_type="flat")
    return version


def test_a_dropped_index_is_freed_by_reference_counting_alone(tmp_path: Path) -> None:
    """What settle() froze is only released without the collector if it holds no cycles: the index
    objects a reload swaps out must not, or every reload would leak one. (Opening one leaves a few
    cycles of the standard library's own, numpy's header parsing: settle() collects before it freezes.)"""
    s = Settings.load(environ={}, overrides={"catalog": {"index_root": tmp_path, "use_gpu": False}})
    _publish(s, 30, 0)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        index = ProductIndex.from_settings(s.catalog, expected_model_id=None, index_root=tmp_path)
        assert index.size == 30
        ref = weakref.ref(index)
        del index
        assert ref() is None  # freed on the spot, no collection needed
        gc.collect()
        ours = [o for o in gc.garbage if type(o).__module__.split(".")[0] in {"catalog", "faiss", "tantivy", "sidecar"}]
        assert ours == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_the_holder_calls_on_load_for_the_first_index_and_each_reload(tmp_path: Path) -> None:
    s = Settings.load(environ={}, overrides={"catalog": {"index_root": tmp_path, "use_gpu": False}})
    _publish(s, 20, 0)
    loads: list[str] = []
    holder = IndexHolder(index_root=tmp_path, poll_s=0.01, catalog=s.catalog,
                         on_load=lambda: loads.append(str(holder.current().version)))  # type: ignore[union-attr]
    await holder.start()
    try:
        assert len(loads) == 1
        second = _publish(s, 25, 1)
        async with asyncio.timeout(60):
            while len(loads) < 2:  # noqa: ASYNC110 - the holder polls on its own
                await asyncio.sleep(0.01)
        assert loads[-1] == second.name
    finally:
        await holder.close()
