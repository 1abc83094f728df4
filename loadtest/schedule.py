"""Open-loop arrival schedules and the pacer that keeps them.

Requests are released at fixed times (constant rate or Poisson arrivals) whether or not earlier
ones have returned. Each latency is later measured from its *scheduled* time, so when the system
under test (or the generator itself) stalls, the stall shows in the numbers instead of silently
slowing the sender ("coordinated omission"). The pacer records how late it released each request,
so a generator starved of CPU is visible and reported, not mistaken for the server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from inference.errors import InvalidInput

log = logging.getLogger(__name__)

ARRIVALS = ("constant", "poisson")

FloatArray = npt.NDArray[np.float64]


def arrival_offsets(rate: float, duration_s: float, *, arrivals: str = "constant", seed: int = 0) -> FloatArray:
    """Send times in seconds from the start, covering [0, duration_s)."""
    if rate <= 0 or duration_s <= 0:
        raise InvalidInput(f"rate and duration must be positive (got rate={rate}, duration={duration_s})")
    if arrivals == "constant":
        return np.arange(round(rate * duration_s), dtype=np.float64) / rate
    if arrivals == "poisson":
        rng = np.random.default_rng(seed)
        # Draw a generous number of exponential gaps, keep those that land inside the window.
        n = int(rate * duration_s + 10 * np.sqrt(rate * duration_s) + 10)
        times = np.cumsum(rng.exponential(1.0 / rate, size=n))
        times = np.concatenate(([0.0], times[:-1]))
        return times[times < duration_s]
    raise InvalidInput(f"arrivals must be one of {', '.join(ARRIVALS)}, got {arrivals!r}")


@dataclass(frozen=True, slots=True)
class PacerReport:
    """How well the generator kept its schedule (lag = actual release - scheduled release)."""

    released: int
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    late_share: float  # share released more than `late_ms` after their time
    late_ms: float

    @property
    def kept(self) -> bool:
        return self.late_share <= 0.01

    def warning(self) -> str | None:
        if self.kept:
            return None
        return (f"load generator fell behind its schedule: {self.late_share:.1%} of requests released more "
                f"than {self.late_ms:g} ms late (p99 lag {self.lag_p99_ms:.1f} ms, max {self.lag_max_ms:.1f} ms); "
                "it shares the CPU with the system under test, so latencies include its lag")


async def pace(
    offsets: FloatArray,
    release: Callable[[int, float], None],
    *,
    start: float | None = None,
    spin_s: float = 0.001,
    clock: Callable[[], float] = time.perf_counter,
) -> FloatArray:
    """Call `release(i, scheduled_abs)` at `start + offsets[i]` for every i; never waits for replies.

    `release` must return at once (it should spawn a task). Returns each release's lag in seconds.
    `spin_s`: how long before each due time to stop sleeping and yield-spin (0 = timers only; the
    spin costs about `rate * spin_s / 2` of one core).
    """
    t0 = clock() + 0.005 if start is None else start
    lags = np.zeros(len(offsets), dtype=np.float64)
    for i, off in enumerate(offsets):
        due = t0 + float(off)
        delay = due - clock()
        # The event loop's timers wake up to 1 ms late (epoll rounds its timeout up to whole ms):
        # sleep to just short of the due time, then yield-spin the rest (other tasks keep running).
        if delay > spin_s:
            await asyncio.sleep(delay - spin_s)
        while clock() < due:  # noqa: ASYNC110 - a deliberate yield-spin, not a wait for an event
            await asyncio.sleep(0)
        if delay <= 0:
            await asyncio.sleep(0)  # behind schedule: release at once, but let replies be handled
        lags[i] = max(clock() - due, 0.0)
        release(i, due)
    return lags


def pacer_report(lags_s: FloatArray, *, late_ms: float = 5.0) -> PacerReport:
    if len(lags_s) == 0:
        return PacerReport(0, 0.0, 0.0, 0.0, 0.0, late_ms)
    ms = lags_s * 1e3
    rep = PacerReport(
        released=len(ms),
        lag_p50_ms=float(np.percentile(ms, 50)),
        lag_p99_ms=float(np.percentile(ms, 99)),
        lag_max_ms=float(ms.max()),
        late_share=float((ms > late_ms).mean()),
        late_ms=late_ms,
    )
    if (msg := rep.warning()) is not None:
        log.warning(msg)
    return rep
