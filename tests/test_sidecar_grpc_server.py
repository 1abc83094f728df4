"""The main gRPC port (grpc.aio on grpcio's C core): Embed, Search and Stream with the same answers, health,
server reflection v1 and v1alpha behind the key check, a stream's read-ahead bounded.

Real sidecars on free ports.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from embedcar_client.client import AsyncClient, Client
from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_client.wire import SERVICE
from embedcar_settings import Settings
from inference.errors import Unavailable
from sidecar import calls, grpc_server
from sidecar.app import SidecarThread
from tests.fixtures_sidecar import ProbeBackend, sidecar_settings, until

STREAM = f"/{SERVICE}/Stream"
QUERIES = ("greek yogurt", "oat milk", "rye bread", "dairy free ice cream")
REFLECTION = {"v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
              "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"}


def stream_request(rid: int, text: str) -> bytes:
    return pb.StreamRequest(id=rid, embed=pb.EmbedRequest(texts=[text])).SerializeToString()


def list_services(ch: grpc.Channel, version: str, **kw: object) -> set[str]:
    """Reflection's list of services, asked on `version`'s path (v1's messages are v1alpha's on the wire)."""
    call = ch.stream_stream(REFLECTION[version],
                            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    [listed] = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5, **kw))
    return {s.name for s in listed.list_services_response.service}


def test_the_main_port_answers_embed_stream_health_and_reflection(settings: Settings) -> None:
    """Unary Embeds and Stream messages give the same vectors; health SERVING; reflection answers on v1 (what
    current grpcurl asks first) and v1alpha, listing the Embedder, health and both reflection services."""
    with SidecarThread(sidecar_settings(settings, http_port=-1, cache_entries=0)) as sc, \
            grpc.insecure_channel(sc.grpc_target) as ch, Client(sc.grpc_target) as c:
        unary = [c.embed([text]).embeddings[0] for text in QUERIES]
        stream = ch.stream_stream(STREAM)
        burst = [stream_request(i + 1, t) for i, t in enumerate(QUERIES)]
        replies = [pb.StreamReply.FromString(r) for r in stream(iter(burst), timeout=30)]
        assert sorted(r.id for r in replies) == list(range(1, len(QUERIES) + 1))
        for r in replies:
            got = np.frombuffer(r.embed.embeddings, dtype=np.float32)
            np.testing.assert_allclose(got, unary[r.id - 1], atol=1e-5)
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        for version in REFLECTION:
            names = list_services(ch, version)
            assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                    "grpc.reflection.v1alpha.ServerReflection"} <= names, version
        described = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]), timeout=5)
        assert next(iter(described)).file_descriptor_response.file_descriptor_proto


def test_keys_and_deadlines_hold_on_the_stream_reflection_and_health_watch(settings: Settings,
                                                                      probe_backend: ProbeBackend) -> None:
    key = "grpc-key-1f2e3d4c5b"
    with SidecarThread(sidecar_settings(settings, http_port=-1, cache_entries=0, api_keys=f"shop={key}"),
                       backend=probe_backend) as sc, grpc.insecure_channel(sc.grpc_target) as ch:
        # Reflection needs the key, on both versions; health does not, and a watch ends at the caller's deadline.
        for version in REFLECTION:
            with pytest.raises(grpc.RpcError) as denied:
                list_services(ch, version)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert SERVICE in list_services(ch, version, metadata=(("x-api-key", key),))
        with pytest.raises(grpc.RpcError) as watched:
            list(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=1.0))
        assert watched.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stream = ch.stream_stream(STREAM)
        # A stream without the key is refused as it opens, before it sends anything.
        hold = threading.Event()

        def silent() -> Iterator[bytes]:
            hold.wait(10)
            yield from ()

        opened = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as at_open:
                list(stream(silent(), timeout=10))
        finally:
            hold.set()
        assert at_open.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert time.monotonic() - opened < 5  # not at its deadline
        assert list(stream(iter([]), timeout=10, metadata=(("x-api-key", key),))) == []
        with pytest.raises(grpc.RpcError) as no_key:
            list(stream(iter([stream_request(1, "oat milk")]), timeout=10))
        assert no_key.value.code() == grpc.StatusCode.UNAUTHENTICATED
        [ok] = list(stream(iter([stream_request(2, "oat milk")]), timeout=10, metadata=(("x-api-key", key),)))
        assert pb.StreamReply.FromString(ok).id == 2
        # The caller's deadline ends a stream whose query is held, and the server serves on.
        probe_backend.hold.clear()
        try:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as late:
                list(stream(iter([stream_request(3, "rye bread")]), timeout=1.0, metadata=(("x-api-key", key),)))
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < 5
        finally:
            probe_backend.hold.set()
        # Another text: "rye bread" may still be the left stream's computation, cancelled as this one
        # joins it (a joiner of a cancelled leader hears UNAVAILABLE: test_sidecar_embed).
        [again] = list(stream(iter([stream_request(4, "wholemeal bread")]), timeout=10,
                              metadata=(("x-api-key", key),)))
        assert pb.StreamReply.FromString(again).embed.rows == 1


async def test_a_caller_leaving_a_stream_cancels_its_work(settings: Settings,
                                                                   probe_backend: ProbeBackend) -> None:
    """The stream's held query leads two unary callers of the same text; the stream's caller leaves: the
    stream's task on the loop is cancelled, and the joiners hear at once that their leader was cancelled."""
    text = "blood orange sorbet"
    with SidecarThread(sidecar_settings(settings, http_port=-1, cache_entries=0), backend=probe_backend) as sc:
        joins = sc.models.default.metrics.singleflight_joins._value
        probe_backend.hold.clear()
        probe_backend.entered.clear()
        try:
            async with grpc.aio.insecure_channel(sc.grpc_target) as ch, AsyncClient(sc.grpc_target) as c:
                call = ch.stream_stream(STREAM)()
                await call.write(stream_request(1, text))
                await until(probe_backend.entered.is_set, "the stream's query reached the backend")
                before = joins.get()
                followers = [asyncio.create_task(c.embed([text])) for _ in range(2)]
                await until(lambda: joins.get() - before >= 2, "two callers joined the stream's query")
                call.cancel()
                got = await asyncio.wait_for(asyncio.gather(*followers, return_exceptions=True), 20)
        finally:
            probe_backend.hold.set()
    assert all(isinstance(g, Unavailable) and "cancelled" in g.message for g in got), got


