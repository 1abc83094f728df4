"""gRPC layer: bytes <-> messages, metadata -> api key and deadline, project errors -> status codes.

Requests are parsed here rather than by grpc so that undecodable bytes, invalid UTF-8 and unknown
fields become INVALID_ARGUMENT with a message instead of a generic failure.

With API keys set, every method needs the `x-api-key` metadata except the health service (probes
carry no key): Embed and Search check it in the service (per tenant, with its rate limit; Stream
once when it opens and again per request),
`KeyInterceptor` checks it for the rest (server reflection, and whatever is added later).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2

from inference.errors import EmbedcarError, Internal, InvalidInput, Unauthenticated
from sidecar.auth import KeyRing
from sidecar.errors import grpc_code
from sidecar.metrics import Metrics
from sidecar.proto import embedcar_pb2 as pb
from sidecar.service import EmbedOutcome, EmbedService
from sidecar.settings import SidecarSettings
from sidecar.shedding import Gate
from sidecar.tls import ServerTls
from sidecar.unix_socket import UnixSocket, bind_unix_socket, prepare_unix_socket
from sidecar.wire import API_KEY, RETRY_AFTER_KEY, SERVICE

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVED = (SERVICE, HEALTH, reflection.SERVICE_NAME)  # what reflection lists
_F16 = "<f2"
_F32 = "<f4"


def _parse(cls: type[Any], raw: bytes) -> Any:
    return _known_fields(_decode(cls, raw))


def _decode(cls: type[Any], raw: bytes) -> Any:
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"request is not a valid {cls.DESCRIPTOR.full_name} (bad bytes or invalid UTF-8)") from exc


def _known_fields(msg: Any) -> Any:
    if len(unknown_fields.UnknownFieldSet(msg)):
        raise InvalidInput(f"request has fields unknown to {msg.DESCRIPTOR.full_name}: wrong proto version?")
    return msg


def _stream_id(raw: bytes) -> int:
    """A Stream request's id, read without checking the rest (0 where it cannot be read)."""
    try:
        return int(pb.StreamRequest.FromString(raw).id)
    except DecodeError:
        return 0


def _stream_message(raw: bytes, arrived: float, stream_deadline: float | None) -> tuple[int, str, Any, float | None]:
    """A Stream message's id, kind ("embed" or "search"), inner request and deadline. Raises InvalidInput
    (its reply echoes the id where it can be read: `_stream_id`)."""
    msg: pb.StreamRequest = _decode(pb.StreamRequest, raw)
    kind = msg.WhichOneof("call")
    _known_fields(msg)
    if kind is None:
        raise InvalidInput("stream request carries neither embed nor search")
    inner = _known_fields(getattr(msg, kind))
    return msg.id, kind, inner, arrived + msg.timeout_ms / 1000 if msg.timeout_ms else stream_deadline


def _key_in(metadata: Any) -> str | None:
    for item in metadata or ():
        if item[0] == API_KEY:
            value = item[1]
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return None


