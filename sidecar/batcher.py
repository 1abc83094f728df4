"""Micro-batcher for the embedded backend: per length bucket, one forward pass for what is queued.

There is no Triton to batch for the embedded backend, so the sidecar does it: requests of the same
bucket that queue up while a forward pass runs are merged into the next one. At low traffic it does
not wait for company (a fixed batching wait is the largest single cost at typeahead traffic);
it waits up to `wait_us` only while arrivals are denser than that wait, i.e. when waiting is likely
to fill the batch, and stops waiting as soon as the batch is full. Up to `backend.lanes` passes run
at once (model.forward_lanes, each on its share of the ORT threads); with one lane, one at a time.

Time comes from an injected `clock` (time.monotonic by default), so tests can replay any arrival
pattern; the first arrival has no predecessor (a freshly booted machine's monotonic clock is small,
so 0.0 is not "long ago").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from inference.backends.base import Backend
from inference.errors import DeadlineExceeded, EmbedcarError, Internal, Unavailable
from inference.tokenizer import QueryTokenizer
from sidecar.admission import Admission
from sidecar.metrics import ModelMetrics
from sidecar.scheduler import Computed, Scheduler

# The busiest the loop may be with inline passes: a pass at most half the gap between arrivals. A
# request that arrives during an inline pass is seen only when the pass ends, so its gap reads as the
# pass: with "no longer than the gap" the rule held itself at 2x overload (one query per pass, the
# queue hidden in gRPC from admission, accepted P95 50 ms); half the gap leaves that margin.
INLINE_LOAD = 0.5


@dataclass(slots=True)
class _Item:
    ids: list[list[int]]
    deadline: float | None
    fut: asyncio.Future[Computed]
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)


class MicroBatcher(Scheduler):
    def __init__(self, backend: Backend, tokenizer: QueryTokenizer, *, max_items: int, wait_us: int,
                 admission: Admission | None = None, metrics: ModelMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic, label: str | None = None,
                 inline: bool = False) -> None:
        self.backend = backend
        self.label = label or backend.name  # what results say answered them
        self.tokenizer = tokenizer
        self.max_items = max(1, min(max_items, backend.max_batch))
        self.wait_s = max(wait_us, 0) * 1e-6
        # Forward passes on the loop itself while requests are sparse (see _inline_now); one lane only:
        # a forward on the loop would hold the other lanes' next batches back.
        self.lanes = max(1, backend.lanes)
        self.inline = inline and backend.runs_inline and self.lanes == 1
        self._admission = admission  # learns each forward pass's cost
        self._metrics = metrics
        self._queues: dict[int, deque[_Item]] = {}
        self._clock = clock
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lane_free = asyncio.Event()  # set when a forward of several lanes finishes
        self._forwards: set[asyncio.Task[None]] = set()  # forwards in flight beside the loop (lanes > 1)
        self._last_arrival: float | None = None
        self._gap_s = float("inf")  # EMA of the time between submissions; inf until two have arrived
        self._forward_s = 0.0  # EMA of a forward pass's duration (bounds the wait before a deadline)
        self._passing = 0  # passes running (on the loop or the worker thread)
        self.batches = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._forwards:  # let the passes in flight answer their callers
            await asyncio.gather(*self._forwards, return_exceptions=True)
        for q in self._queues.values():
            while q:
                item = q.popleft()
                if not item.fut.done():
                    item.fut.set_exception(Unavailable("sidecar is shutting down"))

    async def run(self, bucket: int, ids: list[list[int]], deadline: float | None) -> Computed:
        """Embed `ids` (all in `bucket`, at most max_items) in the next forward pass of that bucket."""
        if self._task is None:
            raise Unavailable("micro-batcher is not running")
        self._arrival(self._clock())
        item = _Item(ids, deadline, asyncio.get_running_loop().create_future())
        self._queues.setdefault(bucket, deque()).append(item)
        self._wake.set()
        return await item.fut

    def _arrival(self, now: float) -> None:
        last, self._last_arrival = self._last_arrival, now
        if last is None:
            return
        gap = max(now - last, 0.0)
        self._gap_s = gap if self._gap_s == float("inf") else self._gap_s + 0.2 * (gap - self._gap_s)

    def dense(self) -> bool:
        """Arrivals come faster than the batching wait: waiting is likely to bring company."""
        return self._gap_s < self.wait_s

    def _inline_now(self) -> bool:
        """Run this pass on the loop: a thread hop each way costs ~0.3 ms of CPU per query on a small VM
        (the woken thread pays in cold caches), but while the pass runs the loop serves no one else
        (cache hits, admission, refusals wait for it). So only with nothing else queued and while
        arrivals are sparse: a pass takes at most INLINE_LOAD of the gap between them. Under load
        something is queued, or passes fill the gaps: the pass goes to the worker thread."""
        return (self.inline and not any(self._queues.values())
                and self._forward_s <= INLINE_LOAD * self._gap_s)

    def _passed(self, rows: int, bucket: int, pass_ns: int, thread: str) -> None:
        """A pass's bookkeeping: its duration's EMA, admission's cost model, metrics."""
        self.batches += 1
        seconds = pass_ns * 1e-9
        self._forward_s = seconds if not self._forward_s else self._forward_s + 0.2 * (seconds - self._forward_s)
        if self._admission is not None:
            self._admission.observe(rows * bucket, seconds)
        if self._metrics is not None:
            self._metrics.batch_size.observe(rows)
            m = self._metrics
            (m.passes_on_loop if thread == "loop" else m.passes_on_worker).inc()

    def _oldest_bucket(self) -> int | None:
        best: int | None = None
        best_t = 0
        for b, q in self._queues.items():
            if q and (best is None or q[0].enqueued_ns < best_t):
                best, best_t = b, q[0].enqueued_ns
        return best

    def _rows(self, q: deque[_Item]) -> int:
        return sum(len(i.ids) for i in q)

    async def _run(self) -> None:
        while True:
            while len(self._forwards) >= self.lanes:  # every lane busy: the queues keep filling meanwhile
                self._lane_free.clear()
                await self._lane_free.wait()
            bucket = self._oldest_bucket()
            if bucket is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            q = self._queues[bucket]
            if self.wait_s and self.dense() and self._rows(q) < self.max_items:
                await self._fill(q)
            items = self._take(q)
            if not items:
                continue
            if self.lanes == 1:
                await self._forward(bucket, items)
            else:
                task = asyncio.get_running_loop().create_task(self._forward(bucket, items), name="forward")
                self._forwards.add(task)
                task.add_done_callback(self._lane_done)

    def _lane_done(self, task: asyncio.Task[None]) -> None:
        self._forwards.discard(task)
        self._lane_free.set()

    async def _fill(self, q: deque[_Item]) -> None:
        """Wait up to wait_s for `q` to fill (each arrival re-checks), ending in time for the head's deadline."""
        end = self._clock() + self.wait_s
        head = q[0].deadline
        if head is not None:
            end = min(end, head - 2 * self._forward_s)
        while self._rows(q) < self.max_items:
            left = end - self._clock()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _take(self, q: deque[_Item]) -> list[_Item]:
        """Up to max_items rows from the head of `q`; expired or abandoned items are dropped here."""
        out: list[_Item] = []
        rows = 0
        now = self._clock()
        while q and (not out or rows + len(q[0].ids) <= self.max_items):
            item = q.popleft()
            if item.fut.done():  # the caller went away (cancelled)
                continue
            if item.deadline is not None and item.deadline <= now:
                item.fut.set_exception(DeadlineExceeded("deadline expired while queued"))
                continue
            out.append(item)
            rows += len(item.ids)
        return out

    async def _forward(self, bucket: int, items: list[_Item]) -> None:
        start = time.perf_counter_ns()
        rows = [seq for item in items for seq in item.ids]
        on_loop = self._inline_now()
        self._passing += 1
        try:
            batch = self.tokenizer.batch(rows, length=bucket)
            if on_loop:
                emb = self.backend.embed_sync(batch)  # blocks the loop: nothing is waiting for it
            else:
                emb = await self.backend.embed(batch)
        except EmbedcarError as exc:
            self._fail(items, exc)
            return
        except Exception as exc:  # a bug below us must not kill the batcher
            self._fail(items, Internal(f"backend failed: {exc}"))
            return
        finally:
            self._passing -= 1
        end = time.perf_counter_ns()
        self._passed(len(rows), bucket, end - start, "loop" if on_loop else "worker")
        infer_ns = end - start
        offset = 0
        for item in items:
            n = len(item.ids)
            if not item.fut.done():
                item.fut.set_result(Computed(np.ascontiguousarray(emb[offset:offset + n]),
                                             start - item.enqueued_ns, infer_ns, self.label))
            offset += n

    @staticmethod
    def _fail(items: list[_Item], exc: EmbedcarError) -> None:
        for item in items:
            if not item.fut.done():
                item.fut.set_exception(exc)
