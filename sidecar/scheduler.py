"""How encoded, bucketed requests reach a backend: the `Scheduler` interface and its simple forms.

    MicroBatcher (sidecar/batcher.py)  a backend that does not batch itself (embedded ORT): merge
                                       what queues up per bucket into one forward pass
    DirectScheduler                    a backend that batches itself (Triton): one call per chunk,
                                       the deadline as the call's timeout
    FallbackScheduler                  the primary while its backend is up, else the fallback

The micro-batcher teaches admission control the cost of each forward pass (`Admission.observe`),
so the pipeline only admits and releases. The direct scheduler does not: a call's round trip to a
server that batches (and queues) concurrent calls includes that server's own queueing, so its
samples priced every token at a small call's fixed cost, summed over calls that in fact run in one
batch, and shed requests at 100 req/s (docs/benchmarks.md, admission); the start-up calibration stands.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

from inference.backends.base import Backend, Embeddings
from inference.errors import DeadlineExceeded, Unavailable
from inference.tokenizer import QueryTokenizer
from sidecar.metrics import ModelMetrics


class Computed(NamedTuple):
    embeddings: Embeddings  # [n, dim] for the n sequences of one call
    queue_ns: int
    inference_ns: int
    backend: str  # what answered: "embedded", "triton", "embedded-fallback"


class Scheduler(ABC):
    """Runs one bucket's chunk of token ids on a backend, before `deadline` (time.monotonic())."""

    backend: Backend

    @abstractmethod
    async def run(self, bucket: int, ids: list[list[int]], deadline: float | None) -> Computed:
        """[n] sequences of one bucket -> their embeddings; raises project errors only."""

    def start(self) -> None:  # noqa: B027 - most schedulers have nothing to start
        """Start background work (on the running loop)."""

    async def close(self) -> None:  # noqa: B027
        """Stop; fail what is still queued with Unavailable."""


class DirectScheduler(Scheduler):
    """For backends that batch themselves: one call per chunk, straight through."""

    def __init__(self, backend: Backend, tokenizer: QueryTokenizer, metrics: ModelMetrics) -> None:
        self.backend = backend
        self._tokenizer = tokenizer
        self._metrics = metrics

    @staticmethod
    def _timeout(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise DeadlineExceeded("deadline expired before inference")
        return timeout

    async def run(self, bucket: int, ids: list[list[int]], deadline: float | None) -> Computed:
        timeout = self._timeout(deadline)
        batch = self._tokenizer.batch(ids, length=bucket)
        t0 = time.perf_counter_ns()
        emb = await self.backend.embed(batch, timeout_s=timeout)
        return self._computed(emb, len(ids), t0)

    def _computed(self, emb: Embeddings, rows: int, t0: int) -> Computed:
        dt = time.perf_counter_ns() - t0
        self._metrics.batch_size.observe(rows)
        return Computed(emb, 0, dt, self.backend.name)

class BackendHealth:
    """Whether the primary backend answers: cleared by its Unavailable errors, restored by the
    sidecar's health probe. `on_down` runs when it goes down (the sidecar updates its health)."""

    def __init__(self, metrics: ModelMetrics) -> None:
        self.up = True
        self.on_down: Callable[[], None] | None = None
        self._metrics = metrics

    def mark(self, up: bool) -> None:
        was, self.up = self.up, up
        self._metrics.backend_up.set(1 if up else 0)
        if was and not up and self.on_down is not None:
            self.on_down()


class FallbackScheduler(Scheduler):
    """The primary while its backend is up; the fallback (the embedded model) while it is down."""

    def __init__(self, primary: Scheduler, fallback: Scheduler | None, health: BackendHealth) -> None:
        self.primary = primary
        self.fallback = fallback
        self.backend = primary.backend
        self.health = health

    async def run(self, bucket: int, ids: list[list[int]], deadline: float | None) -> Computed:
        if self.health.up:
            try:
                return await self.primary.run(bucket, ids, deadline)
            except Unavailable:
                self.health.mark(False)  # later calls go straight to the fallback until the probe says up
                if self.fallback is None:
                    raise
        elif self.fallback is None:
            why = self.backend.down_reason()
            raise Unavailable(f"backend {self.backend.name} is down{f' ({why})' if why else ''}; "
                              "waiting for it to come back")
        return await self.fallback.run(bucket, ids, deadline)

    def start(self) -> None:
        self.primary.start()
        if self.fallback is not None:
            self.fallback.start()

    async def close(self) -> None:
        await self.primary.close()
        if self.fallback is not None:
            await self.fallback.close()
