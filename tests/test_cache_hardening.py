"""The cache's hardening: keys are fixed-size digests, the cache is capped in bytes,
and where the API keys name several tenants a reply's cache flag (and latency) says nothing about
another tenant's queries: each tenant's hits and single-flight joins stay within its own partition."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import numpy as np
import pytest

from embedcar_client.client import AsyncClient, Client
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from sidecar.app import Sidecar, SidecarThread
from sidecar.auth import KeyRing
from sidecar.cache import ENTRY_OVERHEAD, KEY_BYTES, EmbeddingCache, Entry
from sidecar.metrics import Metrics
from sidecar.models import ModelSet
from sidecar.ratelimit import RateLimiter
from sidecar.service import EmbedService
from sidecar.settings import SidecarSettings
from tests.fixtures_sidecar import ProbeBackend, sidecar_settings, until

KEY_A = "tenant-a-key-0123456789abcdef"
KEY_B = "tenant-b-key-0123456789abcdef"
WARM = "greek yogurt"
ENTRY = 384 * 4 + KEY_BYTES + ENTRY_OVERHEAD  # what one entry of a 384-dimension model counts


def _entry(i: int) -> Entry:
    return Entry(np.full(384, i, dtype=np.float32), False, i)


def test_keys_are_fixed_size_digests_of_version_partition_and_text() -> None:
    c = EmbeddingCache("v1", 10, 60.0)
    text = "ﷺ" * 18 * 10_000  # what one 10,000-character text of U+FDFA normalised to: a 360 KB key before
    keys = {c.key(text), c.key("milk"), c.key("milk", "shop-a"), c.key("milk", "shop-b"),
            EmbeddingCache("v2", 10, 60.0).key("milk"), c.key("milk ")}
    assert len(keys) == 6 and {len(k) for k in keys} == {KEY_BYTES}
    assert c.key("milk", "shop-a") == c.key("milk", "shop-a")
    # a partition's name cannot pass for part of the text, nor the version's for the partition's
    assert EmbeddingCache("v", 10, 60.0).key("b", "a") != EmbeddingCache("v", 10, 60.0).key("a\0b")


def test_the_byte_cap_evicts_the_least_recently_used() -> None:
    c = EmbeddingCache("v", 1_000, 60.0, max_bytes=3 * ENTRY + ENTRY // 2)
    for i in range(3):
        c.put(c.key(f"q{i}"), _entry(i))
    assert len(c) == 3 and c.nbytes == 3 * ENTRY
    assert c.get(c.key("q0")) is not None  # q0 used: q1 is the oldest
    c.put(c.key("q3"), _entry(3))
    assert len(c) == 3 and c.nbytes <= 3 * ENTRY + ENTRY // 2
    assert c.get(c.key("q1")) is None and all(c.get(c.key(q)) is not None for q in ("q0", "q2", "q3"))
    assert not EmbeddingCache("v", 1_000, 60.0, max_bytes=0).enabled


def test_an_entry_holds_its_own_row_not_its_whole_batch() -> None:
    c = EmbeddingCache("v", 10, 60.0)
    batch = np.ones((32, 384), dtype=np.float32)
    c.put(c.key("milk"), Entry(batch[3], False, 4))
    got = c.get(c.key("milk"))
    assert got is not None and got.vector.base is None and got.vector.nbytes == 384 * 4
    batch[3] = 0.0
    assert got.vector[0] == 1.0 and not got.vector.flags.writeable


def _service(api_keys: str) -> EmbedService:
    keys = KeyRing.from_settings(SidecarSettings(api_keys=api_keys))
    return EmbedService(cast(ModelSet, None), keys=keys, limiter=RateLimiter(1.0, 1), metrics=Metrics(),
                        default_deadline_s=1.0, max_k=10)


def test_only_several_tenants_partition_the_cache() -> None:
    assert _service("").partition("anonymous") is None
    assert _service(f"shop={KEY_A}").partition("shop") is None
    several = _service(f"shop-a={KEY_A},shop-b={KEY_B}")
    assert several.partition("shop-a") == "shop-a" and several.partition(None) is None


@pytest.fixture(scope="module")
def two_tenants(settings: Settings, probe_backend_module: ProbeBackend, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Sidecar, ProbeBackend]]:
    warm = tmp_path_factory.mktemp("warm") / "queries.txt"
    warm.write_text(f"{WARM}\n")
    s = sidecar_settings(settings, api_keys=f"shop-a={KEY_A},shop-b={KEY_B}", warm_queries_file=Path(warm))
    with SidecarThread(s, backend=probe_backend_module) as sc:
        yield sc, probe_backend_module


@pytest.fixture(scope="module")
def probe_backend_module(onnx_backend: OnnxBackend) -> ProbeBackend:
    return ProbeBackend(onnx_backend)


def test_a_tenant_never_sees_another_tenants_hits(two_tenants: tuple[Sidecar, ProbeBackend]) -> None:
    sc, _probe = two_tenants
    assert sc.service.per_tenant_cache
    with Client(sc.grpc_target, api_key=KEY_A) as a, Client(sc.grpc_target, api_key=KEY_B) as b:
        first = a.embed(["oat milk barista"])
        assert first.cache_hits == [False] and a.embed(["oat milk barista"]).cache_hits == [True]
        other = b.embed(["oat milk barista"])  # A asked it a moment ago: still a miss for B
        assert other.cache_hits == [False] and b.embed(["oat milk barista"]).cache_hits == [True]
        assert np.array_equal(first.embeddings, other.embeddings)
        # A batch and the HTTP front alike
        assert b.embed(["rye bread", "oat milk barista"]).cache_hits == [False, True]
        assert a.embed(["rye bread", "oat milk barista"]).cache_hits == [False, True]
        r = httpx.post(f"http://127.0.0.1:{sc.http_port}/v1/embeddings", json={"input": ["blood orange"]},
                       headers={"x-api-key": KEY_A}, timeout=60)
        assert r.status_code == 200, r.text
        assert b.embed(["blood orange"]).cache_hits == [False]
        assert a.embed(["blood orange"]).cache_hits == [True]  # A's own, whichever front asked
        # The operator's warm queries are everyone's
        assert a.embed([WARM]).cache_hits == [True] and b.embed([WARM]).cache_hits == [True]


async def test_single_flight_joins_only_within_a_tenant(two_tenants: tuple[Sidecar, ProbeBackend]) -> None:
    """B asking what A's held call computes must not wait on it (its latency would tell B): it is
    computed for B on its own, while A's second ask joins A's call."""
    sc, probe = two_tenants
    joins = sc.models.default.metrics.singleflight_joins._value
    async with AsyncClient(sc.grpc_target, api_key=KEY_A) as a, AsyncClient(sc.grpc_target, api_key=KEY_B) as b:
        probe.hold.clear()
        probe.entered.clear()
        rows = probe.rows
        try:
            leader = asyncio.create_task(a.embed(["lemon curd"]))
            await until(probe.entered.is_set, "A's call reached the backend")
            before = joins.get()
            joiner = asyncio.create_task(a.embed(["lemon curd"]))
            await until(lambda: joins.get() > before, "A's second ask joined A's call")
            other = asyncio.create_task(b.embed(["lemon curd"]))
            await asyncio.sleep(0.2)
            assert joins.get() == before + 1 and not other.done()
        finally:
            probe.hold.set()
        results = await asyncio.wait_for(asyncio.gather(leader, joiner, other), 60)
    assert probe.rows - rows == 2  # A's once, B's once
    assert [r.cache_hits for r in results] == [[False]] * 3
