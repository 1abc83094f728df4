"""Admission control: say no early instead of queueing work that cannot meet its deadline.

A backend call costs about `s_per_call + s_per_token * B * L` (B x L padded tokens): the fixed
part is measured at start-up, the per-token part is an exponential moving average over finished
calls. Outstanding work (queued + running) priced that way estimates the drain time. A
request is rejected when it cannot finish before its deadline, when the queue is full, or, under
overload, when it would wait behind more than the queueing budget; a request whose deadline
already passed never reaches the backend.

Overload is a *standing* queue, told apart from a burst by a moving average of the queue's drain
time over the last ~100 admissions (about a second at the SLA rate): the budget is enforced once
that average exceeds the budget, and until it falls below half of it. A burst or a pause at normal
traffic (a GC, a slow call, a whole micro-batch released at once, a 50-100 ms stall of a shared
VM) barely moves the average, so rates below capacity see no rejections (a window of ~20 shed
requests at 100-125 req/s on such stalls: docs/benchmarks.md, admission); under sustained overload the
queue is held near the budget, accepted latency stays near the SLA, and the excess is refused at
once instead of expiring after it waited. The budget bounds the wait, not the request's own cost: a
big batch on an idle backend still runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from inference.errors import DeadlineExceeded, Overloaded


@dataclass(slots=True)
class Ticket:
    items: int
    tokens: int


class Admission:
    def __init__(self, *, max_outstanding_items: int, s_per_token: float = 1e-4, s_per_call: float = 0.0,
                 alpha: float = 0.2, budget_s: float = 0.0, standing_alpha: float = 0.01, lanes: int = 1) -> None:
        self.max_outstanding_items = max_outstanding_items
        self.lanes = max(1, lanes)  # backend calls that run at once: outstanding work drains that much faster
        self.budget_s = budget_s  # most queued work (drain time) to wait behind; 0 = the deadline only
        self.standing_alpha = standing_alpha  # weight of one admission in the standing-queue average
        self.standing_s = 0.0  # moving average of the drain time seen by admissions
        self.shedding = False  # overload seen: enforcing the budget until the queue is short again
        self.s_per_token = s_per_token
        self.s_per_call = s_per_call
        self.alpha = alpha
        self.outstanding_items = 0
        self.outstanding_tokens = 0

    def calibrate(self, small: tuple[int, float], large: tuple[int, float]) -> None:
        """Fit the fixed and per-token cost from two timed calls: (padded tokens, seconds) each."""
        (t1, s1), (t2, s2) = small, large
        per_token = (s2 - s1) / (t2 - t1) if t2 > t1 else s2 / max(t2, 1)
        self.s_per_token = max(per_token, 1e-7)
        self.s_per_call = max(s1 - self.s_per_token * t1, 0.0)

    def observe(self, tokens: int, elapsed_s: float) -> None:
        """One finished backend call of `tokens` padded tokens took `elapsed_s`."""
        if tokens > 0 and elapsed_s > 0:
            sample = max(elapsed_s - self.s_per_call, 0.0) / tokens
            self.s_per_token += self.alpha * (sample - self.s_per_token)

    def cost_s(self, tokens: int) -> float:
        return self.s_per_call + tokens * self.s_per_token

    def drain_s(self) -> float:
        serial = self.outstanding_tokens * self.s_per_token + (self.s_per_call if self.outstanding_tokens else 0.0)
        return serial / self.lanes

    def admit(self, items: int, tokens: int, deadline: float | None, *, now: float | None = None) -> Ticket:
        """Reserve room for `items` texts of `tokens` padded tokens, or raise.

        `deadline` is on the time.monotonic() clock (None = no deadline).
        """
        own = self.cost_s(tokens)
        drain = self.drain_s()
        t = time.monotonic() if now is None else now
        if deadline is not None:
            left = deadline - t
            if left <= 0:
                raise DeadlineExceeded("deadline expired before inference")
            if own > left:
                raise DeadlineExceeded(f"deadline leaves {left * 1e3:.2f} ms, inference needs about "
                                       f"{own * 1e3:.2f} ms")
            if drain + own > left:
                raise Overloaded(f"queue drains in about {drain * 1e3:.1f} ms, after this request's deadline",
                                 retry_after_s=drain)
        # The wait allowed is the budget, or one call of this request's own size where that is longer
        # (a slow backend at low traffic is not overload: one request may always wait for another).
        limit = max(self.budget_s, own)
        if self.budget_s and self._overloaded(drain, limit):
            raise Overloaded(f"overloaded: queue drains in about {drain * 1e3:.1f} ms, over the {limit * 1e3:.1f} ms "
                             "queueing budget", retry_after_s=drain - limit)
        if self.outstanding_items and self.outstanding_items + items > self.max_outstanding_items:
            raise Overloaded(f"{self.outstanding_items} texts already queued (cap {self.max_outstanding_items})",
                             retry_after_s=drain)
        self.outstanding_items += items
        self.outstanding_tokens += tokens
        return Ticket(items, tokens)

    def _overloaded(self, drain: float, limit: float) -> bool:
        """Whether this wait of `drain` is refused: over `limit` while the queue stands over budget."""
        self.standing_s += self.standing_alpha * (drain - self.standing_s)
        if self.standing_s > self.budget_s:
            self.shedding = True
        elif self.standing_s < self.budget_s / 2:
            self.shedding = False  # the backend caught up
        return self.shedding and drain > limit

    def release(self, ticket: Ticket) -> None:
        self.outstanding_items -= ticket.items
        self.outstanding_tokens -= ticket.tokens
        ticket.items = ticket.tokens = 0  # releasing twice is harmless
