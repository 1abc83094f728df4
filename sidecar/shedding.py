"""Refusing excess load in front of the handlers, where a refusal is cheap (heavy overload).

    gRPC unary calls     gRPC's C core refuses calls past `transport_backlog` waiting for the event
                         loop (grpc_server.backlog_options): no Python runs; the loop's own first
                         step is `Gate.refusal`, before the request is parsed
    Stream messages      `Gate.refusal` and the in-flight cap, before a message is decoded
    HTTP requests        `HttpGate`, ASGI middleware: 429 + Retry-After, then the key (401), both before
                         the body is read; counted in flight only once the body has arrived

`Gate.refusal` says no while the default model's admission control is shedding (its queue has stood
over the budget, see sidecar.admission) and the queue is still over the budget now: the request
would be refused there anyway, after parsing, authentication, the cache and tokenizing had been paid
for. Below capacity admission never sheds, so nothing changes there. The in-flight cap bounds the
requests in progress (queued or running) whatever they are: past it, a new one would only wait.

gRPC and HTTP share that cap, each through its own `Gate` (`Gate.front`), and each front may hold at
most FRONT_SHARE of it: whatever one front's callers do (a Stream firehose, a swarm of slow HTTP
bodies), the other keeps at least the rest, while either alone may still use most of the capacity.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from inference.errors import EmbedcarError, Overloaded, PayloadTooLarge, RequestTimeout
from sidecar.admission import Admission
from sidecar.auth import for_http
from sidecar.metrics import Metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

# A quarter of the in-flight cap always left to the other front (module docstring).
FRONT_SHARE = 0.75


class _Budget:
    """The sidecar's in-flight cap, shared by its fronts' gates."""

    __slots__ = ("cap", "in_flight")

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        self.in_flight = 0


class Gate:
    """What the sidecar knows before it reads a request: whether to refuse it at once. One per front;
    `share` of the in-flight cap is the most this front may hold (`max_in_flight`)."""

    def __init__(self, admission: Callable[[], Admission], metrics: Metrics, max_in_flight: int, *,
                 share: float = 1.0, _budget: _Budget | None = None) -> None:
        self._admission = admission  # the default model's, looked up per call: a rollout replaces it
        self._metrics = metrics
        self._budget = _budget if _budget is not None else _Budget(max_in_flight)
        self.max_in_flight = max(1, math.ceil(self._budget.cap * share))
        self.in_flight = 0  # this front's
        self._shed = metrics.rejections.labels("shed")

    def front(self, share: float) -> Gate:
        """Another front's gate on the same in-flight cap."""
        return Gate(self._admission, self._metrics, self._budget.cap, share=share, _budget=self._budget)

    def refusal(self) -> Overloaded | None:
        """The error to answer at once, or None to go on."""
        a = self._admission()
        if a.shedding:
            drain = a.drain_s()
            if drain > a.budget_s:
                self._shed.inc()
                return Overloaded(f"overloaded: queue drains in about {drain * 1e3:.1f} ms, over the "
                                  f"{a.budget_s * 1e3:.1f} ms queueing budget", retry_after_s=drain - a.budget_s)
        budget = self._budget
        if self.in_flight >= self.max_in_flight or budget.in_flight >= budget.cap:
            self._shed.inc()
            mine = "" if self.max_in_flight == budget.cap else \
                f", {self.in_flight} on this front (its cap {self.max_in_flight})"
            return Overloaded(f"{budget.in_flight} requests in progress (cap {budget.cap}{mine})",
                              retry_after_s=a.drain_s())
        return None

    def enter(self) -> Overloaded | None:
        """`refusal`, or count one more request in progress (then `leave` once it is answered)."""
        refused = self.refusal()
        if refused is None:
            self.in_flight += 1
            self._budget.in_flight += 1
        return refused

    def leave(self) -> None:
        self.in_flight -= 1
        self._budget.in_flight -= 1


class _Gone(Exception):
    """The caller left before its body arrived: nobody to answer."""


class HttpGate:
    """ASGI middleware in front of the POST routes (embeddings, search), cheapest step first:

    1. `Gate.refusal` under overload: 429 + Retry-After;
    2. `check`, the caller's key from the headers: 401 (a missing key's message names the HTTP headers);
    3. the body, whole within `body_timeout_s` and `max_body_bytes`: 408 / 413;
    4. `Gate.enter`: counted in progress only now, so a caller slow to send its body holds no place;
       out again once its reply starts, so neither does one slow to read it.

    A refusal before the body closes the connection (the body is never read); the route gets the
    body from memory. GETs (health, metrics, model list) pass straight through: never shed."""

    def __init__(self, app: Asgi, gate: Gate | None, *, check: Callable[[Scope], EmbedcarError | None],
                 max_body_bytes: int, body_timeout_s: float,
                 error: Callable[[Scope, EmbedcarError], tuple[int, dict[str, str], bytes]]) -> None:
        self.app = app
        self.gate = gate
        self._check = check
        self._max_body = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._error = error  # status, headers, body: the facade's own error shape (and its metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        gate = self.gate
        refused = (gate.refusal() if gate is not None else None) or self._keyless(scope)
        if refused is None:
            try:
                body = await self._body(scope, receive)
            except EmbedcarError as exc:
                refused = exc
            except _Gone:
                return
        if refused is not None:
            await self._reply(scope, send, refused, close=True)
            return
        refused = gate.enter() if gate is not None else None
        if refused is not None:
            await self._reply(scope, send, refused, close=False)
            return
        sent = False
        held = gate  # until the reply starts

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()  # after the body only a disconnect comes
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def reply(message: Message) -> None:
            # Answered: out of the count now, not once the client has read the reply (one that never reads
            # holds its connection until the write timeout, not a place among those in progress).
            nonlocal held
            if held is not None and message["type"] == "http.response.start":
                held.leave()
                held = None
            await send(message)

        try:
            await self.app(scope, replay, reply)
        finally:
            if held is not None:
                held.leave()

    def _keyless(self, scope: Scope) -> EmbedcarError | None:
        """`check`'s refusal in HTTP's words: a missing key names the headers that carry one, not gRPC's
        metadata (sidecar.auth.for_http)."""
        refused = self._check(scope)
        return None if refused is None else for_http(refused)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        declared = _header(scope, b"content-length")
        # isascii: str.isdigit() is also true of "²", which int() refuses.
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > self._max_body:
            raise PayloadTooLarge(f"request body of {declared} bytes is over the limit of {self._max_body}")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self._body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Gone
                    chunk: bytes = message.get("body", b"")
                    size += len(chunk)
                    if size > self._max_body:
                        raise PayloadTooLarge(f"request body is over the limit of {self._max_body} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError as exc:
            raise RequestTimeout(f"request body not complete within {self._body_timeout_s:g} s "
                                 f"({size} bytes came)") from exc

    async def _reply(self, scope: Scope, send: Send, exc: EmbedcarError, *, close: bool) -> None:
        status, headers, body = self._error(scope, exc)
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append((b"content-length", str(len(body)).encode()))
        if close and _header(scope, b"content-length") != "0":  # a body may still come: never read it
            raw.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None
