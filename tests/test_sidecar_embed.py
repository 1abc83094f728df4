"""Embed through a real sidecar (gRPC + HTTP on free ports, embedded ORT backend)."""

from __future__ import annotations

import asyncio
import base64
import time

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from embedcar_client.client import AsyncClient, Client, EmbedResult
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.embedder import Embedder
from inference.errors import DeadlineExceeded, Internal, Unavailable
from inference.tokenizer import QueryTokenizer
from sidecar.app import Sidecar, SidecarThread
from sidecar.http_api import EMBEDDINGS_REPLY
from tests.fixtures_sidecar import ProbeBackend, sidecar_settings, until

WORDS = ["organic", "oat", "milk", "whole", "grain", "bread", "free", "range", "eggs", "greek", "yogurt", "baby",
         "spinach", "cheddar", "cheese", "sourdough", "loaf", "almond", "butter", "green", "tea", "dark",
         "chocolate", "frozen", "peas", "basmati", "rice", "olive", "oil"]


def texts_for_every_bucket(tokenizer: QueryTokenizer) -> list[str]:
    """Queries whose token counts fall in every bucket, plus one past max_length (truncated)."""
    out = []
    for n_words in (1, 2, 3, 5, 8, 12, 20, 28, 40, 55, 90, 120, 200, 400):
        out.append(" ".join(WORDS[(i * 7 + n_words) % len(WORDS)] for i in range(n_words)))
    buckets = {tokenizer.batch(tokenizer.encode([t]).ids).shape[1] for t in out}
    assert buckets == set(tokenizer.buckets), buckets
    return out


def reference(onnx_backend: OnnxBackend, tokenizer: QueryTokenizer, texts: list[str]) -> np.ndarray:
    return asyncio.run(Embedder(tokenizer, onnx_backend).embed(texts)).embeddings


def test_embed_equals_embedded_backend_across_buckets(sidecar_client: Client, onnx_backend: OnnxBackend,
                                                      tokenizer: QueryTokenizer) -> None:
    texts = texts_for_every_bucket(tokenizer)
    ref = reference(onnx_backend, tokenizer, texts)
    batch = sidecar_client.embed(texts)
    assert batch.embeddings.shape == (len(texts), 384) and batch.embeddings.dtype == np.float32
    assert batch.truncated[-1] and not any(batch.truncated[:-2])
    assert batch.model == onnx_backend.version_id
    one_by_one = np.stack([sidecar_client.embed([t]).embeddings[0] for t in texts])
    for got in (batch.embeddings, one_by_one):
        cos = np.sum(got * ref, axis=1)
        assert cos.min() >= 0.9999, cos


def test_cached_answer_equals_uncached(sidecar_client: Client) -> None:
    text = "cold brew coffee concentrate 1l unsweetened"
    first = sidecar_client.embed([text])
    second = sidecar_client.embed([text])
    variant = sidecar_client.embed(["  Cold brew COFFEE   concentrate 1l unsweetened "])  # same normalised form
    assert first.cache_hits == [False] and second.cache_hits == [True] and variant.cache_hits == [True]
    assert np.array_equal(first.embeddings, second.embeddings)
    assert np.array_equal(first.embeddings, variant.embeddings)
    assert second.timings_ns["inference"] == 0 and second.timings_ns["tokenize"] == 0
    assert first.timings_ns["inference"] > 0
    assert set(first.timings_ns) == {"auth", "cache", "tokenize", "queue", "inference", "search", "lexical", "total"}


def test_duplicates_in_one_request_and_float16(sidecar_client: Client) -> None:
    r = sidecar_client.embed(["ripe avocado", "ripe avocado", "lime"])
    assert np.array_equal(r.embeddings[0], r.embeddings[1])
    h = sidecar_client.embed(["ripe avocado", "lime"], float16=True)
    assert h.embeddings.dtype == np.float32
    assert np.abs(h.embeddings - r.embeddings[1:]).max() < 1e-3


