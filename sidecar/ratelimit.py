"""Token bucket per tenant: `rate` requests/s refill, `burst` deep; empty -> Overloaded + retry hint."""

from __future__ import annotations

import time

from inference.errors import Overloaded


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate = float(rate_per_s)
        self.burst = float(max(burst, 1))
        self._buckets: dict[str, list[float]] = {}  # tenant -> [tokens, last refill]

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, tenant: str, cost: float = 1.0, *, now: float | None = None) -> None:
        if not self.enabled:
            return
        t = time.monotonic() if now is None else now
        b = self._buckets.get(tenant)
        if b is None:
            b = self._buckets[tenant] = [self.burst, t]
        tokens = min(self.burst, b[0] + (t - b[1]) * self.rate)
        b[1] = t
        if tokens + 1e-9 < cost:  # float refill sums land a hair short
            b[0] = tokens
            raise Overloaded(f"rate limit of {self.rate:g} requests/s for tenant {tenant!r} reached",
                             retry_after_s=(cost - tokens) / self.rate)
        b[0] = tokens - cost