def _api_key(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    return _key_in(context.invocation_metadata())


class KeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # untyped in the stubs
    """UNAUTHENTICATED for any method but health and the Embedder's own without a valid key."""

    OPEN = ("/grpc.health.v1.Health/", f"/{SERVICE}/")  # the Embedder authenticates in the service

    def __init__(self, keys: KeyRing) -> None:
        self._keys = keys

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        method: str = details.method or ""
        if not method.startswith(self.OPEN):
            try:
                self._keys.tenant_for(_key_in(details.invocation_metadata))
            except Unauthenticated as exc:
                return _deny(exc.message)
        return await continuation(details)


def _deny(message: str) -> grpc.RpcMethodHandler[Any, Any]:
    async def abort(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        # stream-stream, so nothing is read first: fits a call of any cardinality.
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_stream_rpc_method_handler(abort)


def _deadline(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


class Reflection:
    """Server reflection one request at a time, for the compiled front (grpc_reflection's own servicer;
    grpc.aio serves it whole): a request's reply, or InvalidInput for bytes that are no request."""

    METHOD = f"/{reflection.SERVICE_NAME}/ServerReflectionInfo"

    def __init__(self) -> None:
        self._servicer = reflection.ReflectionServicer(SERVED)

    def answer(self, raw: bytes) -> bytes:
        request = _decode(reflection_pb2.ServerReflectionRequest, raw)
        [reply] = self._servicer.ServerReflectionInfo(iter([request]), None)
        return bytes(reply.SerializeToString())


@dataclass(frozen=True, slots=True)
class FrontLimits:
    """What one gRPC server allows a caller (both servers: `server_options`; the compiled front also
    takes a memory quota, and stops reading a Stream `max_owed` replies ahead)."""

    options: tuple[tuple[str, int], ...]
    memory_bytes: int
    max_owed: int


def front_limits(settings: SidecarSettings) -> FrontLimits:
    """The limits of a production gRPC server, from settings: concurrent streams per connection, idle and
    maximum connection age, keepalive (the server pings a silent peer and drops a dead one; a client
    pinging more often than every 10 s without calls is told GOAWAY after two strikes), header size."""
    ms = 1000
    options = [
        ("grpc.max_concurrent_streams", settings.grpc_max_streams),
        ("grpc.keepalive_time_ms", 60 * ms),
        ("grpc.keepalive_timeout_ms", 20 * ms),
        ("grpc.http2.min_ping_interval_without_data_ms", 10 * ms),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_metadata_size", 16 * 1024),
    ]
    if settings.grpc_idle_s > 0:
        options.append(("grpc.max_connection_idle_ms", int(settings.grpc_idle_s * ms)))
    if settings.grpc_max_connection_age_s > 0:
        options += [("grpc.max_connection_age_ms", int(settings.grpc_max_connection_age_s * ms)),
                    ("grpc.max_connection_age_grace_ms", int(settings.grace_s * ms))]
    return FrontLimits(tuple(options), settings.grpc_memory_mb * 1024 * 1024, settings.stream_max_owed)


class EmbedderServicer:
    """Embed and Search as unary calls, and both over `Stream`: one handler per request kind, wrapped
    once for a unary call (an error ends the call with its status) and once for a stream message (an
    error is that request's reply)."""

    def __init__(self, service: EmbedService, metrics: Metrics, gate: Gate | None = None, *,
                 max_owed: int = 64) -> None:
        self.service = service
        self.metrics = metrics
        self.gate = gate  # refuses at once under overload, before a request is parsed (sidecar.shedding)
        self.max_owed = max_owed  # a Stream's replies in flight before it stops reading (sidecar.stream_max_owed)
        self.reflection = Reflection()
        # Label lookups cost ~15 µs each: bind the hot ones once.
        self._ok = {"embed": metrics.requests.labels("embed", "ok"), "search": metrics.requests.labels("search", "ok")}

    async def embed(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return await self._unary("embed", raw, context)

    async def search(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return await self._unary("search", raw, context)

    async def stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Each message becomes its own task, so requests in flight on one stream batch together as
        separate calls would; replies go out in the order they finish, one write at a time. The stream
        stops reading while `max_owed` replies are unanswered or unwritten (a caller that never reads)."""
        key = _api_key(context)
        try:
            self.service.keys.tenant_for(key)  # a wrong key ends the stream; each request is checked again
        except Unauthenticated as exc:
            await self._abort(context, "stream", exc)
        stream_deadline = _deadline(context)
        writing = asyncio.Lock()
        owed = asyncio.Semaphore(self.max_owed)

        gate = self.gate

        def leave(left: list[bool]) -> None:
            if gate is not None and not left[0]:
                left[0] = True
                gate.leave()

        def leaving(left: list[bool]) -> Callable[[asyncio.Task[None]], None]:
            return lambda _task: leave(left)

        async def answer(raw: bytes, left: list[bool]) -> None:
            try:
                reply = await self.stream_one(raw, key, stream_deadline)
            finally:
                leave(left)  # answered: its write waits on the caller, not on the model's capacity
            try:
                async with writing:
                    await context.write(reply.SerializeToString())
            finally:
                owed.release()

        async def refuse(raw: bytes, exc: EmbedcarError) -> None:
            reply = self.stream_refusal(raw, exc)
            async with writing:
                await context.write(reply)

        async with asyncio.TaskGroup() as tasks:  # the client leaving cancels what is still running
            async for raw in requests:
                await owed.acquire()
                refused = gate.enter() if gate is not None else None
                if refused is None:
                    left = [False]
                    task = tasks.create_task(answer(raw, left))
                    # also a callback: a task cancelled before it ran leaves the gate too
                    task.add_done_callback(leaving(left))
                else:
                    try:
                        await refuse(raw, refused)
                    finally:
                        owed.release()

    async def _unary(self, rpc: str, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        try:
            return await self.answer(rpc, raw, _api_key(context), _deadline(context))
        except EmbedcarError as exc:
            await self._abort(context, rpc, exc)
            raise  # unreachable: abort raises
        except Exception as exc:  # a bug: report it as INTERNAL, never crash the server
            await self._abort(context, rpc, Internal(f"unexpected error: {type(exc).__name__}"))
            raise

    async def answer(self, rpc: str, raw: bytes, key: str | None, deadline: float | None, *,
                     authenticated: bool = False) -> bytes:
        """A unary call's reply (rpc "embed" or "search"); raises EmbedcarError (count it: `count_error`).
        Refused at once under overload, before the request is parsed."""
        refused = self.gate.refusal() if self.gate is not None else None
        if refused is not None:
            raise refused
        req = _parse(pb.EmbedRequest if rpc == "embed" else pb.SearchRequest, raw)
        reply = await self._handle(rpc, req, key, deadline, authenticated=authenticated)
        return bytes(reply.SerializeToString())

    def embed_now(self, raw: bytes, key: str | None, deadline: float | None) -> bytes | None:
        """An Embed call's reply computed on the calling thread (EmbedService.embed_now), or None once
        authenticated: finish it with `answer(..., authenticated=True)`. Raises EmbedcarError."""
        refused = self.gate.refusal() if self.gate is not None else None
        if refused is not None:
            raise refused
        req: pb.EmbedRequest = _parse(pb.EmbedRequest, raw)
        out = self.service.embed_now(req.texts, model=req.model or None, api_key=key, deadline=deadline)
        if out is None:
            return None
        self._ok["embed"].inc()
        return bytes(_embed_reply(req, out).SerializeToString())

    def count_error(self, rpc: str, exc: EmbedcarError) -> None:
        self.metrics.requests.labels(rpc, exc.code).inc()

    def stream_refusal(self, raw: bytes, exc: EmbedcarError) -> bytes:
        """A Stream message's error reply when it is refused before it is decoded (counted)."""
        return bytes(pb.StreamReply(id=_stream_id(raw), error=self._error("stream", exc)).SerializeToString())

    def stream_now(self, raw: bytes, key: str | None, stream_deadline: float | None) -> tuple[bytes | None, bool]:
        """A Stream message's reply computed on the calling thread (an Embed that needs no waiting:
        EmbedService.embed_now; an error is its reply), or None and whether the key was checked and a
        rate-limit token taken: finish it with `stream_one(..., authenticated=...)` on the loop."""
        rid, rpc = 0, "stream"
        try:
            rid, rpc, inner, deadline = _stream_message(raw, time.monotonic(), stream_deadline)
            if rpc != "embed":
                return None, False
            out = self.service.embed_now(inner.texts, model=inner.model or None, api_key=key, deadline=deadline)
            if out is None:
                return None, True
            self._ok["embed"].inc()
            reply = pb.StreamReply(id=rid, embed=_embed_reply(inner, out))
        except Exception as exc:
            reply = self._stream_failed(raw, rid, rpc, exc)
        return bytes(reply.SerializeToString()), False

    async def stream_one(self, raw: bytes, key: str | None, stream_deadline: float | None, *,
                         authenticated: bool = False) -> pb.StreamReply:
        """A Stream message's reply (an error is its reply)."""
        arrived = time.monotonic()
        rid, rpc = 0, "stream"
        try:
            rid, rpc, inner, deadline = _stream_message(raw, arrived, stream_deadline)
            reply = await self._handle(rpc, inner, key, deadline, authenticated=authenticated)
        except Exception as exc:
            return self._stream_failed(raw, rid, rpc, exc)
        return pb.StreamReply(id=rid, **{rpc: reply})

    def _stream_failed(self, raw: bytes, rid: int, rpc: str, exc: Exception) -> pb.StreamReply:
        """A Stream message's error reply (counted): the id echoed where it was read (or can be), a bug INTERNAL."""
        if isinstance(exc, EmbedcarError):
            return pb.StreamReply(id=rid or _stream_id(raw), error=self._error(rpc, exc))
        return pb.StreamReply(id=rid, error=self._error(rpc, Internal(f"unexpected error: {type(exc).__name__}")))

    async def _handle(self, rpc: str, req: Any, key: str | None, deadline: float | None, *,
                      authenticated: bool = False) -> Any:
        """The reply message for a parsed request; counts it. Raises EmbedcarError."""
        reply: pb.EmbedReply | pb.SearchReply
        if rpc == "embed":
            out = await self.service.embed(req.texts, model=req.model or None, api_key=key, deadline=deadline,
                                           authenticated=authenticated)
            reply = _embed_reply(req, out)
        else:
            reply = await self._search(req, key, deadline)
        self._ok[rpc].inc()
        return reply

    async def _search(self, req: pb.SearchRequest, key: str | None, deadline: float | None) -> pb.SearchReply:
        try:  # proto3 enums are open: an unknown number parses, and is refused here
            mode = pb.SearchMode.Name(req.mode)
        except ValueError:
            raise InvalidInput(f"unknown search mode {req.mode}") from None
        found = await self.service.search(req.texts, k=req.k, department=req.department, aisle=req.aisle,
                                          mode=mode, model=req.model or None, api_key=key, deadline=deadline)
        reply = pb.SearchReply(
            results=[pb.HitList(hits=[pb.Hit(id=h.id, score=h.score, fields=h.fields, legs=h.legs) for h in hits])
                     for hits in found.hits],
            model=found.model, index_version=found.index_version, cache_hits=found.cache_hits,
            timings=pb.Timings(**found.timings_ns), backend=found.backend)
        return reply

    def _error(self, rpc: str, exc: EmbedcarError) -> pb.StreamError:
        self.count_error(rpc, exc)
        return pb.StreamError(code=grpc_code(exc).value[0], message=exc.message, retry_after_s=exc.retry_after_s or 0.0)

    async def _abort(self, context: grpc.aio.ServicerContext[Any, Any], rpc: str, exc: EmbedcarError) -> None:
        self.count_error(rpc, exc)
        trailer: tuple[tuple[str, str], ...] = ()
        if exc.retry_after_s is not None:
            trailer = ((RETRY_AFTER_KEY, f"{exc.retry_after_s:.4f}"),)
        await context.abort(grpc_code(exc), exc.message, trailing_metadata=trailer)


def _embed_reply(req: pb.EmbedRequest, out: EmbedOutcome) -> pb.EmbedReply:
    emb = out.embeddings
    if req.float16:
        data, dtype = emb.astype(_F16).tobytes(), pb.FLOAT16
    else:
        data, dtype = emb.astype(_F32, copy=False).tobytes(), pb.FLOAT32
    return pb.EmbedReply(embeddings=data, rows=emb.shape[0], dim=emb.shape[1], dtype=dtype,
                         model=out.model, cache_hits=out.cache_hits, truncated=out.truncated,
                         timings=pb.Timings(**out.timings_ns), backend=out.backend)


def create_server(settings: SidecarSettings, servicer: EmbedderServicer, health: HealthServicer,
                  tls: ServerTls | None = None) -> tuple[grpc.aio.Server, int, UnixSocket | None]:
    """A configured, unstarted server bound to settings.host:grpc_port (0 = free port), and to the
    Unix socket settings.uds_path when set (no network reach: the bind check does not apply to it)."""
    uds_path = prepare_unix_socket(settings.uds_path) if settings.uds_path is not None else None
    limit = settings.max_message_bytes
    keys = servicer.service.keys
    # Only with keys: an interceptor costs every call a coroutine hop.
    interceptors = [KeyInterceptor(keys)] if keys.enabled else None
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", max(limit, 64 * 1024 * 1024)),
        ("grpc.so_reuseport", 0),
        *backlog_options(settings.transport_backlog),
        *front_limits(settings).options,  # grpcio takes no memory quota here: Python's own buffers dominate
    ])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        # No (de)serializers: the servicer parses bytes itself (see module docstring).
        "Embed": grpc.unary_unary_rpc_method_handler(servicer.embed),
        "Search": grpc.unary_unary_rpc_method_handler(servicer.search),
        "Stream": grpc.stream_stream_rpc_method_handler(servicer.stream),
    }),))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(SERVED, server)
    address = grpc_address(settings.host, settings.grpc_port)
    port = server.add_secure_port(address, tls.grpc_credentials()) if tls else server.add_insecure_port(address)
    uds = bind_unix_socket(server, uds_path) if uds_path is not None else None
    return server, port, uds


def grpc_address(host: str, port: int) -> str:
    """`host:port` as gRPC listens on it (an IPv6 host bracketed)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def backlog_options(backlog: int) -> list[tuple[str, int]]:
    """gRPC C core's cap on calls waiting for the event loop to take them (grpc.aio takes one at a time).
    Past the soft limit C core refuses new calls at random, past the hard one always, without running
    Python: the one refusal that stays cheap when the loop itself is what is overloaded (issue 27's
    measurements: docs/reliability.md). `maximum_concurrent_rpcs` refuses in Cython after the loop took
    the call, at ~90 % of a handler's cost, and would count open Streams and health watches too."""
    if backlog <= 0:
        return []
    return [("grpc.server.max_pending_requests", backlog), ("grpc.server.max_pending_requests_hard_limit", 2 * backlog)]


def health_status(serving: bool) -> Any:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

