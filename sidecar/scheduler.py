"""How encoded, bucketed requests reach a backend: the `Scheduler` interface and its simple forms.

    MicroBatcher (sidecar/batcher.py)  a backend that does not batch itself (embedded ORT): merge
                                       what queues up per bucket into one forward pass
    DirectScheduler                    a backend that batches itself (Triton): one call per chunk,
                                       the deadline as the call's timeout; run_now waits for it on
                                       the calling thread (the compiled front's) where the backend
                                       has blocking calls
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

# Triton calls waiting at once on the compiled front's threads (DirectScheduler.run_now); more go to the
# event loop's asynchronous client. The front's gRPC threads are few (about one per core): a thread
# waiting for Triton cannot take another call.
BLOCKING_CALLS = 2


class NotNow(Exception):  # a hand-over to the loop, not an error
    """run_now cannot answer after all (its backend did not answer: whether it is down, and the fallback
    answers, is for the loop's `run` to find): nothing was answered, the caller hands the request to `run`."""


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

    def can_run_now(self) -> bool:
        """Whether `run_now` can answer at once on the calling thread (only the idle micro-batcher can)."""
        return False

    def run_now(self, bucket: int, ids: list[list[int]], deadline: float | None) -> Computed:
        """`run` without waiting, after can_run_now() said yes (sidecar.native_front)."""
        raise Unavailable(f"{type(self).__name__} cannot answer without waiting")

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
        self._calls = backend.blocking()  # None: no call on the calling thread (can_run_now says no)
        self._blocking = 0  # run_now calls waiting for the backend (counted while the loop sleeps)

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

    def can_run_now(self) -> bool:
        return self._calls is not None and self._blocking < BLOCKING_CALLS and self._calls.blocking_ready()

    def run_now(self, bucket: int, ids: list[list[int]], deadline: float | None) -> Computed:
        """One blocking call on the calling thread (the compiled front's); the call's channel lets the
        event loop run while it waits (sidecar.native_front)."""
        calls = self._calls
        if calls is None:
            raise NotNow  # can_run_now said no
        timeout = self._timeout(deadline)
        batch = self._tokenizer.batch(ids, length=bucket)
        t0 = time.perf_counter_ns()
        self._blocking += 1
        try:
            emb = calls.embed_blocking(batch, timeout_s=timeout)
        except Unavailable as exc:  # whether the backend is down (and the fallback answers) is run()'s call
            raise NotNow from exc
        finally:
            self._blocking -= 1
        self._metrics.passes_on_front.inc()
        return self._computed(emb, len(ids), t0)


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

    def can_run_now(self) -> bool:  # the primary only: a backend going down is run()'s to handle
        return self.health.up and self.primary.can_run_now()

    def run_now(self, bucket: int, ids: list[list[int]], deadline: float | None) -> Computed:
        return self.primary.run_now(bucket, ids, deadline)

    def start(self) -> None:
        self.primary.start()
        if self.fallback is not None:
            self.fallback.start()

    async def close(self) -> None:
        await self.primary.close()
        if self.fallback is not None:
            await self.fallback.close()
