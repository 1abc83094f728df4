"""Per-connection message cap: a token bucket holding one second's worth of messages."""

from __future__ import annotations

import time
from collections.abc import Callable


class RateCap:
    def __init__(self, per_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if per_s <= 0:
            raise ValueError("per_s must be > 0")
        self.per_s = per_s
        self.burst = max(1.0, per_s)
        self._tokens = self.burst
        self._clock = clock
        self._last = clock()
        self.refused_in_a_row = 0

    def allow(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            self.refused_in_a_row = 0
            return True
        self.refused_in_a_row += 1
        return False
