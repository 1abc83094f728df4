"""Auth, rate limits, overload, deadlines, backend faults and graceful stop, on real sidecars.

The backend is the real ORT backend behind `ProbeBackend`, which counts what reaches it and can
hold calls or play dead, so the assertions are about behaviour (what was called, what was
refused, what the health service says), never about timing.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedcar_client.client import AsyncClient, Client
from embedcar_settings import Settings
from inference.backends.base import Embeddings
from inference.backends.onnx import OnnxBackend
from inference.errors import DeadlineExceeded, InvalidInput, Overloaded, Unauthenticated, Unavailable
from inference.tokenizer import TokenBatch
from sidecar import models
from sidecar.app import Sidecar, SidecarThread
from sidecar.scheduler import DirectScheduler
from tests.fixtures_sidecar import DirectProbeBackend, ProbeBackend, sidecar_settings, until

KEY_A = "key-a-9f8e7d6c5b4a"
KEY_B = "key-b-0a1b2c3d4e5f"


def health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)


def wait_for(cond: object, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_auth_and_per_tenant_rate_limit(settings: Settings, probe_backend: ProbeBackend,
                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    s = sidecar_settings(settings, api_keys=f"shop-a={KEY_A},shop-b={KEY_B}", rate_per_s=0.01, burst=3)
    with SidecarThread(s, backend=probe_backend) as sc:
        with Client(sc.grpc_target) as anon, pytest.raises(Unauthenticated, match="missing"):
            anon.embed(["milk"])
        with Client(sc.grpc_target, api_key="key-c-wrong") as wrong, pytest.raises(Unauthenticated, match="wrong"):
            wrong.embed(["milk"])
        with Client(sc.grpc_target, api_key=KEY_A) as a, Client(sc.grpc_target, api_key=KEY_B) as b:
            for _ in range(3):
                a.embed(["milk"])
            with pytest.raises(Overloaded, match="shop-a") as err:
                a.embed(["milk"])
            assert err.value.retry_after_s is not None and err.value.retry_after_s > 0
            assert b.embed(["milk"]).embeddings.shape == (1, 384)  # shop-b has its own bucket
        # Health needs no key.
        assert health(sc.grpc_target) == health_pb2.HealthCheckResponse.SERVING
        url = f"http://127.0.0.1:{sc.http_port}"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "milk"}).status_code == 401
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "milk"}, headers={"authorization": f"Bearer {KEY_B}"})
        assert r.status_code == 200, r.text
    for key in (KEY_A, KEY_B, "key-c-wrong"):
        assert key not in caplog.text
    assert KEY_A not in repr(s.describe())


async def test_the_rate_limit_refuses_stream_messages_and_http_calls(settings: Settings,
                                                                     probe_backend: ProbeBackend) -> None:
    """Each Stream message and each HTTP call takes a token from its tenant's bucket: the limiter's
    own refusal (not admission's), per message on a stream that stays open, and 429 + Retry-After."""
    s = sidecar_settings(settings, api_keys=f"shop-a={KEY_A},shop-b={KEY_B}", rate_per_s=0.01, burst=2)
    with SidecarThread(s, backend=probe_backend) as sc:
        limited = sc.metrics.rejections.labels("rate_limit")._value
        async with AsyncClient(sc.grpc_target, api_key=KEY_A, stream=True) as c:
            await c.embed(["stream one"])
            await c.embed(["stream two"])
            with pytest.raises(Overloaded, match=r"rate limit .* 'shop-a'") as err:
                await c.embed(["stream three"])
            assert err.value.retry_after_s is not None and err.value.retry_after_s > 1
            with pytest.raises(Overloaded, match="rate limit"):  # each message is judged on its own
                await c.embed(["stream four"])
        assert limited.get() == 2
        url, headers = f"http://127.0.0.1:{sc.http_port}", {"authorization": f"Bearer {KEY_B}"}
        async with httpx.AsyncClient(base_url=url, headers=headers) as h:
            for i in range(2):
                assert (await h.post("/v1/embeddings", json={"input": f"http {i}"})).status_code == 200
            r = await h.post("/v1/embeddings", json={"input": "http 2"})
            assert r.status_code == 429 and "rate limit" in r.text and "shop-b" in r.text, r.text
            assert int(r.headers["retry-after"]) >= 1
            r = await h.post("/v1/search", json={"input": "http 3"})  # search too, before its index is asked for
            assert r.status_code == 429 and "rate limit" in r.text, r.text
        assert limited.get() == 4
        assert sc.metrics.rejections.labels("admission")._value.get() == 0


async def test_admission_refuses_stream_messages_one_by_one(settings: Settings, probe_backend: ProbeBackend,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With the backend stalled, Stream messages beyond the queue cap are refused at once, each with its
    own RESOURCE_EXHAUSTED reply; the admitted ones are answered on the same stream afterwards."""
    # cap: 8 texts; the in-flight cap in front of the handler (sidecar.shedding) raised so admission decides
    monkeypatch.setattr(models, "MAX_PENDING_BATCHES", 1)
    s = sidecar_settings(settings, http_port=-1, max_rows_per_pass=4, max_in_flight=1000)
    with SidecarThread(s, backend=probe_backend) as sc:
        refused = sc.metrics.rejections.labels("admission")._value
        probe_backend.hold.clear()
        try:
            async with AsyncClient(sc.grpc_target, stream=True) as c:
                tasks = [asyncio.create_task(c.embed([f"stream overload {i}"], timeout_s=60)) for i in range(12)]
                await until(lambda: refused.get() >= 4, "4 stream messages refused by admission")
                await until(lambda: sum(t.done() for t in tasks) >= 4, "the 4 refusals reached the client")
                early = [t.exception() for t in tasks if t.done()]
                assert len(early) == 4 and all(isinstance(e, Overloaded) for e in early), early
                probe_backend.hold.set()
                results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        finally:
            probe_backend.hold.set()
        assert sum(not isinstance(r, BaseException) for r in results) == 8
        assert refused.get() == 4


def test_non_loopback_bind_without_keys_is_refused(settings: Settings) -> None:
    with pytest.raises(InvalidInput, match="without API keys"):
        Sidecar(sidecar_settings(settings, host="0.0.0.0"))


async def test_overload_rejects_excess_fast(settings: Settings, probe_backend: ProbeBackend,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With the backend stalled, work beyond the queue cap is refused at once, not queued."""
    # cap: 8 texts; gRPC's own backlog cap left at its default, so that admission alone decides here
    monkeypatch.setattr(models, "MAX_PENDING_BATCHES", 1)
    s = sidecar_settings(settings, http_port=-1, max_rows_per_pass=4, transport_backlog=0)
    with SidecarThread(s, backend=probe_backend) as sc:
        probe_backend.hold.clear()
        async with AsyncClient(sc.grpc_target) as c:
            tasks = [asyncio.create_task(c.embed([f"overload query {i}"], timeout_s=60)) for i in range(30)]
            for _ in range(400):  # until the 22 beyond the cap are answered (the 8 admitted hang)
                if sum(t.done() for t in tasks) >= 22:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # room for a wrongly admitted 23rd to show up
            # Everything that finished while the backend was stalled was a rejection.
            early = [t.exception() for t in tasks if t.done()]
            probe_backend.hold.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        assert len(early) == 22 and all(isinstance(e, Overloaded) for e in early), early
        ok = [r for r in results if not isinstance(r, BaseException)]
        assert len(ok) == 8
        assert sc.metrics.rejections.labels("admission")._value.get() == 22
        with Client(sc.grpc_target) as c2:
            assert c2.embed(["after the storm"]).cache_hits == [False]


class SlowProbe(ProbeBackend):
    """A ProbeBackend whose calls take at least `s_per_token` per padded token: the sidecar's start-up
    calibration learns that price (about 3 s of calibration at 2 ms)."""

    def __init__(self, inner: OnnxBackend, s_per_token: float) -> None:
        super().__init__(inner)
        self.s_per_token = s_per_token

    async def embed(self, batch: TokenBatch, *, timeout_s: float | None = None) -> Embeddings:
        await asyncio.sleep(self.s_per_token * batch.input_ids.size)
        return await super().embed(batch, timeout_s=timeout_s)


def test_deadline_shorter_than_the_inference_is_refused_by_the_sidecar(settings: Settings,
                                                                      onnx_backend: OnnxBackend) -> None:
    # Calibrated at 2 ms per token, 16 texts of 256 tokens cost about 8 s: a 4 s deadline cannot be
    # met, and the sidecar must say so at once (its own rejection, counted in its metrics) without
    # spending the backend on it. 4 s is far more than the refusal's round trip even on a busy
    # machine, so the client's own deadline cannot expire first.
    slow = SlowProbe(onnx_backend, s_per_token=0.002)
    long_texts = [f"{i} " + "apple " * 300 for i in range(16)]  # truncated to 256 tokens each
    with SidecarThread(sidecar_settings(settings, http_port=-1), backend=slow) as sc, Client(sc.grpc_target) as c:
        rejected = sc.metrics.rejections.labels("deadline")
        before, calls = rejected._value.get(), slow.calls
        for i in range(3):
            with pytest.raises(DeadlineExceeded, match="inference needs about"):  # the sidecar's estimate
                c.embed(long_texts[i:], timeout_s=4.0)
        assert rejected._value.get() == before + 3
        assert slow.calls == calls  # refused before the backend
        # A deadline the estimate fits is admitted and computed.
        assert c.embed(["a short one"], timeout_s=60).cache_hits == [False]
        assert slow.calls == calls + 1


async def test_the_callers_remaining_deadline_is_the_timeout_of_a_backend_that_batches_itself(
        settings: Settings, onnx_backend: OnnxBackend) -> None:
    """The Triton path (DirectScheduler): each backend call carries what is left of the caller's
    deadline as its timeout (a unary call's gRPC deadline, a Stream message's own timeout_ms, or the
    sidecar's default without either), so the backend neither computes nor holds a request its caller
    has given up on. Against the real tritonserver: tests/test_sidecar_triton.py."""
    probe = DirectProbeBackend(onnx_backend)
    s = sidecar_settings(settings, http_port=-1, embedded_fallback=False, default_deadline_ms=45_000)
    with SidecarThread(s, backend=probe) as sc:
        assert isinstance(sc.models.default.scheduler.primary, DirectScheduler)  # the path under test
        for stream, timeout in ((False, 7.0), (False, 30.0), (True, 5.0), (False, None)):
            async with AsyncClient(sc.grpc_target, stream=stream) as c:
                n = len(probe.timeouts)
                t0 = time.monotonic()
                await c.embed([f"deadline {stream} {timeout}"], timeout_s=timeout)
                elapsed = time.monotonic() - t0
            (got,) = probe.timeouts[n:]
            want = 45.0 if timeout is None else timeout
            # Not less than it had left, and not more than the caller gave but for gRPC's own slack: a
            # unary deadline travels as a timeout header rounded up to coarse units (100 ms between 10
            # and 100 s), taken from the client's wall clock onto the server's monotonic one (seen:
            # +97 ms on a freshly booted clock).
            assert got is not None and want - elapsed <= got <= want + 0.15, (stream, timeout, got, elapsed)


def test_deadline_passing_in_the_queue_is_never_computed(settings: Settings, probe_backend: ProbeBackend) -> None:
    with SidecarThread(sidecar_settings(settings, http_port=-1), backend=probe_backend) as sc, \
            Client(sc.grpc_target) as c:
        calls = probe_backend.calls
        # A request whose deadline passes while it waits behind a stalled batch is dropped, not run.
        probe_backend.hold.clear()
        first = threading.Thread(target=lambda: c.embed(["the slow one"], timeout_s=60))
        first.start()
        assert wait_for(lambda: probe_backend.calls == calls + 1)
        with pytest.raises(DeadlineExceeded):
            c.embed(["expires in the queue"], timeout_s=0.3)
        probe_backend.hold.set()
        first.join(30)
        # The next call reaches the backend only after anything still queued ahead of it.
        assert c.embed(["a later one"]).cache_hits == [False]
        assert probe_backend.calls == calls + 2
        assert c.embed(["expires in the queue"]).cache_hits == [False]  # it was never computed
        assert probe_backend.calls == calls + 3


def test_backend_down_fails_fast_and_recovers(settings: Settings, probe_backend: ProbeBackend) -> None:
    with SidecarThread(sidecar_settings(settings, http_port=-1), backend=probe_backend) as sc, \
            Client(sc.grpc_target) as c:
        assert health(sc.grpc_target) == health_pb2.HealthCheckResponse.SERVING
        probe_backend.down = True
        with pytest.raises(Unavailable):
            c.embed(["while down 1"])
        assert wait_for(lambda: health(sc.grpc_target) == health_pb2.HealthCheckResponse.NOT_SERVING)
        calls = probe_backend.calls
        with pytest.raises(Unavailable, match="down"):
            c.embed(["while down 2"])
        assert probe_backend.calls == calls  # failed fast, in the sidecar
        probe_backend.down = False
        assert wait_for(lambda: health(sc.grpc_target) == health_pb2.HealthCheckResponse.SERVING)
        assert c.embed(["while down 1"]).cache_hits == [False]  # recovered without a restart


def refuses_rpcs(target: str) -> bool:
    """The gRPC server at `target` no longer takes calls (a health check is refused, not answered)."""
    with grpc.insecure_channel(target) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.RpcError as exc:
            return bool(exc.code() == grpc.StatusCode.UNAVAILABLE)
        return False


def test_graceful_stop_finishes_in_flight(settings: Settings, probe_backend: ProbeBackend) -> None:
    t = SidecarThread(sidecar_settings(settings, http_port=-1), backend=probe_backend)
    with t as sc, Client(sc.grpc_target) as c:
        probe_backend.hold.clear()
        box: dict[str, object] = {}
        calls = probe_backend.calls
        req = threading.Thread(target=lambda: box.update(r=c.embed(["in flight at shutdown"], timeout_s=60)))
        req.start()
        assert wait_for(lambda: probe_backend.calls == calls + 1 and sc.admission.outstanding_items == 1)
        stopper = threading.Thread(target=lambda: t.call(sc.stop(grace_s=20)))
        stopper.start()
        # The stop is under way (the server refuses new calls) while the in-flight call is still held ...
        assert wait_for(lambda: refuses_rpcs(sc.grpc_target))
        assert stopper.is_alive() and req.is_alive() and "r" not in box
        probe_backend.hold.set()
        # ... and that call still gets its answer, and only then does the stop complete.
        req.join(30)
        stopper.join(30)
        assert not req.is_alive() and not stopper.is_alive()
        assert "r" in box and box["r"].embeddings.shape == (1, 384)  # type: ignore[attr-defined]
        assert probe_backend.calls == calls + 1
        with pytest.raises(Unavailable):
            c.embed(["after stop"], timeout_s=5)


def test_not_serving_until_backend_is_warm(settings: Settings, probe_backend: ProbeBackend) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sc = Sidecar(sidecar_settings(settings, http_port=-1), backend=probe_backend)
    probe_backend.hold.clear()  # start-up's calibration calls wait here
    started = asyncio.run_coroutine_threadsafe(sc.start(), loop)
    try:
        assert wait_for(lambda: sc.grpc_port != 0 and probe_backend.calls > 0)
        assert health(sc.grpc_target) == health_pb2.HealthCheckResponse.NOT_SERVING
        probe_backend.hold.set()
        started.result(60)
        assert health(sc.grpc_target) == health_pb2.HealthCheckResponse.SERVING
    finally:
        probe_backend.hold.set()
        asyncio.run_coroutine_threadsafe(sc.stop(grace_s=0), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_failed_start_releases_its_port(settings: Settings, probe_backend: ProbeBackend) -> None:
    probe_backend.down = True  # start-up's calibration call fails: start() raises
    sc = Sidecar(sidecar_settings(settings, http_port=0), backend=probe_backend)
    with pytest.raises(Unavailable):
        asyncio.run(sc.start())
    assert sc.grpc_port != 0 and sc.http_port is not None
    for port in (sc.grpc_port, sc.http_port):  # nothing listens there any more
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
