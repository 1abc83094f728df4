"""Heavy overload: refusals in front of the handlers (sidecar.shedding, grpc_server.backlog_options).

Each surface is driven against a real sidecar whose default model's admission is put in the state a
standing overload leaves it in (shedding, a queue over the budget): the refusal must come before
the request is parsed, read or computed. The C core's cap is shown with the event loop itself stuck,
the one case no Python refusal can help.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from embedcar_client.client import Client, map_rpc_error
from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_client.wire import RETRY_AFTER_KEY
from embedcar_settings import Settings
from inference.errors import DeadlineExceeded, Overloaded, Shed
from sidecar.admission import Admission, Ticket
from sidecar.app import Sidecar, SidecarThread
from sidecar.metrics import Metrics
from sidecar.shedding import Gate
from tests.fixtures_sidecar import ProbeBackend, sidecar_settings


def _overloaded(a: Admission) -> Ticket:
    """Admission as a standing overload leaves it: shedding, queued work well over the budget."""
    a.budget_s = 0.010
    a.shedding = True
    a.standing_s = 1.0
    ticket = Ticket(0, 0)
    tokens = int(0.5 / a.s_per_token)  # ~0.5 s of queued inference
    a.outstanding_tokens += tokens
    ticket.tokens = tokens
    return ticket


def _recovered(a: Admission, ticket: Ticket) -> None:
    a.release(ticket)
    a.shedding = False
    a.standing_s = 0.0


@pytest.fixture(scope="module")
def shedding_sidecar(settings: Settings, model_dir: object) -> Iterator[Sidecar]:
    with SidecarThread(sidecar_settings(settings, admission_budget_ms=10.0)) as sc:
        yield sc


@pytest.fixture
def overloaded(shedding_sidecar: Sidecar) -> Iterator[Sidecar]:
    a = shedding_sidecar.admission
    ticket = _overloaded(a)
    try:
        yield shedding_sidecar
    finally:
        _recovered(a, ticket)


def _open_stream(ch: grpc.aio.Channel) -> Any:
    """A Stream call on `ch`, messages typed."""
    return ch.stream_stream("/embedcar.v1.Embedder/Stream", request_serializer=pb.StreamRequest.SerializeToString,
                            response_deserializer=pb.StreamReply.FromString)()


def _shed_count(sc: Sidecar) -> float:
    return float(sc.metrics.rejections.labels("shed")._value.get())


def test_gate_refuses_only_while_admission_sheds_over_its_budget() -> None:
    a = Admission(max_outstanding_items=96, s_per_token=1e-4, budget_s=0.010)
    gate = Gate(lambda: a, Metrics(), max_in_flight=3)
    assert gate.refusal() is None  # idle
    ticket = _overloaded(a)
    refused = gate.refusal()
    assert isinstance(refused, Overloaded) and refused.retry_after_s is not None and refused.retry_after_s > 0
    a.shedding = False  # a burst, not a standing queue: admission would still take it
    assert gate.refusal() is None
    _recovered(a, ticket)
    assert [gate.enter() for _ in range(3)] == [None, None, None]
    over = gate.enter()
    assert isinstance(over, Overloaded) and "cap 3" in over.message
    gate.leave()
    assert gate.enter() is None


def test_unary_call_is_refused_before_it_is_parsed(overloaded: Sidecar) -> None:
    before = _shed_count(overloaded)
    with grpc.insecure_channel(overloaded.grpc_target) as ch:
        call = ch.unary_unary("/embedcar.v1.Embedder/Embed")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff not a message", timeout=10)  # bytes that would be INVALID_ARGUMENT if parsed
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailer = dict(info.value.trailing_metadata() or ())
    assert float(trailer[RETRY_AFTER_KEY]) > 0
    assert _shed_count(overloaded) == before + 1


def test_unary_call_is_served_again_once_the_queue_drained(shedding_sidecar: Sidecar) -> None:
    a = shedding_sidecar.admission
    ticket = _overloaded(a)
    with Client(shedding_sidecar.grpc_target) as c:
        with pytest.raises(Overloaded):
            c.embed(["oat milk barista"], timeout_s=10)
        _recovered(a, ticket)
        assert c.embed(["oat milk barista"], timeout_s=10).embeddings.shape[0] == 1


def test_http_post_is_refused_with_retry_after_before_its_body_is_read(overloaded: Sidecar) -> None:
    url = f"http://127.0.0.1:{overloaded.http_port}"
    with httpx.Client(base_url=url, timeout=10) as http:
        r = http.post("/v1/embeddings", content=b"not json at all")  # 400 if it reached the route
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "resource_exhausted"
        assert http.post("/v1/search", json={"input": "x"}).status_code == 429
        assert http.get("/health").status_code == 200  # probes and scrapes are never shed
        assert http.get("/metrics").status_code == 200


def test_stream_message_is_refused_with_its_id(overloaded: Sidecar) -> None:
    async def go() -> list[pb.StreamReply]:
        async with grpc.aio.insecure_channel(overloaded.grpc_target) as ch:
            call = _open_stream(ch)
            for i in (7, 8):
                await call.write(pb.StreamRequest(id=i, embed=pb.EmbedRequest(texts=[f"q {i}"])))
            await call.done_writing()
            return [r async for r in call]

    replies = asyncio.run(go())
    assert sorted(r.id for r in replies) == [7, 8]
    for r in replies:
        assert r.WhichOneof("result") == "error"
        assert r.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and r.error.retry_after_s > 0


def test_stream_messages_past_the_in_flight_cap_are_refused(settings: Settings, probe_backend: ProbeBackend) -> None:
    """One message in progress allowed, the backend held: the second is refused at once, the first served."""
    with SidecarThread(sidecar_settings(settings, max_in_flight=1), backend=probe_backend) as sc:
        probe_backend.hold.clear()  # after start: warming up calls the backend too

        async def go() -> list[pb.StreamReply]:
            async with grpc.aio.insecure_channel(sc.grpc_target) as ch:
                call = _open_stream(ch)
                await call.write(pb.StreamRequest(id=1, embed=pb.EmbedRequest(texts=["held query one"])))
                await call.write(pb.StreamRequest(id=2, embed=pb.EmbedRequest(texts=["held query two"])))
                first = await call.read()  # while the backend is held only a refusal can come back
                probe_backend.hold.set()
                await call.done_writing()
                rest = []
                while (r := await call.read()) is not grpc.aio.EOF:
                    rest.append(r)
                return [first, *rest]

        first, *rest = asyncio.run(go())
    assert first.id == 2 and first.WhichOneof("result") == "error"
    assert first.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert [r.id for r in rest] == [1] and rest[0].WhichOneof("result") == "embed"


def test_calls_past_the_backlog_are_refused_while_the_event_loop_is_stuck(settings: Settings,
                                                                          model_dir: object) -> None:
    """The loop blocked (a long pause, a CPU-starved process): calls past the backlog are refused while no
    Python can run on it, by gRPC's C core (the client reads Shed); those within it are served after."""
    n, backlog, refusal = 40, 2, Shed
    runner = SidecarThread(sidecar_settings(settings, transport_backlog=backlog))
    with runner as sc, grpc.insecure_channel(sc.grpc_target) as ch:
        embed = ch.unary_unary("/embedcar.v1.Embedder/Embed")
        embed(pb.EmbedRequest(texts=["warm"]).SerializeToString(), timeout=20)  # connected and warm
        loop_free, stuck = threading.Event(), threading.Event()

        def hold_loop() -> None:
            stuck.set()
            loop_free.wait(30)  # the sidecar's event loop runs nothing else meanwhile

        runner.loop.call_soon_threadsafe(hold_loop)
        assert stuck.wait(10)
        lock = threading.Lock()
        finished: list[int] = []
        most_refused = threading.Event()

        def done(_f: object) -> None:
            with lock:
                finished.append(1)
                if len(finished) >= n - 2 * backlog - 1:
                    most_refused.set()

        calls = [embed.future(pb.EmbedRequest(texts=[f"stuck loop query {i}"]).SerializeToString(), timeout=20)
                 for i in range(n)]
        for f in calls:
            f.add_done_callback(done)
        refused_while_stuck = most_refused.wait(15)
        answered_while_stuck = len(finished)
        loop_free.set()
        outcomes: list[object] = []
        for f in calls:
            try:
                outcomes.append(f.result(30))
            except grpc.RpcError as exc:
                outcomes.append(map_rpc_error(exc))
    assert refused_while_stuck, f"only {answered_while_stuck} of {n} calls were answered while the loop was held"
    shed = [o for o in outcomes if isinstance(o, refusal)]
    served = [o for o in outcomes if isinstance(o, bytes)]
    assert len(shed) >= n - 2 * backlog - 1 and served, outcomes[:3]
    assert len(shed) + len(served) == n, [o for o in outcomes if not isinstance(o, (refusal, bytes))][:3]