async def test_a_stream_stops_reading_while_its_replies_are_owed(settings: Settings, probe_backend: ProbeBackend,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With the backend held, the server takes only STREAM_MAX_OWED of a stream's messages into Python
    (the rest wait in gRPC's flow control, not in the sidecar's memory); once replies flow, it reads the
    rest and every message gets its reply."""
    texts = [f"oat milk {i}" for i in range(40)]
    monkeypatch.setattr(grpc_server, "STREAM_MAX_OWED", 4)
    s = sidecar_settings(settings, http_port=-1, cache_entries=0, max_in_flight=1000)
    taken: list[bytes] = []
    enter = calls.StreamSession.enter

    def counting(session: calls.StreamSession, raw: bytes) -> bytes | None:
        taken.append(raw)
        return enter(session, raw)

    monkeypatch.setattr(calls.StreamSession, "enter", counting)
    with SidecarThread(s, backend=probe_backend) as sc:
        probe_backend.hold.clear()
        probe_backend.entered.clear()
        try:
            async with grpc.aio.insecure_channel(sc.grpc_target) as ch:
                call = ch.stream_stream(STREAM)()
                for i, t in enumerate(texts):
                    await call.write(stream_request(i + 1, t))
                await until(probe_backend.entered.is_set, "the first message reached the backend")
                await asyncio.sleep(0.5)  # time for the server to read more, were it to
                assert len(taken) == 4
                probe_backend.hold.set()
                await call.done_writing()
                replies = [pb.StreamReply.FromString(r) async for r in call]
        finally:
            probe_backend.hold.set()
    assert sorted(r.id for r in replies) == list(range(1, len(texts) + 1))
    assert all(r.WhichOneof("result") == "embed" for r in replies), replies[:3]
