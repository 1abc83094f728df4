"""The main gRPC port served by the compiled front (sidecar.grpc_server=compiled, the default): Embed,
Search and Stream on the front, a sparse one-text query on its own thread; health from gRPC C++'s own
service, reflection answered in-process behind the key check; a stream's read-ahead bounded.

Real sidecars on free ports; the front is built from sidecar/native/front.cc (skipped, saying why, where
it cannot build).
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

from embedcar_settings import Settings
from inference.errors import Unavailable
from sidecar import grpc_server
from sidecar.app import SidecarThread
from sidecar.client import AsyncClient, Client
from sidecar.proto import embedcar_pb2 as pb
from sidecar.wire import SERVICE
from tests.fixtures_sidecar import ProbeBackend, sidecar_settings, until
from tests.test_sidecar_native_front import QUERIES, needs_front, passes

STREAM = f"/{SERVICE}/Stream"


def stream_request(rid: int, text: str) -> bytes:
    return pb.StreamRequest(id=rid, embed=pb.EmbedRequest(texts=[text])).SerializeToString()


@needs_front
def test_the_main_port_answers_on_the_fronts_thread_health_and_reflection_too(settings: Settings) -> None:
    """Sparse one-text Embeds and Stream messages each on the thread that took them; health and reflection
    served by the front itself."""
    with SidecarThread(sidecar_settings(settings, http_port=-1, cache_entries=0)) as sc, \
            grpc.insecure_channel(sc.grpc_target) as ch, Client(sc.grpc_target) as c:
        assert sc._main_front is not None  # the default: the compiled front took grpc_port
        before = passes(sc, "front")
        unary = []
        for text in QUERIES:
            time.sleep(0.2)  # sparse arrivals
            unary.append(c.embed([text]).embeddings[0])
        assert passes(sc, "front") - before == len(QUERIES)  # each on the thread that took it
        # Stream: every message answered, sparse ones on the front's thread, a burst's wherever it can
        stream = ch.stream_stream(STREAM)
        before = passes(sc, "front")

        def sparse() -> Iterator[bytes]:
            for i, t in enumerate(QUERIES):
                time.sleep(0.2)
                yield stream_request(i + 1, t)

        burst = [stream_request(i + 1, t) for i, t in enumerate(QUERIES)]
        for messages, on_front in ((sparse(), len(QUERIES)), (burst, 0)):
            replies = [pb.StreamReply.FromString(r) for r in stream(iter(messages), timeout=30)]
            assert sorted(r.id for r in replies) == list(range(1, len(QUERIES) + 1))
            for r in replies:
                got = np.frombuffer(r.embed.embeddings, dtype=np.float32)
                np.testing.assert_allclose(got, unary[r.id - 1], atol=1e-5)
            assert passes(sc, "front") - before >= on_front
            before = passes(sc, "front")
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        [listed] = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=5))
        names = {s.name for s in listed.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= names


@needs_front
def test_keys_and_deadlines_hold_on_the_stream_reflection_and_health_watch(settings: Settings,
                                                                      probe_backend: ProbeBackend) -> None:
    key = "front-key-1f2e3d4c5b"
    with SidecarThread(sidecar_settings(settings, http_port=-1, cache_entries=0, api_keys=f"shop={key}"),
                       backend=probe_backend) as sc, grpc.insecure_channel(sc.grpc_target) as ch:
        # Reflection needs the key (as on grpc.aio); health does not, and a watch ends at the caller's deadline.
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as denied:
            list(refl.ServerReflectionInfo(iter([ask]), timeout=5))
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        [listed] = list(refl.ServerReflectionInfo(iter([ask]), timeout=5, metadata=(("x-api-key", key),)))
        assert listed.list_services_response.service
        with pytest.raises(grpc.RpcError) as watched:
            list(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=1.0))
        assert watched.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stream = ch.stream_stream(STREAM)
        # A stream without the key is refused as it opens, before it sends anything (as grpc.aio does).
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
        # The caller's deadline ends a stream whose query is held, and the front serves on.
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


@needs_front
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


@needs_front
async def test_a_stream_stops_reading_while_its_replies_are_owed(settings: Settings, probe_backend: ProbeBackend,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With the backend held, the front takes only STREAM_MAX_OWED of a stream's messages into Python
    (the rest wait in gRPC's flow control, not in the sidecar's memory); once replies flow, it reads the
    rest and every message gets its reply."""
    texts = [f"oat milk {i}" for i in range(40)]
    monkeypatch.setattr(grpc_server, "STREAM_MAX_OWED", 4)
    s = sidecar_settings(settings, http_port=-1, cache_entries=0, max_in_flight=1000)
    with SidecarThread(s, backend=probe_backend) as sc:
        front = sc._main_front
        assert front is not None
        taken: list[bytes] = []
        on_message = front._on_message

        def counting(raw: bytes | None, key: str | None, timeout_s: float, stream: object) -> None:
            if raw is not None:
                taken.append(raw)
            on_message(raw, key, timeout_s, stream)

        front._on_message = counting  # type: ignore[method-assign]
        probe_backend.hold.clear()
        probe_backend.entered.clear()
        try:
            async with grpc.aio.insecure_channel(sc.grpc_target) as ch:
                call = ch.stream_stream(STREAM)()
                for i, t in enumerate(texts):
                    await call.write(stream_request(i + 1, t))
                await until(probe_backend.entered.is_set, "the first message reached the backend")
                await asyncio.sleep(0.5)  # time for the front to read more, were it to
                assert len(taken) == 4
                probe_backend.hold.set()
                await call.done_writing()
                replies = [pb.StreamReply.FromString(r) async for r in call]
        finally:
            probe_backend.hold.set()
    assert sorted(r.id for r in replies) == list(range(1, len(texts) + 1))
    assert all(r.WhichOneof("result") == "embed" for r in replies), replies[:3]
