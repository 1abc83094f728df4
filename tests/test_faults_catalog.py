"""The fault suite's catalog scenarios in their short form, on real processes and real FAISS.

index-swap: a real sidecar serves Search under open-loop load while a separate process publishes
new index versions. job-kill: `embedcar catalog build` SIGKILLed mid-embedding and mid-publish,
then resumed, against an uninterrupted run. The long runs are `embedcar faults`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from catalog.fusion import SearchMode
from catalog.publish import publish_index
from catalog.sources import Product
from embedcar_settings import Settings
from loadtest.faults import index_swap, job_kill
from loadtest.faults.result import ScenarioResult
from sidecar.search_index import IndexHolder


def checks(res: ScenarioResult) -> dict[str, bool]:
    return {c.name: c.passed for c in res.checks}


def failed(res: ScenarioResult) -> str:
    return json.dumps([c for c in res.to_json()["checks"] if not c["passed"]] + res.notes, indent=1)


@pytest.mark.slow
def test_index_swap_scenario(settings: Settings, model_dir: Path, tmp_path: Path) -> None:
    res = index_swap.run(settings, tmp_path, quick=True)
    assert res.passed, failed(res)
    got = checks(res)
    for name in ("failed searches", "replies naming a valid version", "hits from the version the reply names",
                 "no reply older than one already served", "final version is the newest", "swaps done"):
        assert got[name], name
    fig = res.figures
    assert fig["swaps"] >= 2 and fig["searches"] >= 100
    assert fig["versions_seen"] >= 2, fig  # the load ran across at least one swap


@pytest.mark.slow
def test_job_kill_scenario(settings: Settings, model_dir: Path, tmp_path: Path) -> None:
    res = job_kill.run(settings, tmp_path, quick=True)
    assert res.passed, failed(res)
    got = checks(res)
    for name in ("kills landed", "a kill during publish", "resumed to completion",
                 "ids equal to the uninterrupted run", "vectors bit-equal to the uninterrupted run",
                 "search results equal to the uninterrupted run", "partial versions visible",
                 "visible versions load with matching checksums"):
        assert got[name], name
    fig = res.figures
    assert fig["kills"] == 2 and fig["attempts"] == 3
    assert fig["kill_points"][-1]["landed"].startswith("publish:")
    assert fig["kill_points"][0]["landed"].startswith(("embedding:", "start-up:"))


def test_kill_points_are_seeded_and_the_last_is_the_publish() -> None:
    import random

    a = job_kill.kill_points(random.Random(7), 5, 15)
    b = job_kill.kill_points(random.Random(7), 5, 15)
    assert [(p.after_chunks, p.u) for p in a] == [(p.after_chunks, p.u) for p in b]
    assert [p.publish for p in a] == [False] * 4 + [True]
    chunks = [p.after_chunks for p in a[:-1]]
    assert chunks == sorted(set(chunks)) and max(chunks) < 14  # distinct, short of the last chunk


def _publish(s: Settings, n: int, seed: int, tag: str) -> tuple[Path, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    products = [Product(f"{tag}-{i}", {"title": f"item {i} {tag}"}, i) for i in range(n)]
    version, _ = publish_index(s, x, products, {"model_id": "test-model"}, index_type="flat")
    return version, x


async def test_a_reload_leaves_the_index_a_search_already_holds_on_its_version(tmp_path: Path) -> None:
    """The Search reply names `index.version` of the object it searched: the holder swaps in a new
    object, so a search in flight during a reload cannot name the new version for old hits (the
    index-swap scenario saw that torn reply when the old object swapped its snapshot in place)."""
    s = Settings.load(environ={}, overrides={"catalog": {"index_root": tmp_path, "use_gpu": False}})
    first, x = _publish(s, 40, 0, "old")
    holder = IndexHolder(index_root=tmp_path, poll_s=0.01, catalog=s.catalog)
    await holder.start()
    try:
        held = holder.current()
        assert held is not None and held.version == first.name
        second, _ = _publish(s, 50, 1, "new")
        async with asyncio.timeout(60):
            while holder.current() is held:  # noqa: ASYNC110 - the holder polls on its own
                await asyncio.sleep(0.01)
        now = holder.current()
        assert now is not None and now.version == second.name and now.size == 50
        assert held.version == first.name and held.size == 40  # untouched by the reload
        hits, _ranking = await holder.query(held, ["a", "b", "c"], x[:3], 2, mode=SearchMode.SEMANTIC, filters={})
        assert all(h.id.startswith("old-") for row in hits for h in row)
        assert held.reloaded() is not None and now.reloaded() is None  # nothing newer than `now`
    finally:
        await holder.close()