async def _lead(sc: Sidecar, probe: ProbeBackend, c: AsyncClient, text: str, joiners: int, *,
                timeout_s: float | None = None) -> tuple[asyncio.Task[EmbedResult], list[asyncio.Task[EmbedResult]]]:
    """A leader whose computation the probe holds, then `joiners` callers of the same text joined to it."""
    joins = sc.models.default.metrics.singleflight_joins._value
    probe.hold.clear()
    probe.entered.clear()  # start-up's calibration set it
    leader = asyncio.create_task(c.embed([text], timeout_s=timeout_s))
    await until(probe.entered.is_set, "the leader's call reached the backend")
    before = joins.get()
    followers = [asyncio.create_task(c.embed([text])) for _ in range(joiners)]
    await until(lambda: joins.get() - before >= joiners, f"{joiners} callers joined the leader")
    assert joins.get() - before == joiners
    assert not any(t.done() for t in [leader, *followers])  # all wait on the one held call
    return leader, followers


async def test_async_client_and_single_flight(settings: Settings, probe_backend: ProbeBackend) -> None:
    """Concurrent misses for one text share one inference; each caller gets the same answer."""
    with SidecarThread(sidecar_settings(settings, http_port=-1), backend=probe_backend) as sc:
        before = probe_backend.rows
        async with AsyncClient(sc.grpc_target) as c:
            leader, followers = await _lead(sc, probe_backend, c, "lemon sorbet", 7)
            probe_backend.hold.set()
            results = await asyncio.wait_for(asyncio.gather(leader, *followers), 60)
        assert probe_backend.rows - before == 1
        assert results[0].cache_hits == [False]
        assert all(np.array_equal(r.embeddings, results[0].embeddings) for r in results)


async def test_single_flight_joiners_get_the_leaders_error_and_nothing_is_cached(
        settings: Settings, probe_backend: ProbeBackend) -> None:
    with SidecarThread(sidecar_settings(settings, http_port=-1), backend=probe_backend) as sc:
        async with AsyncClient(sc.grpc_target) as c:
            leader, followers = await _lead(sc, probe_backend, c, "melon sorbet", 3)
            probe_backend.fail = Internal("the probe backend failed this call")
            probe_backend.hold.set()
            got = await asyncio.wait_for(asyncio.gather(leader, *followers, return_exceptions=True), 60)
            assert all(isinstance(g, Internal) and "the probe backend failed" in g.message for g in got), got
            probe_backend.fail = None
            calls = probe_backend.calls
            again = await c.embed(["melon sorbet"])
            assert again.cache_hits == [False] and probe_backend.calls == calls + 1  # the failure was not cached


async def test_a_cancelled_leader_gives_its_joiners_unavailable_at_once(settings: Settings,
                                                                      probe_backend: ProbeBackend) -> None:
    """The leader's caller goes away: the joiners must not wait for a computation nobody settles."""
    with SidecarThread(sidecar_settings(settings, http_port=-1), backend=probe_backend) as sc:
        async with AsyncClient(sc.grpc_target) as c:
            leader, followers = await _lead(sc, probe_backend, c, "peach sorbet", 3)
            leader.cancel()
            try:  # answered while the backend still holds the computation
                got = await asyncio.wait_for(asyncio.gather(*followers, return_exceptions=True), 60)
            finally:
                probe_backend.hold.set()
            assert all(isinstance(g, Unavailable) and "cancelled" in g.message for g in got), got
            assert (await c.embed(["peach sorbet"])).embeddings.shape == (1, 384)  # a retry succeeds


async def test_a_joiner_whose_deadline_passes_first_leaves_the_leader_computing(
        settings: Settings, probe_backend: ProbeBackend) -> None:
    t = SidecarThread(sidecar_settings(settings, http_port=-1), backend=probe_backend)
    with t as sc:
        async with AsyncClient(sc.grpc_target) as c:
            leader, _ = await _lead(sc, probe_backend, c, "plum sorbet", 0, timeout_s=60)
            joins = sc.models.default.metrics.singleflight_joins._value
            before = joins.get()
            rows = probe_backend.rows
            # Through the service on the sidecar's own loop, so the error is the sidecar's join
            # deadline and not a client's timer racing it.
            with pytest.raises(DeadlineExceeded, match="waiting for a shared inference"):
                call = sc.service.call(None, deadline=time.monotonic() + 0.5)
                await asyncio.to_thread(t.call, sc.service.embed(call, ["plum sorbet"]))
            assert joins.get() == before + 1 and not leader.done()
            probe_backend.hold.set()
            r = await asyncio.wait_for(leader, 60)
            assert r.cache_hits == [False] and probe_backend.rows == rows  # computed once, by the leader
            assert (await c.embed(["plum sorbet"])).cache_hits == [True]


