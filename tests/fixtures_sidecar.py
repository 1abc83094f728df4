"""pytest fixtures for the sidecar tests (loaded by tests/conftest.py).

Sidecars run on their own event loop in a background thread (`SidecarThread`), so tests can use
the sync client, or an async client on the test's own loop, against a real gRPC server on a free
127.0.0.1 port.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from embedcar_client.client import Client
from embedcar_settings import Settings
from inference.backends.base import Backend, Embeddings
from inference.backends.onnx import OnnxBackend
from inference.errors import DeadlineExceeded, EmbedcarError, Unavailable
from inference.tokenizer import TokenBatch
from sidecar.app import Sidecar, SidecarThread


def sidecar_settings(settings: Settings, **changes: Any) -> Settings:
    """Test settings: loopback, free ports, generous limits unless a test sets its own."""
    base: dict[str, Any] = {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0, "rate_per_s": 1e6,
                            "burst": 1_000_000, "grace_s": 1.0,
                            # the box is shared with other test runs: correctness tests must not
                            # trip deadlines or latency budgets meant for production latency
                            "default_deadline_ms": 60_000, "admission_budget_ms": 0.0}
    return settings.with_section("sidecar", **(base | changes))


@pytest.fixture(scope="session")
def sidecar_embedded(settings: Settings, model_dir: object) -> Iterator[Sidecar]:
    """A started Sidecar with the embedded backend, gRPC + HTTP on free ports, no API keys."""
    with SidecarThread(sidecar_settings(settings)) as sc:
        yield sc


@pytest.fixture(scope="session")
def sidecar_client(sidecar_embedded: Sidecar) -> Iterator[Client]:
    with Client(sidecar_embedded.grpc_target) as c:
        yield c


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Wait for an event the test caused on the sidecar's loop; the timeout only stops a test whose
    event never comes (and names it), it decides nothing on a slow machine."""
    async def poll() -> None:
        while not cond():  # noqa: ASYNC110 - set on the sidecar's loop, another thread: no asyncio.Event to share
            await asyncio.sleep(0.005)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        pytest.fail(f"never happened: {what}")


class ProbeBackend(Backend):
    """The real ORT backend behind a switchboard: counts calls, can hold them, or act as down.

    Used where a test must observe what reaches the backend (deadlines, single-flight, faults);
    the embeddings still come from real ONNX Runtime. Like a real backend it honours each call's
    `timeout_s` (recorded in `timeouts`): a call held past it fails with DeadlineExceeded.
    `entered` is set when a call reaches the backend, so a test can wait for that event.
    """

    name = "embedded"  # goes through the sidecar's micro-batcher like the real one

    def __init__(self, inner: OnnxBackend) -> None:
        self.inner = inner
        self.version_id = inner.version_id
        self.dim = inner.dim
        self.max_batch = inner.max_batch
        self.calls = 0
        self.rows = 0
        self.timeouts: list[float | None] = []  # each call's timeout_s, in call order
        self.entered = threading.Event()  # set by every call that reaches the backend
        self.hold = threading.Event()
        self.hold.set()  # set = let calls through
        self.down = False
        self.fail: EmbedcarError | None = None  # raised by the next calls (after they were let through)

    async def start(self) -> None:
        return None

    async def embed(self, batch: TokenBatch, *, timeout_s: float | None = None) -> Embeddings:
        if self.down:
            raise Unavailable("probe backend is down")
        self.calls += 1
        self.rows += batch.shape[0]
        self.timeouts.append(timeout_s)
        self.entered.set()
        # A threading.Event: the test thread opens it.
        if not self.hold.is_set() and not await asyncio.to_thread(self.hold.wait, timeout_s or 30):
            raise DeadlineExceeded(f"probe backend held the call past its {timeout_s} s timeout")
        if self.fail is not None:
            raise self.fail
        return await self.inner.embed(batch)

    def ready(self) -> bool:
        return not self.down

    async def close(self) -> None:
        return None


class DirectProbeBackend(ProbeBackend):
    """A ProbeBackend that batches itself, as Triton does: the sidecar sends each request straight
    through its DirectScheduler (the Triton path) instead of the micro-batcher."""

    name = "triton"
    batches_itself = True


@pytest.fixture
def probe_backend(onnx_backend: OnnxBackend) -> ProbeBackend:
    return ProbeBackend(onnx_backend)
