"""The Stream RPC through a real sidecar: Embed and Search as messages on one open call.

Each request's reply must equal the unary call's, requests in flight together must each get their
own answer, a failed request must get its error (the unary call's status) while the stream goes on,
and a stream that fails must reopen on the next call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from embedcar_client.client import AsyncClient, Client
from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_client.wire import SERVICE
from embedcar_settings import Settings
from inference.errors import DeadlineExceeded, InvalidInput, Unavailable
from sidecar.app import Sidecar, SidecarThread
from tests.fixtures_sidecar import ProbeBackend, sidecar_settings

QUERIES = ["oat milk", "greek yogurt plain", "gluten free bread", "dark chocolate 70%", "baby spinach",
           "organic bananas", "sparkling water lime", "frozen peas"]


@pytest.fixture(scope="module")
def search_car(settings: Settings, grocery_index_root: Path) -> Iterator[Sidecar]:
    s = sidecar_settings(settings, http_port=-1, index_dir=grocery_index_root).with_section("catalog", use_gpu=False)
    with SidecarThread(s) as car:
        yield car


async def test_stream_answers_equal_unary_calls_concurrently(search_car: Sidecar) -> None:
    with Client(search_car.grpc_target) as unary:
        want = [unary.embed([q]).embeddings for q in QUERIES]
        want16 = unary.embed(QUERIES[:2], float16=True).embeddings
        want_hits = [[h.id for h in unary.search([q], k=5).hits[0]] for q in QUERIES]
    async with AsyncClient(search_car.grpc_target, stream=True) as c:
        # all in flight on one stream at once: each reply reaches its own caller
        embeds = [asyncio.create_task(c.embed([q])) for q in QUERIES]
        searches = [asyncio.create_task(c.search([q], k=5)) for q in QUERIES]
        got, got_hits = await asyncio.gather(*embeds), await asyncio.gather(*searches)
        got16 = await c.embed(QUERIES[:2], float16=True)
        session = c._session
        assert session is not None and session._open is not None  # still the one stream
    for w, g in zip(want, got, strict=True):
        assert g.embeddings.shape == (1, 384)
        assert float(np.sum(w * g.embeddings)) >= 0.9999
    assert [[h.id for h in g.hits[0]] for g in got_hits] == want_hits
    np.testing.assert_allclose(got16.embeddings, want16, atol=1e-3)
    assert got16.model == got[0].model and got[0].model


async def test_a_failed_request_gets_its_error_and_the_stream_goes_on(search_car: Sidecar) -> None:
    async with AsyncClient(search_car.grpc_target, stream=True) as c:
        await c.embed(["milk"])
        session = c._session
        assert session is not None
        stream = session._open
        with pytest.raises(InvalidInput, match="empty"):
            await c.embed([""])
        with pytest.raises(InvalidInput, match="k must be"):
            await c.search(["milk"], k=100_000)
        assert (await c.embed(["eggs"])).embeddings.shape == (1, 384)
        assert session._open is stream  # the errors did not end it
    counts = {(s.labels["rpc"], s.labels["code"]): s.value for m in search_car.metrics.requests.collect()
              for s in m.samples if s.name.endswith("_total")}
    assert counts[("embed", "invalid_argument")] >= 1 and counts[("search", "invalid_argument")] >= 1


def test_malformed_stream_messages_are_refused_one_by_one(search_car: Sidecar) -> None:
    frames = [b"\xff\xff\xff",  # not a message: no id to echo
              pb.StreamRequest(id=7).SerializeToString(),  # neither embed nor search
              pb.StreamRequest(id=8, embed=pb.EmbedRequest(texts=["milk"])).SerializeToString() + b"\x98\x06\x01",
              pb.StreamRequest(id=9, embed=pb.EmbedRequest(texts=["milk"])).SerializeToString()]
    with grpc.insecure_channel(search_car.grpc_target) as ch:
        call = ch.stream_stream(f"/{SERVICE}/Stream")
        replies = [pb.StreamReply.FromString(r) for r in call(iter(frames), timeout=60)]
    by_id = {r.id: r for r in replies}
    assert set(by_id) == {0, 7, 8, 9}
    for rid in (0, 7, 8):
        assert by_id[rid].WhichOneof("result") == "error"
        assert by_id[rid].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], by_id[rid]
    assert "neither" in by_id[7].error.message and "unknown" in by_id[8].error.message
    assert by_id[9].embed.rows == 1 and by_id[9].embed.dim == 384


async def test_per_request_deadline_and_reopening_after_the_sidecar_restarts(
        settings: Settings, probe_backend: ProbeBackend) -> None:
    first = SidecarThread(sidecar_settings(settings, http_port=-1), backend=probe_backend)
    car = first.__enter__()
    try:
        async with AsyncClient(car.grpc_target, stream=True) as c:
            await c.embed(["milk"])
            probe_backend.hold.clear()  # the next forward waits: the request's own deadline ends it
            try:
                with pytest.raises(DeadlineExceeded):
                    await c.embed(["lemon curd"], timeout_s=0.3)
            finally:
                probe_backend.hold.set()
            assert (await c.embed(["lemon curd"])).embeddings.shape == (1, 384)
            await asyncio.to_thread(first.__exit__, None, None, None)
            with pytest.raises(Unavailable):
                await c.embed(["butter"], timeout_s=10)
            again = sidecar_settings(settings, http_port=-1, grpc_port=car.grpc_port)
            with SidecarThread(again, backend=probe_backend):
                for _ in range(50):  # the channel reconnects with backoff; the next stream opens on it
                    try:
                        assert (await c.embed(["butter"], timeout_s=10)).embeddings.shape == (1, 384)
                        break
                    except Unavailable:
                        await asyncio.sleep(0.2)
                else:
                    pytest.fail("the stream did not reopen on the restarted sidecar")
    finally:
        probe_backend.hold.set()
        if first.sidecar is not None and not first._loop.is_closed():
            first.__exit__(None, None, None)