def test_http_embeddings_match_grpc(sidecar_embedded: Sidecar, sidecar_client: Client) -> None:
    url = f"http://127.0.0.1:{sidecar_embedded.http_port}"
    texts = ["penne pasta", "tomato passata 500g"]
    grpc_emb = sidecar_client.embed(texts).embeddings
    r = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "model": sidecar_embedded.model.name})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == set(EMBEDDINGS_REPLY)  # docs/http.md is written from that table
    assert body["object"] == "list" and body["model"] == sidecar_embedded.service.model
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert np.allclose(np.array([d["embedding"] for d in body["data"]], dtype=np.float32), grpc_emb, atol=1e-6)
    assert body["usage"]["prompt_tokens"] > 0
    # Who computed the misses: the header names the backend; an answer all from the cache has none.
    assert "x-embedcar-backend" not in r.headers  # both texts were cached by the gRPC call above
    fresh = httpx.post(f"{url}/v1/embeddings", json={"input": ["penne pasta", "fusilli 1kg"]})
    assert fresh.status_code == 200 and fresh.headers["x-embedcar-backend"] == "embedded"
    b64 = httpx.post(f"{url}/v1/embeddings", json={"input": "penne pasta", "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(vec, grpc_emb[0])


def test_health_metrics_reflection(sidecar_embedded: Sidecar, sidecar_client: Client) -> None:
    sidecar_client.embed(["sparkling water"])
    sidecar_client.embed(["sparkling water"])
    url = f"http://127.0.0.1:{sidecar_embedded.http_port}"
    assert httpx.get(f"{url}/health").json()["status"] == "SERVING"
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("embedcar_stage_seconds_bucket", "embedcar_cache_hits_total", "embedcar_batch_size_bucket",
                 "embedcar_singleflight_joins_total"):
        assert name in metrics
    with grpc.insecure_channel(sidecar_embedded.grpc_target) as ch:
        for service in ("", "embedcar.v1.Embedder"):
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5))
        names = {s.name for s in replies[0].list_services_response.service}
        assert "embedcar.v1.Embedder" in names and "grpc.health.v1.Health" in names


@pytest.mark.parametrize("n", [1, 64])
def test_timings_are_consistent(sidecar_client: Client, n: int) -> None:
    r = sidecar_client.embed([f"timing probe {n} item {i}" for i in range(n)])
    t = r.timings_ns
    assert t["total"] >= t["inference"] > 0
    assert t["total"] >= t["auth"] + t["cache"] + t["tokenize"]


def test_two_forward_lanes_answer_concurrent_callers_with_the_same_vectors(
        settings: Settings, onnx_backend: OnnxBackend, tokenizer: QueryTokenizer) -> None:
    """model.forward_lanes = 2: two passes at once, one ORT thread each, admission priced for both."""
    texts = texts_for_every_bucket(tokenizer)
    ref = reference(onnx_backend, tokenizer, texts)
    s = sidecar_settings(settings.with_section("model", forward_lanes=2, intra_op_threads=2), http_port=-1)
    with SidecarThread(s) as sc:
        assert (sc.backend.lanes, sc.admission.lanes) == (2, 2)

        async def all_at_once() -> np.ndarray:
            async with AsyncClient(sc.grpc_target) as c:
                replies = await asyncio.gather(*(c.embed([t]) for t in texts))
            return np.stack([r.embeddings[0] for r in replies])

        got = asyncio.run(all_at_once())
    assert float(np.sum(got * ref, axis=1).min()) >= 0.9999
