"""A request, whichever transport brought it: the gate, parsing, the service, the reply or its error.

Every request takes one path: gate -> key -> parse -> `Requests.admit` (the rate limit, the model: one
`Call`) -> `Requests.embed` / `Requests.search` (the service, counted) -> reply. The gRPC server
(`sidecar.grpc_server`) hands this module an Embedder request's bytes and writes back what it
returns; the HTTP facade (`sidecar.http_api`) checks the key in its middleware, parses its JSON, and
calls the same `admit`, `embed` / `search` and `failure`. So each of these is written once here:

    `failure`        a failed request's error, counted; a bug's traceback logged (INTERNAL to its caller)
    `Requests`       the path above; for gRPC from the request's bytes to the reply's
    `StreamSession`  one Stream call: the key checked once as it opens, each message gated, answered by
                     its own task, an error as its reply

Requests are parsed here rather than by grpc so that undecodable bytes, invalid UTF-8 and unknown
fields become INVALID_ARGUMENT with a message instead of a generic failure. What a failure answers on
each transport comes from one function (`sidecar.errors.status`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from catalog.filters import merged
from embedcar_client.proto import embedcar_pb2 as pb
from inference.errors import EmbedcarError, Internal, InvalidInput, Overloaded
from sidecar.errors import status
from sidecar.metrics import Metrics
from sidecar.service import Call, EmbedOutcome, EmbedService, SearchOutcome
from sidecar.shedding import Gate

log = logging.getLogger(__name__)

_F16 = "<f2"
_F32 = "<f4"


def failure(metrics: Metrics, rpc: str, exc: BaseException) -> EmbedcarError:
    """The error a failed request answers, counted (embedcar_requests): a project error as it is; anything
    else is a bug: INTERNAL to its caller, and its traceback logged here, once, whatever the transport."""
    if not isinstance(exc, EmbedcarError):
        log.error("%s failed", rpc, exc_info=exc)
        exc = Internal(f"unexpected error: {type(exc).__name__}")
    metrics.requests.labels(rpc, exc.code).inc()
    return exc


@dataclass(frozen=True, slots=True)
class SearchArgs:
    """A Search request's arguments beside its texts, from either transport."""

    k: int
    filters: dict[str, str]
    mode: str

    @classmethod
    def of(cls, req: pb.SearchRequest) -> SearchArgs:
        try:  # proto3 enums are open: an unknown number parses, and is refused here
            mode = pb.SearchMode.Name(req.mode)
        except ValueError:
            raise InvalidInput(f"unknown search mode {req.mode}") from None
        return cls(req.k, merged(dict(req.filters), department=req.department, aisle=req.aisle), mode)


@dataclass(slots=True)
class Parsed:
    """A request decoded, and once `call` is set, admitted by the service (its key, rate limit, model)."""

    rpc: str  # "embed" | "search"
    request: Any  # pb.EmbedRequest | pb.SearchRequest
    deadline: float | None
    call: Call | None = None
    id: int = 0  # a Stream message's


def _decode(cls: type[Any], raw: bytes) -> Any:
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"request is not a valid {cls.DESCRIPTOR.full_name} (bad bytes or invalid UTF-8)") from exc


def _known_fields(msg: Any) -> Any:
    # Sizes compared, not the unknown fields listed: UnknownFieldSet makes a Python object per field (~2 s
    # on the event loop for 4 MB of 2-byte fields); a copy without them is one pass in C (~10 ms).
    known = type(msg)()
    known.CopyFrom(msg)
    known.DiscardUnknownFields()
    if known.ByteSize() != msg.ByteSize():
        raise InvalidInput(f"request has fields unknown to {msg.DESCRIPTOR.full_name}: wrong proto version?")
    return msg


def decode(cls: type[Any], raw: bytes, *, strict: bool = True) -> Any:
    """`raw` as a `cls` message, or InvalidInput (bad bytes, invalid UTF-8; `strict`: unknown fields)."""
    msg = _decode(cls, raw)
    return _known_fields(msg) if strict else msg


def _stream_id(raw: bytes) -> int:
    """A Stream request's id, read without checking the rest (0 where it cannot be read)."""
    try:
        return int(pb.StreamRequest.FromString(raw).id)
    except DecodeError:
        return 0


