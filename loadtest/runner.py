"""Drive one target on an open-loop schedule and record every request.

Per request we keep: its scheduled time, how late it was actually sent (generator lag plus any
wait for the concurrency cap), its latency *from the scheduled time*, and its outcome code.
Requests scheduled inside the warm-up window are sent but flagged, and left out of the stats.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inference import heap
from inference.errors import DeadlineExceeded, EmbedcarError, Internal, InvalidInput
from loadtest.schedule import PacerReport, arrival_offsets, pace, pacer_report
from loadtest.targets import Target, Timings

log = logging.getLogger(__name__)

OK = "ok"


@dataclass(frozen=True, slots=True)
class RunConfig:
    rate: float = 100.0
    duration_s: float = 300.0
    warmup_s: float = 10.0
    batch: int = 1
    concurrency: int = 256
    deadline_ms: float = 1000.0
    arrivals: str = "constant"
    seed: int = 0
    late_ms: float = 5.0  # a release later than this counts against the generator
    spin_ms: float = 1.0  # pacer: yield-spin this long before each send instead of a late timer

    def validate(self) -> RunConfig:
        if self.rate <= 0 or self.duration_s <= 0 or self.warmup_s < 0:
            raise InvalidInput("rate and duration must be positive, warm-up not negative")
        if self.batch < 1 or self.concurrency < 1 or self.deadline_ms <= 0 or self.spin_ms < 0:
            raise InvalidInput("batch, concurrency and deadline must be positive")
        return self

    @property
    def requests(self) -> int:
        return len(arrival_offsets(self.rate, self.warmup_s + self.duration_s, arrivals=self.arrivals,
                                   seed=self.seed))


@dataclass(slots=True)
class Sample:
    index: int
    scheduled_s: float  # from the start of the measured window (warm-up requests are negative)
    send_lag_s: float  # actual send - scheduled send (pacer lag + concurrency-cap wait)
    latency_s: float  # reply (or failure) - scheduled send
    code: str  # "ok" or an inference.errors code
    warmup: bool
    timings_ns: Timings | None = None
    message: str = ""  # the error's message where the call failed (what the server said)


@dataclass(slots=True)
class RunResult:
    target: dict[str, Any]
    config: RunConfig
    samples: list[Sample]
    pacer: PacerReport
    wall_s: float
    generator_cpu_s: float
    stats_before: dict[str, dict[str, int]] | None = None
    stats_after: dict[str, dict[str, int]] | None = None
    errors_seen: dict[str, str] = field(default_factory=dict)  # code -> one example message
    # The measured window on the time.monotonic_ns() clock (the one Triton's traces are stamped with).
    window_ns: tuple[int, int] | None = None

    @property
    def measured(self) -> list[Sample]:
        return [s for s in self.samples if not s.warmup]


def _cpu_s() -> float:
    """CPU time of this whole process (every thread: with --target inprocess that includes ORT)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class SelfPacedTarget(Target):
    """A target that keeps the schedule itself (the compiled sender, loadtest/native.py): `run_load`
    hands it the whole run, which it records in the same samples and result."""

    @abstractmethod
    async def run_schedule(self, texts: Sequence[str], config: RunConfig) -> RunResult:
        """`run_load` for this target: the same schedule, samples and result."""


async def settled_stats(target: Target, *, pause_s: float = 0.05, max_s: float = 1.0
                        ) -> dict[str, dict[str, int]] | None:
    """The target's server statistics once two reads agree: Triton records a request just after its
    reply has left, so a read right after the last reply can miss that request."""
    last = await target.server_stats()
    give_up = time.monotonic() + max_s
    while last is not None and time.monotonic() < give_up:
        await asyncio.sleep(pause_s)
        now = await target.server_stats()
        if now == last:
            break
        last = now
    return last


async def run_load(target: Target, texts: Sequence[str], config: RunConfig) -> RunResult:
    """Send `texts` (cycled, `config.batch` per request) to a started target on the schedule."""
    config.validate()
    if not texts:
        raise InvalidInput("no queries to send")
    if isinstance(target, SelfPacedTarget):
        return await target.run_schedule(texts, config)
    offsets = arrival_offsets(config.rate, config.warmup_s + config.duration_s, arrivals=config.arrivals,
                              seed=config.seed)
    n = len(offsets)
    samples: list[Sample | None] = [None] * n
    errors_seen: dict[str, str] = {}
    gate = asyncio.Semaphore(config.concurrency)
    deadline_s = config.deadline_ms / 1e3
    tasks: set[asyncio.Task[None]] = set()
    clock = time.perf_counter
    stats_box: dict[str, dict[str, dict[str, int]] | None] = {"before": None}

    async def one(i: int, due: float) -> None:
        batch = [texts[(i * config.batch + j) % len(texts)] for j in range(config.batch)]
        if i == first_measured and snap is not None:
            await snap  # the window's "before" statistics are read before its first request is sent
        async with gate:
            sent = clock()
            remaining = deadline_s - (sent - due)
            code, timings, message = OK, None, ""
            if remaining <= 0:
                code = DeadlineExceeded.code  # waited out its whole deadline behind the cap
                message = "waited out its deadline behind the client's concurrency cap"
            else:
                try:
                    # The guard catches a target that ignores its own timeout.
                    timings = await asyncio.wait_for(target.call(batch, timeout_s=remaining), remaining + 1.0)
                except EmbedcarError as exc:
                    code, message = exc.code, exc.message
                except TimeoutError:
                    code, message = DeadlineExceeded.code, "no answer within the deadline (client-side guard)"
                except Exception as exc:  # a target bug must show as an error, not end the run
                    code, message = "client_error", f"{type(exc).__name__}: {exc}"
                if message:
                    errors_seen.setdefault(code, message[:300])
            done = clock()
        off = float(offsets[i]) - config.warmup_s
        samples[i] = Sample(i, off, sent - due, done - due, code, off < 0, timings, message)

    def release(i: int, due: float) -> None:
        t = asyncio.create_task(one(i, due))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def snapshot_at_window_start(at: float) -> None:
        await asyncio.sleep(max(at - clock(), 0.0))
        stats_box["before"] = await target.server_stats()

    if config.warmup_s == 0:
        stats_box["before"] = await target.server_stats()  # the window starts with the first request
    first_measured = int(np.searchsorted(offsets, config.warmup_s))
    with heap.no_full_collections():  # a pause of the generator's own would count in every latency
        cpu0, wall0 = _cpu_s(), clock()
        start = clock() + 0.01
        snap = asyncio.create_task(snapshot_at_window_start(start + config.warmup_s)) if config.warmup_s else None
        lags = await pace(offsets, release, start=start, spin_s=config.spin_ms / 1e3, clock=clock)
        if tasks:
            await asyncio.gather(*list(tasks))
    to_mono = time.monotonic() - clock()
    window_ns = (int((start + config.warmup_s + to_mono) * 1e9), int((clock() + to_mono) * 1e9))
    if snap is not None:
        await snap
    stats_after = await settled_stats(target)
    wall = clock() - wall0
    done = [s for s in samples if s is not None]
    if len(done) != n:
        raise Internal(f"{n - len(done)} requests have no record")
    # Pacer lag of measured requests only: warm-up is allowed to be rough.
    pacer = pacer_report(lags[offsets >= config.warmup_s], late_ms=config.late_ms)
    return RunResult(target.describe(), config, done, pacer, wall, _cpu_s() - cpu0,
                     stats_box["before"], stats_after, errors_seen, window_ns)

