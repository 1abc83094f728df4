"""The sidecar's gRPC server (grpc.aio on grpcio's C core): metadata -> api key and deadline, the reply
or its error -> the call's status; the requests themselves are sidecar.calls'.

With API keys set, every method needs the `x-api-key` metadata except the health service (probes
carry no key): Embed and Search check it in the service (per tenant, with its rate limit; Stream
once when it opens, each message then taking its own rate-limit token),
`KeyInterceptor` checks it for the rest (server reflection, and whatever is added later).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

from embedcar_client.wire import API_KEY, RETRY_AFTER_KEY, SERVICE
from inference.errors import EmbedcarError, Unauthenticated
from sidecar.auth import KeyRing
from sidecar.calls import Requests, StreamSession
from sidecar.errors import status
from sidecar.metrics import Metrics
from sidecar.service import EmbedService
from sidecar.settings import SidecarSettings
from sidecar.shedding import Gate
from sidecar.tls import ServerTls
from sidecar.unix_socket import UnixSocket, bind_unix_socket, prepare_unix_socket

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Reflection v1 (what current grpcurl and IDEs ask first) is v1alpha's protocol under a new package name,
# message for message on the wire; grpcio-reflection ships only v1alpha, so its servicer answers both.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
SERVED = (SERVICE, HEALTH, REFLECTION_V1, reflection.SERVICE_NAME)  # what reflection lists
# A caller's limits (docs/reliability.md, the hostile-gRPC table): calls open at once on one connection
# (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; past it the client waits: a unary reply the caller does not
# read keeps its stream open, so this also bounds the replies one connection can owe), a connection
# without calls closed (GOAWAY; clients reconnect), and a Stream that stops reading while this many
# replies are owed or unwritten (a caller that sends and never reads holds at most these).
GRPC_MAX_STREAMS = 100
GRPC_IDLE_S = 600
STREAM_MAX_OWED = 64


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
                return _deny(exc)
        return await continuation(details)


def _deny(exc: EmbedcarError) -> grpc.RpcMethodHandler[Any, Any]:
    async def abort(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        # stream-stream, so nothing is read first: fits a call of any cardinality.
        await context.abort(status(exc).grpc, exc.message)

    return grpc.stream_stream_rpc_method_handler(abort)


def _deadline(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


def front_options(settings: SidecarSettings, max_connections: int) -> list[tuple[str, int]]:
    """The limits of a production gRPC server: connections at once (gRPC's connection quota closes a new one
    past it), concurrent streams per connection, idle and maximum connection age (from settings),
    keepalive (the server pings a silent peer and drops a dead one; a client pinging more often than every
    10 s without calls is told GOAWAY after two strikes), header size."""
    ms = 1000
    options = [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.max_concurrent_streams", GRPC_MAX_STREAMS),
        ("grpc.keepalive_time_ms", 60 * ms),
        ("grpc.keepalive_timeout_ms", 20 * ms),
        ("grpc.http2.min_ping_interval_without_data_ms", 10 * ms),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_metadata_size", 16 * 1024),
        ("grpc.max_connection_idle_ms", GRPC_IDLE_S * ms),
    ]
    if settings.grpc_max_connection_age_s > 0:
        options += [("grpc.max_connection_age_ms", int(settings.grpc_max_connection_age_s * ms)),
                    ("grpc.max_connection_age_grace_ms", int(settings.grace_s * ms))]
    return options


class EmbedderServicer:
    """Embed and Search as unary calls (an error ends the call with its status), and both over `Stream`
    (sidecar.calls.StreamSession: an error is that message's reply)."""

    def __init__(self, service: EmbedService, metrics: Metrics, gate: Gate | None = None) -> None:
        self.service = service
        self.requests = Requests(service, metrics, gate)
        self.max_owed = STREAM_MAX_OWED  # a Stream's replies in flight before it stops reading

    async def embed(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return await self._unary("embed", raw, context)

    async def search(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return await self._unary("search", raw, context)

    async def stream(self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Replies go out in the order they finish, one write at a time. The stream stops reading while
        `max_owed` replies are unanswered or unwritten (a caller that never reads)."""
        try:
            session = StreamSession(self.requests, _api_key(context), _deadline(context))
        except EmbedcarError as exc:  # a wrong key ends the stream (counted)
            await _abort(context, exc)
            raise
        writing = asyncio.Lock()
        owed = asyncio.Semaphore(self.max_owed)

        async def write(reply: bytes) -> None:
            try:
                async with writing:
                    await context.write(reply)
            finally:
                owed.release()

        async with asyncio.TaskGroup() as tasks:  # the client leaving cancels what is still running
            async for raw in messages:
                await owed.acquire()
                refusal = session.enter(raw)
                if refusal is None:
                    session.spawn(raw, write, tasks.create_task)
                else:
                    await write(refusal)

    async def _unary(self, rpc: str, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        try:
            return await self.requests.answer(rpc, raw, _api_key(context), _deadline(context))
        except Exception as exc:  # a bug too: INTERNAL, never a crash of the server
            await _abort(context, self.requests.failure(rpc, exc))
            raise  # unreachable: abort raises


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: EmbedcarError) -> None:
    """End the call with `exc`'s status (already counted: sidecar.calls.failure)."""
    err = status(exc)
    trailer: tuple[tuple[str, str], ...] = ()
    if err.retry_after_s is not None:
        trailer = ((RETRY_AFTER_KEY, f"{err.retry_after_s:.4f}"),)
    await context.abort(err.grpc, err.message, trailing_metadata=trailer)


def create_server(settings: SidecarSettings, servicer: EmbedderServicer, health: HealthServicer,
                  tls: ServerTls | None = None, *, max_connections: int | None = None,
                  ) -> tuple[grpc.aio.Server, int, UnixSocket | None]:
    """A configured, unstarted server bound to settings.host:grpc_port (0 = free port), and to the
    Unix socket settings.uds_path when set (no network reach: the bind check does not apply to it).
    `max_connections`: the connection cap (default settings.grpc_max_connections)."""
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
        *front_options(settings, settings.grpc_max_connections if max_connections is None else max_connections),
    ])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        # No (de)serializers: the servicer parses bytes itself (see module docstring).
        "Embed": grpc.unary_unary_rpc_method_handler(servicer.embed),
        "Search": grpc.unary_unary_rpc_method_handler(servicer.search),
        "Stream": grpc.stream_stream_rpc_method_handler(servicer.stream),
    }),))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    _add_reflection(server)
    address = grpc_address(settings.host, settings.grpc_port)
    port = server.add_secure_port(address, tls.grpc_credentials()) if tls else server.add_insecure_port(address)
    uds = bind_unix_socket(server, uds_path) if uds_path is not None else None
    return server, port, uds


def _add_reflection(server: grpc.aio.Server) -> None:
    """Server reflection, v1 and v1alpha, from one servicer (the key is checked first: KeyInterceptor)."""
    handler = grpc.stream_stream_rpc_method_handler(
        ReflectionServicer(SERVED).ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(tuple(grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
                                          for name in (REFLECTION_V1, reflection.SERVICE_NAME)))


def grpc_address(host: str, port: int) -> str:
    """`host:port` as gRPC listens on it (an IPv6 host bracketed)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def backlog_options(backlog: int) -> list[tuple[str, int]]:
    """gRPC C core's cap on calls waiting for the event loop to take them (grpc.aio takes one at a time).
    Past the soft limit C core refuses new calls at random, past the hard one always, without running
    Python: the one refusal that stays cheap when the loop itself is what is overloaded (the overload
    measurements: docs/reliability.md). `maximum_concurrent_rpcs` refuses in Cython after the loop took
    the call, at ~90 % of a handler's cost, and would count open Streams and health watches too."""
    if backlog <= 0:
        return []
    return [("grpc.server.max_pending_requests", backlog), ("grpc.server.max_pending_requests_hard_limit", 2 * backlog)]


def health_status(serving: bool) -> Any:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