def _stream_message(raw: bytes, arrived: float, stream_deadline: float | None) -> Parsed:
    """A Stream message, parsed (its deadline its own timeout, else the stream's). Raises InvalidInput (its
    reply echoes the id where it can be read: `_stream_id`)."""
    msg: pb.StreamRequest = _decode(pb.StreamRequest, raw)
    kind = msg.WhichOneof("call")
    _known_fields(msg)
    if kind is None:
        raise InvalidInput("stream request carries neither embed nor search")
    inner = _known_fields(getattr(msg, kind))
    deadline = arrived + msg.timeout_ms / 1000 if msg.timeout_ms else stream_deadline
    return Parsed(kind, inner, deadline, id=msg.id)


def _embed_reply(req: pb.EmbedRequest, out: EmbedOutcome) -> pb.EmbedReply:
    emb = out.embeddings
    if req.float16:
        data, dtype = emb.astype(_F16).tobytes(), pb.FLOAT16
    else:
        data, dtype = emb.astype(_F32, copy=False).tobytes(), pb.FLOAT32
    return pb.EmbedReply(embeddings=data, rows=emb.shape[0], dim=emb.shape[1], dtype=dtype,
                         model=out.model, cache_hits=out.cache_hits, truncated=out.truncated,
                         timings=pb.Timings(**out.timings_ns), backend=out.backend)


class Requests:
    """The Embedder's Embed and Search, as their proto's bytes in and a reply's bytes out. Raises
    EmbedcarError (count it: `failure`)."""

    def __init__(self, service: EmbedService, metrics: Metrics, gate: Gate | None = None) -> None:
        self.service = service
        self.metrics = metrics
        self.gate = gate  # refuses at once under overload, before a request is parsed (sidecar.shedding)
        # Label lookups cost ~15 µs each: bind the hot ones once.
        self._ok = {rpc: metrics.requests.labels(rpc, "ok") for rpc in ("embed", "search", "http_embed", "http_search")}

    def failure(self, rpc: str, exc: BaseException) -> EmbedcarError:
        return failure(self.metrics, rpc, exc)

    def refusal(self) -> Overloaded | None:
        return self.gate.refusal() if self.gate is not None else None

    async def answer(self, rpc: str, raw: bytes, key: str | None, deadline: float | None) -> bytes:
        """A unary call's reply (rpc "embed" or "search"). The caller's key is checked before a byte of its
        request is decoded: an unauthenticated caller costs a digest, never a parse."""
        refused = self.refusal()  # the cheapest refusal under overload comes first
        if refused is not None:
            raise refused
        t0 = time.perf_counter_ns()
        tenant = self.service.caller(key)
        request = decode(pb.EmbedRequest if rpc == "embed" else pb.SearchRequest, raw)
        call = self.admit(tenant, request.model or None, deadline, t0)
        return bytes((await self.finish(Parsed(rpc, request, deadline, call))).SerializeToString())

    def admit(self, tenant: str | None, model: str | None, deadline: float | None = None,
              t0: int | None = None) -> Call:
        """A request of `tenant` (its key checked) admitted: its rate-limit token, its model (EmbedService.call)."""
        return self.service.call(tenant, model=model, deadline=deadline, t0=t0)

    async def embed(self, rpc: str, call: Call, texts: Sequence[object]) -> EmbedOutcome:
        """Embed for an admitted request of either transport, counted under `rpc` when answered."""
        out = await self.service.embed(call, texts)
        self._ok[rpc].inc()
        return out

    async def search(self, rpc: str, call: Call, texts: Sequence[object], args: SearchArgs) -> SearchOutcome:
        """Search for an admitted request of either transport, counted under `rpc` when answered."""
        out = await self.service.search(call, texts, k=args.k, filters=args.filters, mode=args.mode)
        self._ok[rpc].inc()
        return out

    async def finish(self, parsed: Parsed) -> pb.EmbedReply | pb.SearchReply:
        """The reply message of an admitted gRPC request; counts it."""
        assert parsed.call is not None
        if parsed.rpc == "embed":
            return _embed_reply(parsed.request, await self.embed("embed", parsed.call, parsed.request.texts))
        req: pb.SearchRequest = parsed.request
        found = await self.search("search", parsed.call, req.texts, SearchArgs.of(req))
        return pb.SearchReply(
            results=[pb.HitList(hits=[pb.Hit(id=h.id, score=h.score, fields=h.fields, legs=h.legs, matched=h.matched)
                                      for h in hits]) for hits in found.hits],
            model=found.model, index_version=found.index_version, cache_hits=found.cache_hits,
            timings=pb.Timings(**found.timings_ns), backend=found.backend)