def test_a_cancelled_status_reads_as_shed() -> None:
    class Err(grpc.RpcError):  # type: ignore[misc]  # untyped in the stubs
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.CANCELLED

        def details(self) -> str:
            return "CANCELLED"

        def trailing_metadata(self) -> tuple[()]:
            return ()

    err = map_rpc_error(Err())
    assert isinstance(err, Shed) and isinstance(err, Overloaded) and not isinstance(err, DeadlineExceeded)
    assert "refused in the transport" in err.message


def test_a_stream_that_leaves_gives_its_in_flight_places_back(settings: Settings, probe_backend: ProbeBackend) -> None:
    """Messages in progress when the client leaves are cancelled, started or not: none stays counted."""
    with SidecarThread(sidecar_settings(settings), backend=probe_backend) as sc:
        probe_backend.hold.clear()

        async def go() -> None:
            async with grpc.aio.insecure_channel(sc.grpc_target) as ch:
                call = _open_stream(ch)
                for i in range(5):
                    await call.write(pb.StreamRequest(id=i, embed=pb.EmbedRequest(texts=[f"left behind {i}"])))
                for _ in range(200):  # until the sidecar counts them in progress
                    if sc.gate.in_flight == 5:
                        break
                    await asyncio.sleep(0.01)
                assert sc.gate.in_flight == 5
                call.cancel()

        asyncio.run(go())
        probe_backend.hold.set()
        deadline = threading.Event()
        for _ in range(200):
            if sc.gate.in_flight == 0:
                break
            deadline.wait(0.05)
        assert sc.gate.in_flight == 0
