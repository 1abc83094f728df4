"""Open-loop schedules: arrival times, and the pacer keeping them on a shared machine."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable

import numpy as np
import pytest

from inference.errors import InvalidInput
from loadtest.schedule import arrival_offsets, pace, pacer_report


def test_constant_arrivals_are_evenly_spaced() -> None:
    t = arrival_offsets(100, 3)
    assert len(t) == 300
    assert t[0] == 0.0
    assert np.allclose(np.diff(t), 0.01)


def test_poisson_arrivals_are_seeded_sorted_and_inside_the_window() -> None:
    a = arrival_offsets(200, 10, arrivals="poisson", seed=3)
    b = arrival_offsets(200, 10, arrivals="poisson", seed=3)
    c = arrival_offsets(200, 10, arrivals="poisson", seed=4)
    assert np.array_equal(a, b)
    assert not np.array_equal(a[:50], c[:50])
    assert np.all(np.diff(a) >= 0) and a[-1] < 10
    # 2000 expected arrivals: within 5 standard deviations (~224) for this fixed seed.
    assert abs(len(a) - 2000) < 224
    # Exponential gaps: coefficient of variation ~1 (constant arrivals would give 0).
    gaps = np.diff(a)
    assert 0.8 < gaps.std() / gaps.mean() < 1.2


@pytest.mark.parametrize(("rate", "duration", "arrivals"), [(0, 1, "constant"), (10, 0, "constant"),
                                                           (10, 1, "bursty")])
def test_bad_schedules_are_invalid_input(rate: float, duration: float, arrivals: str) -> None:
    with pytest.raises(InvalidInput):
        arrival_offsets(rate, duration, arrivals=arrivals)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: waiting for a timer takes no real time, every loop
    iteration costs `tick` seconds. What the pacer does is then exact, on any machine."""

    def __init__(self, tick: float = 1e-6) -> None:
        self.now = 1000.0
        self.tick = tick
        loop = self

        class Selector(selectors.DefaultSelector):
            def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
                events: list[tuple[selectors.SelectorKey, int]] = super().select(0)
                loop.now += timeout if timeout else loop.tick  # jump to the next timer
                return events

        super().__init__(Selector())

    def time(self) -> float:
        return self.now


def _pace_on_virtual_clock(offsets: np.ndarray, on_release: Callable[[VirtualClockLoop, int], None] | None = None
                           ) -> tuple[list[tuple[int, float, float]], np.ndarray, float]:
    loop = VirtualClockLoop()
    released: list[tuple[int, float, float]] = []

    def release(i: int, due: float) -> None:
        released.append((i, due, loop.time()))
        if on_release is not None:
            on_release(loop, i)

    try:
        start = loop.time() + 0.01
        lags = loop.run_until_complete(pace(offsets, release, start=start, clock=loop.time))
    finally:
        loop.close()
    return released, lags, start


def test_pacer_releases_every_request_on_time_never_early() -> None:
    offsets = arrival_offsets(50, 1.0)
    released, lags, start = _pace_on_virtual_clock(offsets)
    assert [i for i, _, _ in released] == list(range(len(offsets)))
    dues = np.array([d for _, d, _ in released])
    actual = np.array([a for _, _, a in released])
    assert np.allclose(dues, start + offsets)
    assert np.all(actual >= dues)  # never sent before its time
    assert np.all(actual - dues < 1e-4)  # and on time: a few loop iterations, not a timer's slack
    assert len(lags) == len(offsets) and np.allclose(lags, actual - dues)


def test_pacer_behind_schedule_releases_at_once_in_order_then_catches_up() -> None:
    # Release 10 blocks the generator for 250 ms (a starved process): the 12 requests due meanwhile
    # go out at once, in order, each with its lag; the ones after are on time again.
    offsets = arrival_offsets(50, 1.0)

    def block(loop: VirtualClockLoop, i: int) -> None:
        if i == 10:
            loop.now += 0.25

    released, lags, start = _pace_on_virtual_clock(offsets, block)
    assert [i for i, _, _ in released] == list(range(len(offsets)))
    resumed = start + offsets[10] + 0.25
    want = np.maximum(resumed - (start + offsets), 0.0)
    want[:11] = 0.0
    assert np.allclose(lags, want, atol=1e-4)
    assert np.count_nonzero(lags > 1e-3) == 12  # requests 11..22
    rep = pacer_report(lags)
    assert not rep.kept and rep.lag_max_ms == pytest.approx(230.0, abs=0.1)


def test_pacer_report_warns_only_when_the_schedule_slipped() -> None:
    on_time = pacer_report(np.full(1000, 0.0002))
    assert on_time.kept and on_time.warning() is None
    late = np.zeros(1000)
    late[::10] = 0.030  # 10% of releases 30 ms late
    rep = pacer_report(late, late_ms=5.0)
    assert not rep.kept
    assert rep.late_share == pytest.approx(0.1)
    assert rep.lag_max_ms == pytest.approx(30.0)
    assert "fell behind" in (rep.warning() or "")
