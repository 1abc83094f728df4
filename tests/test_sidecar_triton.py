"""The sidecar in front of a real tritonserver: same answers as embedded, faults, recovery.

Kill/restart tests use their own TritonServer (not the shared session one) on fresh ports.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from embedcar_client.client import Client
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.errors import DeadlineExceeded, EmbedcarError, FailedPrecondition, Unavailable
from inference.tokenizer import QueryTokenizer
from inference.triton.launcher import TritonServer
from sidecar.app import SidecarThread
from tests.fixtures_sidecar import sidecar_settings
from tests.test_sidecar_embed import reference, texts_for_every_bucket
from tests.test_sidecar_reliability import health, wait_for

pytestmark = pytest.mark.triton


class MissLoad:
    """A background thread sending a steady stream of cache misses; records who answered and errors."""

    def __init__(self, client: Client, prefix: str) -> None:
        self.client, self.prefix = client, prefix
        self.answered: list[str] = []
        self.errors: list[EmbedcarError] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                self.answered.append(self.client.embed([f"{self.prefix} {i}"], timeout_s=30).backend)
            except EmbedcarError as exc:
                self.errors.append(exc)

    def __enter__(self) -> MissLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def triton_sidecar_settings(settings: Settings, server: TritonServer) -> Settings:
    s = settings.with_section("triton", urls=(server.grpc_url,), timeout_ms=10_000)
    return sidecar_settings(s, backend="triton", http_port=-1)


def test_sidecar_with_triton_equals_embedded(settings: Settings, triton_server: TritonServer,
                                             onnx_backend: OnnxBackend, tokenizer: QueryTokenizer) -> None:
    texts = texts_for_every_bucket(tokenizer)
    ref = reference(onnx_backend, tokenizer, texts)
    # Equality, not speed: the first call spans every bucket up to 512 tokens on a shared CPU Triton
    # (once it outlasted the 10 s Triton timeout of the other tests here), so it gets 60 s.
    s = triton_sidecar_settings(settings, triton_server).with_section("triton", timeout_ms=60_000)
    with SidecarThread(s) as sc, Client(sc.grpc_target) as c:
        assert sc.backend.name == "triton"
        calibrated = (sc.admission.s_per_token, sc.admission.s_per_call)
        r = c.embed(texts)
        assert r.model == onnx_backend.version_id  # same version id as the embedded backend
        cos = np.sum(r.embeddings * ref, axis=1)
        assert cos.min() >= 0.9999, cos
        one = np.stack([c.embed([t]).embeddings[0] for t in texts[:6]])
        assert np.sum(one * ref[:6], axis=1).min() >= 0.9999
        again = c.embed(texts[:3])
        assert again.cache_hits == [True, True, True]
        # Triton's round trips include its own queueing: they must not re-price admission's tokens.
        assert (sc.admission.s_per_token, sc.admission.s_per_call) == calibrated


def test_the_callers_deadline_reaches_tritons_encoder_through_the_sidecar(
        settings: Settings, triton_server: TritonServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Caller -> sidecar -> DirectScheduler -> TritonBackend -> tritonserver: the deadline the encoder
    checks is the caller's, not the backend's own timeout (120 s here).

    No stopwatch: the backend's wall clock (what it stamps the deadline it sends from) is set 60 s
    back once the sidecar is up. A deadline made from the caller's 5 s has then passed on Triton's
    clock, and the encoder refuses the request ("expired before the encoder ran", DEADLINE_EXCEEDED
    to the caller); one made from 100 s (or from the backend's 120 s, had the sidecar dropped the
    caller's) has not, and is computed."""
    from inference.backends import triton as triton_module

    s = triton_sidecar_settings(settings, triton_server).with_section("triton", timeout_ms=120_000)
    s = s.with_section("sidecar", embedded_fallback=False, default_deadline_ms=300_000)
    with SidecarThread(s) as sc, Client(sc.grpc_target) as c:
        assert sc.backend.name == "triton"
        real = time.time_ns
        monkeypatch.setattr(triton_module, "time", SimpleNamespace(time_ns=lambda: real() - 60 * 10**9,
                                                                   monotonic=time.monotonic))
        with pytest.raises(DeadlineExceeded, match="expired before the encoder ran"):
            c.embed(["a caller with five seconds"], timeout_s=5.0)
        r = c.embed(["a caller with a hundred seconds"], timeout_s=100.0)
        assert r.backend == "triton" and r.cache_hits == [False]
        monkeypatch.undo()
        # A refusal is not an outage: the sidecar still serves from Triton.
        assert c.embed(["a caller with five seconds"], timeout_s=5.0).backend == "triton"


