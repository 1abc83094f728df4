"""The compiled gRPC front over the Triton backend: a sparse query's Triton call is made on the front's
thread through the compiled blocking client (no grpc.aio end wakes), with the same answers and the
same fallback as the main port.

A real tritonserver and real sidecars; the front is built from sidecar/native/front.cc on first use,
and where it cannot build here these tests skip and say why.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from embedcar_settings import Settings
from inference.backends import triton as triton_backend
from inference.errors import Unavailable
from inference.triton.launcher import TritonServer
from sidecar.app import SidecarThread
from sidecar.client import Client
from sidecar.models import FALLBACK
from tests.test_sidecar_native_front import QUERIES, front_target, needs_front, passes, race
from tests.test_sidecar_reliability import wait_for
from tests.test_sidecar_triton import triton_sidecar_settings

pytestmark = pytest.mark.triton


def front_triton_settings(settings: Settings, server: TritonServer, **changes: object) -> Settings:
    return triton_sidecar_settings(settings, server).with_section(
        "sidecar", **({"grpc_server": "compiled", "cache_entries": 0} | changes))


@needs_front
def test_tritons_answers_through_the_front_equal_the_main_ports_and_are_called_on_its_thread(
        settings: Settings, triton_server: TritonServer) -> None:
    aio = front_triton_settings(settings, triton_server, grpc_server="aio")  # the reference answers
    with SidecarThread(front_triton_settings(settings, triton_server)) as sc, SidecarThread(aio) as ref_sc, \
            Client(ref_sc.grpc_target) as main, Client(front_target(sc)) as fast:
        assert sc.backend.name == "triton"
        before = passes(sc, "front")
        for q in QUERIES:
            time.sleep(0.05)
            ref, got = main.embed([q]), fast.embed([q])
            assert got.backend == ref.backend == "triton" and got.model == ref.model
            np.testing.assert_allclose(got.embeddings, ref.embeddings, atol=1e-6)
            assert got.timings_ns["inference"] > 0
        # Each sparse one-text query was Triton's call on the front's thread, none on the loop's client.
        assert passes(sc, "front") - before == len(QUERIES)
        several = fast.embed(QUERIES[:3])  # several texts: handed to the loop, its asynchronous client
        np.testing.assert_allclose(several.embeddings, main.embed(QUERIES[:3]).embeddings, atol=1e-6)
        assert passes(sc, "front") - before == len(QUERIES)


@needs_front
def test_callers_racing_each_other_and_the_loop_all_get_tritons_answers(settings: Settings,
                                                                         triton_server: TritonServer) -> None:
    # More callers than the front lets wait for Triton at once (BLOCKING_CALLS): the rest go to the loop.
    with SidecarThread(front_triton_settings(settings, triton_server)) as sc:
        wrong, errors = race(sc, callers=5, calls=15)
        assert not errors and not wrong


@needs_front
@pytest.mark.slow
def test_triton_killed_the_front_answers_from_the_fallback_or_fails_fast_without_one(
        settings: Settings, own_triton: TritonServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # Probes a minute apart: the front's own call is the first to find Triton gone; it hands the query
    # to the loop, whose client marks Triton down (the fallback answers). After the restart the health
    # poll finds Triton back while the front's channel may still be backing off: the loop answers then.
    monkeypatch.setattr(triton_backend, "PROBE_INTERVAL_S", 60.0)
    with SidecarThread(front_triton_settings(settings, own_triton)) as kept, \
            SidecarThread(front_triton_settings(settings, own_triton, embedded_fallback=False)) as bare, \
            Client(front_target(kept)) as with_fallback, Client(front_target(bare)) as without:
        assert kept.fallback is not None and bare.fallback is None
        assert with_fallback.embed(["before the crash"]).backend == "triton"
        assert without.embed(["before the crash"]).backend == "triton"
        own_triton.kill()
        assert with_fallback.embed(["right after the crash"], timeout_s=30).backend == FALLBACK
        assert with_fallback.embed(["during the outage"], timeout_s=30).backend == FALLBACK
        started = time.monotonic()
        with pytest.raises(Unavailable):
            without.embed(["right after the crash"], timeout_s=30)
        assert time.monotonic() - started < 10  # failed fast, not held until the deadline
        own_triton.start()  # same ports; the sidecars are not touched
        assert wait_for(lambda: kept.model.health.up and bare.model.health.up, 60)
        assert with_fallback.embed(["after the restart"], timeout_s=30).backend == "triton"
        assert without.embed(["after the restart"], timeout_s=30).backend == "triton"