Write = Callable[[bytes], Awaitable[None] | None]
CreateTask = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class StreamSession:
    """One Stream call. The caller's key is checked once, as it opens (Unauthenticated:
    the stream ends); each message then takes its own rate-limit token (EmbedService.call). Each message
    passes the gate (`enter`: counted in progress until answered) and is answered by its own task (`spawn`),
    so requests in flight on one stream batch together as separate calls would; an error is that
    message's reply."""

    def __init__(self, requests: Requests, key: str | None, deadline: float | None) -> None:
        try:
            self.tenant = requests.service.keys.tenant_for(key)
        except EmbedcarError as exc:
            raise requests.failure("stream", exc) from None
        self._requests = requests
        self.deadline = deadline
        self.tasks: set[asyncio.Task[None]] = set()
        self.cancelled = False

    def enter(self, raw: bytes) -> bytes | None:
        """A message's refusal reply under overload (counted), or None: it is in progress until answered."""
        gate = self._requests.gate
        refused = gate.enter() if gate is not None else None
        return None if refused is None else self._error_reply(_stream_id(raw), "stream", refused)

    def leave(self) -> None:
        if self._requests.gate is not None:
            self._requests.gate.leave()

    def spawn(self, message: bytes, write: Write, create: CreateTask) -> None:
        """On the loop, after `enter`: a task (made by `create`) answering `message` and writing its reply;
        the gate is left once it is answered, or cancelled before it ran. Nothing where the caller has left."""
        if self.cancelled:
            self.leave()
            return
        left = _Once(self.leave)
        task = create(self._answer(message, write, left))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(left.callback)  # a callback too: a task cancelled before it ran leaves as well

    def cancel(self) -> None:
        """The caller left: its messages' tasks are cancelled (on the loop)."""
        self.cancelled = True
        for task in self.tasks:
            task.cancel()

    async def _answer(self, message: bytes, write: Write, left: _Once) -> None:
        try:
            reply = await self.reply(message)
        finally:
            left()  # answered: its write waits on the caller, not on the model's capacity
        written = write(reply)
        if written is not None:
            await written

    async def reply(self, message: bytes) -> bytes:
        """A message's reply (an error is its reply)."""
        rid, rpc = 0, "stream"
        try:
            parsed = _stream_message(message, time.monotonic(), self.deadline)
            rid, rpc = parsed.id, parsed.rpc
            parsed.call = self._call(parsed)
            answered: Any = await self._requests.finish(parsed)
            reply = pb.StreamReply(id=rid, **{rpc: answered})
        except Exception as exc:
            return self._failed(message, rid, rpc, exc)
        return bytes(reply.SerializeToString())

    def _call(self, parsed: Parsed) -> Call:
        return self._requests.admit(self.tenant, parsed.request.model or None, parsed.deadline)

    def _failed(self, message: bytes, rid: int, rpc: str, exc: Exception) -> bytes:
        """A message's error reply (counted): the id echoed where it was read (or can be)."""
        if not rid and isinstance(exc, EmbedcarError):
            rid = _stream_id(message)
        return self._error_reply(rid, rpc, exc)

    def _error_reply(self, rid: int, rpc: str, exc: BaseException) -> bytes:
        err = status(self._requests.failure(rpc, exc))
        error = pb.StreamError(code=err.grpc.value[0], message=err.message, retry_after_s=err.retry_after_s or 0.0)
        return bytes(pb.StreamReply(id=rid, error=error).SerializeToString())


class _Once:
    """`fn` called once, however many times this is."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()

    def callback(self, _task: object) -> None:
        self()
