"""The compiled gRPC front on the main port (sidecar.grpc_server=compiled): the same answers, errors and
limits as grpc.aio's, queries answered on its own thread while the loop sleeps, the rest handed to the loop.

Real sidecars (the session's ORT backend) and real gRPC clients; the front is built from
sidecar/native/front.cc on first use, and where it cannot build here these tests skip and say why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedcar_settings import Settings
from inference import native_cache
from inference.backends.onnx import OnnxBackend
from inference.errors import DeadlineExceeded, InvalidInput, Overloaded, Unauthenticated, Unavailable
from sidecar import native_build
from sidecar.app import Sidecar, SidecarThread
from sidecar.client import Client, embed_request
from sidecar.native_front import SOURCE, unavailable_reason
from sidecar.proto import embedcar_pb2 as pb
from sidecar.wire import SERVICE
from tests.fixtures_sidecar import sidecar_settings

KEY = "front-key-9a8b7c6d5e"
QUERIES = ["oat milk", "free range eggs dozen", "dark chocolate sea salt 100g", "basmati rice 2 lb", "greek yogurt"]
WHY_NOT = unavailable_reason()
needs_front = pytest.mark.skipif(WHY_NOT is not None, reason=f"the compiled front cannot build here: {WHY_NOT}")


def front_settings(settings: Settings, **changes: object) -> Settings:
    """The compiled front on the main port (a sidecar with grpc_server=aio is the reference)."""
    return sidecar_settings(settings, http_port=-1, grpc_server="compiled", **changes)


def front_target(sc: Sidecar) -> str:
    assert sc.grpc_server == "compiled"
    return sc.grpc_target


def passes(sc: Sidecar, thread: str) -> float:
    m = sc.model
    return sc.metrics.registry.get_sample_value(
        "embedcar_forward_passes_total", {"model": m.name, "version": m.version_id, "thread": thread}) or 0.0


@pytest.fixture(scope="module")
def front(settings: Settings, onnx_backend: OnnxBackend) -> Iterator[Sidecar]:
    if WHY_NOT is not None:
        pytest.skip(f"the compiled front cannot build here: {WHY_NOT}")
    with SidecarThread(front_settings(settings, cache_entries=0), backend=onnx_backend) as sc:
        yield sc


@pytest.fixture(scope="module")
def aio(settings: Settings, onnx_backend: OnnxBackend) -> Iterator[Sidecar]:
    """The same backend served by grpc.aio: the reference answers."""
    s = sidecar_settings(settings, http_port=-1, grpc_server="aio", cache_entries=0)
    with SidecarThread(s, backend=onnx_backend) as sc:
        yield sc


@needs_front
def test_embed_on_the_front_equals_grpc_aio_and_sparse_queries_run_on_its_thread(front: Sidecar, aio: Sidecar) -> None:
    before = passes(front, "front")
    with Client(aio.grpc_target) as main, Client(front_target(front)) as fast:
        for texts in ([QUERIES[0]], QUERIES[:3], [QUERIES[3]], [QUERIES[4]]):
            time.sleep(0.3)  # sparse arrivals: a pass is well under half the gap
            ref, got = main.embed(texts), fast.embed(texts)
            assert got.model == ref.model and got.backend == ref.backend == "embedded"
            assert got.cache_hits == [False] * len(texts) and got.truncated == ref.truncated
            np.testing.assert_allclose(got.embeddings, ref.embeddings, atol=1e-6)
            assert got.timings_ns["inference"] > 0 and got.timings_ns["total"] >= got.timings_ns["inference"]
        half = pb.EmbedReply.FromString(fast.raw_embed(embed_request(QUERIES[:1], True).SerializeToString()))
        assert half.dtype == pb.FLOAT16 and len(half.embeddings) == 2 * 384
    # The single queries (and only those) ran on the front's thread; the three-text one went to the loop.
    assert passes(front, "front") - before >= 2


@needs_front
def test_errors_are_the_main_ports(front: Sidecar) -> None:
    with Client(front_target(front)) as c:
        with pytest.raises(InvalidInput):
            c.embed([])
        with pytest.raises(InvalidInput, match="not a valid"):
            c.raw_embed(b"\xff\xff not protobuf")
        with pytest.raises(InvalidInput):
            c.embed(["x" * 20_000])
        with pytest.raises(DeadlineExceeded):
            c.embed(["a query with a deadline already gone"], timeout_s=1e-6)
        assert c.embed(["still serving"]).embeddings.shape == (1, 384)
    with grpc.insecure_channel(front_target(front)) as channel:  # health is served here too; nothing else
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/embedcar.v1.Elsewhere/Call")(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def race(sc: Sidecar, callers: int, calls: int) -> tuple[list[str], list[Exception]]:
    """`callers` threads, each sending `calls` one-text Embeds to the front at once: the queries whose
    answer differs from one asked alone first, and the errors raised."""
    with Client(sc.grpc_target) as main:
        ref = {q: main.embed([q]).embeddings[0] for q in QUERIES}
    wrong: list[str] = []
    errors: list[Exception] = []

    def caller(seed: int) -> None:
        with Client(front_target(sc)) as c:
            for i in range(calls):
                q = QUERIES[(seed + i) % len(QUERIES)]
                try:
                    if not np.allclose(c.embed([q]).embeddings[0], ref[q], atol=1e-6):
                        wrong.append(q)
                except Exception as exc:
                    errors.append(exc)

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return wrong, errors


@needs_front
def test_many_callers_at_once_get_their_own_answers(front: Sidecar) -> None:
    # Calls race the loop and each other: some are answered on the front's thread, some on the loop.
    wrong, _errors = race(front, callers=6, calls=25)
    assert not wrong


@needs_front
def test_keys_and_rate_limits_apply_once_per_call(settings: Settings, onnx_backend: OnnxBackend) -> None:
    # A call handed from the front's thread to the loop was authenticated there: one token, not two.
    s = front_settings(settings, api_keys=f"shop={KEY}", rate_per_s=1e-3, burst=3)
    with SidecarThread(s, backend=onnx_backend) as sc:
        with Client(front_target(sc)) as anon, pytest.raises(Unauthenticated, match="missing"):
            anon.embed(["milk"])
        with Client(front_target(sc), api_key="wrong-key") as wrong, pytest.raises(Unauthenticated):
            wrong.embed(["milk"])
        with Client(front_target(sc), api_key=KEY) as ok:
            ok.embed(QUERIES[:2])  # several texts: taken on the front's thread, answered on the loop
            time.sleep(0.3)
            ok.embed(QUERIES[2:3])  # one text, sparse: answered on the front's thread
            ok.embed(QUERIES[3:5])
            with pytest.raises(Overloaded) as refused:
                ok.embed(["one too many"])
        assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0


@needs_front
def test_calls_past_the_backlog_are_refused_at_once_while_the_loop_is_held(settings: Settings,
                                                                          onnx_backend: OnnxBackend) -> None:
    # The loop held for a second (as by a long stall): a burst of several-text calls (each handed to
    # the loop) fills the backlog, and the calls past it come back refused without waiting for it.
    thread = SidecarThread(front_settings(settings, transport_backlog=4, cache_entries=0), backend=onnx_backend)
    with thread as sc:
        target = front_target(sc)
        with Client(target) as warm:
            warm.embed(QUERIES[:2])
        outcomes: list[tuple[str, float]] = []

        def caller() -> None:
            t0 = time.perf_counter()
            with Client(target) as c:
                try:
                    c.embed(QUERIES[:2], timeout_s=30)
                    outcomes.append(("ok", time.perf_counter() - t0))
                except Overloaded as exc:
                    assert exc.retry_after_s is not None and "event loop is behind" in exc.message
                    outcomes.append(("refused", time.perf_counter() - t0))

        held = threading.Event()

        def shed() -> float:
            return sc.metrics.registry.get_sample_value("embedcar_rejections_total", {"reason": "shed"}) or 0.0

        def hold() -> None:  # runs on the loop: nothing else on it runs until every call has come in
            held.set()
            end = time.monotonic() + 20
            while shed() < 8 and time.monotonic() < end:
                time.sleep(0.01)

        thread.loop.call_soon_threadsafe(hold)
        assert held.wait(10)
        callers = [threading.Thread(target=caller) for _ in range(12)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(60)
        shed_count = shed()
    # Four waited for the loop and were answered once it was free; the other eight were refused while
    # it was still held (the loop counted them before it let go), i.e. without waiting for it.
    assert sorted(kind for kind, _s in outcomes) == ["ok"] * 4 + ["refused"] * 8, outcomes
    assert shed_count == 8


@needs_front
def test_the_front_stops_with_the_sidecar_and_frees_its_port(settings: Settings, onnx_backend: OnnxBackend) -> None:
    with SidecarThread(front_settings(settings), backend=onnx_backend) as sc:
        target = front_target(sc)
        with Client(target) as c:
            assert c.embed(["milk"]).embeddings.shape == (1, 384)
    with Client(target) as c, pytest.raises(Unavailable):
        c.embed(["milk"], timeout_s=2)


def test_a_front_that_cannot_build_says_what_it_needs(settings: Settings, onnx_backend: OnnxBackend,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(native_cache, "BUILT", {})  # nothing built yet in this process
    monkeypatch.setattr(native_build, "BUILD_DIR", tmp_path / "build")
    monkeypatch.setattr("inference.native_cache.shutil.which", lambda _name: None)  # no compiler
    assert SOURCE.exists()
    # The default main port (grpc_server=compiled) falls back to grpc.aio, saying what it needs, and serves.
    with caplog.at_level(logging.WARNING, logger="sidecar.app"), \
            SidecarThread(sidecar_settings(settings, http_port=-1), backend=onnx_backend) as sc, \
            Client(sc.grpc_target) as c:
        assert sc._main_front is None
        assert c.embed(["milk"], timeout_s=5).embeddings.shape[0] == 1
    assert any("grpc_server=compiled" in r.getMessage() and "grpc.aio instead" in r.getMessage()
               and "libgrpc++-dev" in r.getMessage() for r in caplog.records)
