"""Refusing excess load in front of the handlers, where a refusal is cheap (heavy overload).

    gRPC unary calls     gRPC's C core refuses calls past `transport_backlog` waiting for the event
                         loop (grpc_server.backlog_options): no Python runs; the loop's own first
                         step is `Gate.refusal`, before the request is parsed
    Stream messages      `Gate.refusal` and the in-flight cap, before a message is decoded
    HTTP requests        `HttpGate`, ASGI middleware: 429 + Retry-After before routing or reading the body

`Gate.refusal` says no while the default model's admission control is shedding (its queue has stood
over the budget, see sidecar.admission) and the queue is still over the budget now: the request
would be refused there anyway, after parsing, authentication, the cache and tokenizing had been paid
for. Below capacity admission never sheds, so nothing changes there. The in-flight cap bounds the
requests in progress (queued or running) whatever they are: past it, a new one would only wait.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from inference.errors import Overloaded
from sidecar.admission import Admission
from sidecar.metrics import Metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


class Gate:
    """What the sidecar knows before it reads a request: whether to refuse it at once."""

    def __init__(self, admission: Callable[[], Admission], metrics: Metrics, max_in_flight: int) -> None:
        self._admission = admission  # the default model's, looked up per call: a rollout replaces it
        self.max_in_flight = max(1, max_in_flight)
        self.in_flight = 0
        self._shed = metrics.rejections.labels("shed")

    def refusal(self) -> Overloaded | None:
        """The error to answer at once, or None to go on."""
        a = self._admission()
        if a.shedding:
            drain = a.drain_s()
            if drain > a.budget_s:
                self._shed.inc()
                return Overloaded(f"overloaded: queue drains in about {drain * 1e3:.1f} ms, over the "
                                  f"{a.budget_s * 1e3:.1f} ms queueing budget", retry_after_s=drain - a.budget_s)
        if self.in_flight >= self.max_in_flight:
            self._shed.inc()
            return Overloaded(f"{self.in_flight} requests in progress (cap {self.max_in_flight})",
                              retry_after_s=a.drain_s())
        return None

    def enter(self) -> Overloaded | None:
        """`refusal`, or count one more request in progress (then `leave` once it is answered)."""
        refused = self.refusal()
        if refused is None:
            self.in_flight += 1
        return refused

    def leave(self) -> None:
        self.in_flight -= 1


class HttpGate:
    """ASGI middleware: POSTs (the embedding and search routes) pass `Gate.enter` first; a refusal is
    a 429 with Retry-After written here, before FastAPI routes the request or reads its body."""

    def __init__(self, app: Asgi, gate: Gate, error: Callable[[Overloaded], tuple[int, dict[str, str], bytes]]
                 ) -> None:
        self.app = app
        self.gate = gate
        self._error = error  # status, headers, body: the facade's own error shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)  # health, metrics, model list: never shed
            return
        refused = self.gate.enter()
        if refused is not None:
            status, headers, body = self._error(refused)
            raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.leave()