def test_sidecar_refuses_a_triton_serving_another_variant(settings: Settings, triton_server: TritonServer) -> None:
    """The session's Triton serves fp32; a sidecar on the int8 default would cache and search int8
    vectors under fp32 answers: it does not start, and says which setting to change."""
    s = triton_sidecar_settings(settings, triton_server).with_section("model", variant="int8")
    with pytest.raises(FailedPrecondition, match=r"does not serve embedder\.\S+ \(model version .*/int8\); "
                       r"it serves embedder\.\S+ \(.*/fp32\)"), SidecarThread(s):
        pass


@pytest.mark.slow
def test_triton_killed_mid_load_then_restarted_without_fallback(settings: Settings, own_triton: TritonServer) -> None:
    s = triton_sidecar_settings(settings, own_triton).with_section("sidecar", embedded_fallback=False)
    with SidecarThread(s) as sc, Client(sc.grpc_target) as c:
        assert sc.fallback is None
        assert c.embed(["before the crash"]).embeddings.shape == (1, 384)
        with MissLoad(c, "load query number") as load:
            assert wait_for(lambda: len(load.answered) >= 3)
            own_triton.kill()
            assert wait_for(lambda: len(load.errors) >= 3)
            assert wait_for(lambda: health(sc.grpc_target) == health_pb2.HealthCheckResponse.NOT_SERVING)
            # Failing fast: UNAVAILABLE, not requests hanging until their 30 s deadline.
            assert all(isinstance(e, Unavailable) for e in load.errors), load.errors
            with pytest.raises(Unavailable):
                c.embed(["during the outage"], timeout_s=30)

            own_triton.start()  # same ports; the sidecar is not touched
            assert wait_for(lambda: health(sc.grpc_target) == health_pb2.HealthCheckResponse.SERVING, 60)
            n = len(load.answered)
            assert wait_for(lambda: len(load.answered) > n + 3, 60)
            assert c.embed(["after the restart"]).cache_hits == [False]


@pytest.mark.slow
def test_embedded_fallback_answers_while_triton_is_down(settings: Settings, own_triton: TritonServer,
                                                        onnx_backend: OnnxBackend, tokenizer: QueryTokenizer) -> None:
    s = triton_sidecar_settings(settings, own_triton).with_section("sidecar", http_port=0)
    with SidecarThread(s) as sc, Client(sc.grpc_target) as c:
        assert sc.fallback is not None  # on by default: the model files are here
        assert c.embed(["before the crash"]).backend == "triton"
        http = f"http://127.0.0.1:{sc.http_port}/v1/embeddings"
        assert httpx.post(http, json={"input": "http before the crash"}).headers["x-embedcar-backend"] == "triton"
        with MissLoad(c, "fallback load query") as load:
            assert wait_for(lambda: load.answered.count("triton") >= 3)
            own_triton.kill()
            assert wait_for(lambda: load.answered.count("embedded-fallback") >= 5, 60)
            # The outage is invisible to callers: same embeddings, still SERVING, nothing failed.
            during = c.embed(["oat milk during the outage"])
            assert during.backend == "embedded-fallback"
            answer = httpx.post(http, json={"input": "http during the outage"}, timeout=30)
            assert answer.status_code == 200 and answer.headers["x-embedcar-backend"] == "embedded-fallback"
            ref = reference(onnx_backend, tokenizer, ["oat milk during the outage"])
            assert float(np.sum(during.embeddings * ref)) >= 0.9999
            assert health(sc.grpc_target) == health_pb2.HealthCheckResponse.SERVING

            own_triton.start()  # same ports; the sidecar is not touched
            assert wait_for(lambda: load.answered[-1] == "triton", 60)
            assert c.embed(["after the restart"]).backend == "triton"
        assert load.errors == []
        fallback = sc.metrics.backend_answers.labels(*sc.models.default.metrics.labels, "embedded-fallback")
        assert fallback._value.get() >= 5
