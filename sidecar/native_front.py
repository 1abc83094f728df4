"""The compiled gRPC front: the sidecar's main gRPC port by default (`sidecar.grpc_server=compiled`,
its Unix socket and TLS too), or a plaintext port of its own beside a grpc.aio one
(`sidecar.native_grpc_port`), served by gRPC's C++ library (sidecar/native/front.cc, built on first
use) instead of grpc.aio.

A grpc.aio call wakes gRPC's poller thread, which wakes the event loop: two threads, each paying its
cold caches on a shared host. The front's gRPC thread takes the call and, where an Embed (or a Stream
message) needs no waiting (one text, a cache hit or the model idle while queries come sparsely:
EmbedPipeline.run_now), answers it itself while the event loop sleeps (`sidecar.event_loop`): one
thread woken per query. Anything else (a busy model, several texts, Search, a loop that is awake) goes
to the event loop and the same servicer as grpc.aio's, so replies, errors, metrics and limits are the
same. Health is gRPC C++'s own service (its status set by the sidecar: `set_serving`); reflection is
answered on the gRPC thread by grpc_reflection's servicer, one reply per request, after the stream's key
is checked as it opens. No caller's metadata is ever copied into another gRPC call (gRPC's client side
asserts on headers its server side accepts: one odd header used to abort the process).

On the Triton backend the front's thread makes the Triton call itself, through the module's
blocking client (`open_channel`), and lets go of the loop while it waits: the loop may run meanwhile,
and the thread takes the loop's lock again before it touches the pipeline's state. Neither the
server's nor the client's grpc.aio side wakes for such a query (at most BLOCKING_CALLS wait at once;
more go to the loop's client).

Unary calls handed to the loop past `sidecar.transport_backlog` waiting for it are refused on the gRPC
thread (RESOURCE_EXHAUSTED), as gRPC's C core refuses them under grpc.aio. Answers on the gRPC thread
need the sidecar's loop to be a `SidecarLoop`; on any other loop every call goes to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from inference.backends.base import Backend
from inference.backends.triton import BlockingCall, CallFailed, TritonBackend
from inference.errors import EmbedcarError, Internal, Overloaded, Unavailable
from inference.grpc_io import EXPERIMENTS, POLLING_IO
from inference.triton.tls import ClientCredentials
from sidecar.errors import grpc_code
from sidecar.event_loop import idle_lock
from sidecar.grpc_server import EmbedderServicer, FrontLimits, Reflection, grpc_address
from sidecar.native_build import build_native, load_module
from sidecar.tls import ServerTls
from sidecar.unix_socket import owner_only_files
from sidecar.wire import SERVICE

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native" / "front.cc"
METHODS = {f"/{SERVICE}/Embed": "embed", f"/{SERVICE}/Search": "search"}
STREAM = f"/{SERVICE}/Stream"
REFLECTION = Reflection.METHOD
_CANCELLED = grpc.StatusCode.CANCELLED.value[0]
_CALLER_LEFT = "the caller cancelled the call"
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
POLL_STRATEGY = "GRPC_POLL_STRATEGY"
# Compiler flags added to the front's build: the sanitizer run of its tests sets them (tests/conftest.py;
# AddressSanitizer + UBSan, with libasan preloaded into that Python). Empty in service.
BUILD_FLAGS: tuple[str, ...] = ()
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=undefined")


def unavailable_reason() -> str | None:
    """None when the compiled front builds here (or is built), else why not."""
    try:
        build_native(SOURCE, "embedcar_front", module=True, extra_flags=BUILD_FLAGS)
    except Unavailable as exc:
        return exc.message
    return None


def open_channel(url: str, options: list[tuple[str, int | str]], credentials: ClientCredentials | None, *,
                 lock: threading.Lock | None = None, holding: threading.local | None = None) -> BlockingCall:
    """A blocking channel to `url` on the compiled client (TLS with `credentials`). A call made by a
    thread whose `holding.held` is set lets go of `lock` (the loop's idle lock) while it waits."""
    module: Any = load_module(SOURCE, "embedcar_front", extra_flags=BUILD_FLAGS)
    tls = (credentials.root_ca, credentials.private_key, credentials.cert_chain) if credentials else ()
    channel = module.Channel(url, options, *tls)
    idle = lock if holding is not None else None

    def wait(method: str, request: bytes, timeout_s: float, metadata: Sequence[tuple[str, str]]) -> bytes:
        code, details, reply = channel.call(method, request, timeout_s, metadata)
        if code:
            raise CallFailed(_STATUS_NAMES.get(code, str(code)), details)
        return bytes(reply)

    def call(method: str, request: bytes, timeout_s: float, metadata: Sequence[tuple[str, str]]) -> bytes:
        if idle is None or not getattr(holding, "held", False):
            return wait(method, request, timeout_s, metadata)
        idle.release()
        try:
            return wait(method, request, timeout_s, metadata)
        finally:
            idle.acquire()  # the loop finishes what it runs, then waits in its selector

    return call


@contextlib.contextmanager
def _library_env() -> Iterator[None]:
    """The environment gRPC's C++ library reads when it starts (the first Front), apart from grpcio's
    (started before it, and reading the same names): without the experiment names only grpcio knows (it
    would log each as unknown), and with the `poll` poller unless one is set (POLL_STRATEGY): each
    completion queue polls its own calls' sockets, so the thread waiting for a Triton reply reads it
    itself instead of epoll1's one shared poller waking it (~10 → ~7 context switches per query,
    docs/benchmarks.md)."""
    saved = {name: os.environ.get(name) for name in (EXPERIMENTS, POLL_STRATEGY)}
    if saved[EXPERIMENTS] == POLLING_IO:
        del os.environ[EXPERIMENTS]
    os.environ.setdefault(POLL_STRATEGY, "poll")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class NativeFront:
    def __init__(self, servicer: EmbedderServicer, loop: asyncio.AbstractEventLoop, *, backlog: int = 0) -> None:
        """`backlog`: calls handed to the loop that may wait for it to take them; past it a call is
        refused on the front's thread (RESOURCE_EXHAUSTED) without waking the loop, as gRPC's C core
        does on the main port (sidecar.transport_backlog). 0 = no bound."""
        self._servicer = servicer
        self._loop = loop
        self._lock = idle_lock(loop)
        self._backlog = backlog
        self._waiting = 0  # handed to the loop, not yet taken by it
        self._waiting_lock = threading.Lock()  # the front's threads and the loop's count together
        self._shed = servicer.metrics.rejections.labels("shed")
        self._tasks: set[asyncio.Task[None]] = set()
        self._holding = threading.local()  # .held: this front thread holds the loop's idle lock
        self._module: Any = None
        self._front: Any = None
        self.port = 0

    def start(self, host: str, port: int, max_message_bytes: int, limits: FrontLimits, *,
              unix: Path | None = None, tls: ServerTls | None = None) -> int:
        """Build (first time) and start the front (health NOT_SERVING until `set_serving`); the bound port.
        Raises Unavailable where it cannot build. `limits`: gRPC's server arguments, memory quota and a
        Stream's read-ahead; `unix`: a prepared Unix socket path to listen on too (mode 0600 until the
        caller restricts it); `tls`: serve TCP with it."""
        try:
            module: Any = load_module(SOURCE, "embedcar_front", extra_flags=BUILD_FLAGS)
        except Unavailable as exc:
            raise Unavailable(f"the compiled gRPC front cannot be built here: "
                              f"{exc.message}") from exc
        self._module = module
        pems = {"key_pem": tls.private_key, "cert_pem": tls.cert_chain, "client_ca_pem": tls.client_ca} if tls else {}
        with _library_env(), owner_only_files() if unix is not None else contextlib.nullcontext():
            try:
                self._front = module.Front(grpc_address(host, port), max_message_bytes, self._on_call,
                                           served=tuple(METHODS), streamed=(STREAM, REFLECTION),
                                           unix=str(unix) if unix is not None else None, options=limits.options,
                                           memory_bytes=limits.memory_bytes, max_owed=limits.max_owed, **pems)
            except OSError as exc:  # gRPC's C++ builder gives no reason: say what it usually is
                raise OSError(f"the compiled gRPC front could not bind it{f' or unix:{unix}' if unix else ''} "
                              f"(in use, or not an address of this host)") from exc
        self.port = int(self._front.port)
        return self.port

    def calls(self, backend: Backend) -> None:
        """Let the front's threads make `backend`'s calls themselves where it has blocking ones (Triton)."""
        if isinstance(backend, TritonBackend) and self._module is not None and self._lock is not None:
            backend.use_blocking_channels(functools.partial(open_channel, lock=self._lock, holding=self._holding))

    def set_serving(self, serving: bool, services: Sequence[str]) -> None:
        """The health status the front's health service gives for each of `services` ("" = the server)."""
        if self._front is not None:
            for name in services:
                self._front.set_serving(serving, name)

    def shutdown_health(self) -> None:
        """NOT_SERVING for good: the sidecar is stopping (later set_serving calls are ignored)."""
        if self._front is not None:
            self._front.shutdown_health()

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls; calls in flight finish on the loop within `grace_s` (so it must keep running)."""
        if self._front is not None:
            front, self._front = self._front, None
            await asyncio.to_thread(front.stop, grace_s)

    # --- on the front's gRPC thread, with the GIL ---------------------------------------------------
    def _on_call(self, method: str, raw: bytes | None, key: str | None, timeout_s: float, call: Any) -> None:
        if method == STREAM:
            self._on_message(raw, key, timeout_s, call)
            return
        if method == REFLECTION:
            self._on_reflection(raw, key, call)
            return
        assert raw is not None  # None only opens a stream
        rpc = METHODS[method]  # the front hands over only the methods `start` names (others: UNIMPLEMENTED)
        deadline = time.monotonic() + timeout_s if math.isfinite(timeout_s) else None
        body: bytes | None = None
        authenticated = False
        if rpc == "embed":
            with self._loop_asleep() as asleep:
                if asleep:
                    try:
                        body = self._servicer.embed_now(raw, key, deadline)
                    except EmbedcarError as exc:
                        self._fail(call, rpc, exc)
                        return
                    except Exception as exc:  # a bug: INTERNAL, and the front keeps serving
                        self._fail(call, rpc, Internal(f"unexpected error: {type(exc).__name__}"))
                        return
                    authenticated = True  # the key was checked and a rate-limit token taken: not again
            if body is not None:
                call.reply(body)
                return
        with self._waiting_lock:
            waiting = self._waiting
            if not self._backlog or waiting < self._backlog:
                self._waiting += 1
        if self._backlog and waiting >= self._backlog:
            self._shed.inc()
            self._fail(call, rpc, Overloaded(f"the sidecar's event loop is behind ({waiting} calls wait for it); "
                                             "retry shortly", retry_after_s=0.05))
            return
        try:
            self._loop.call_soon_threadsafe(self._later, rpc, raw, key, deadline, call, authenticated)
        except RuntimeError:  # the loop has closed: the sidecar is gone
            self._taken()
            self._fail(call, rpc, Unavailable("the sidecar is shutting down"))

    def _on_message(self, raw: bytes | None, key: str | None, timeout_s: float, stream: Any) -> None:
        """A Stream's opening (`raw` None: its key checked, as EmbedderServicer.stream does before reading)
        or one of its messages: refused by the gate or answered (here where it needs no waiting, else by a
        task on the loop), an error as its reply."""
        servicer = self._servicer
        if raw is None:
            try:
                servicer.service.keys.tenant_for(key)
            except EmbedcarError as exc:
                servicer.count_error("stream", exc)
                stream.fail(grpc_code(exc).value[0], exc.message)
                return
            opened = stream.state = _Stream(time.monotonic() + timeout_s if math.isfinite(timeout_s) else None)
            stream.on_cancel(functools.partial(self._loop.call_soon_threadsafe, opened.cancel))
            return
        state: _Stream = stream.state
        reply: bytes | None = None
        entered: bool | None = None  # None: the gate not passed yet; else whether the key was checked
        with self._loop_asleep() as asleep:
            if asleep:  # the gate and the pipeline are the loop's: touched only while it sleeps
                reply, entered = self._message_now(raw, key, state)
        if reply is not None:
            stream.write(reply)
            return
        try:
            self._loop.call_soon_threadsafe(self._stream_later, raw, key, state, stream, entered)
        except RuntimeError:  # the loop has closed: the sidecar is gone
            stream.fail(grpc.StatusCode.UNAVAILABLE.value[0], "the sidecar is shutting down")

    def _on_reflection(self, raw: bytes | None, key: str | None, stream: Any) -> None:
        """A reflection stream's opening (its key checked where keys are set, as grpc.aio's KeyInterceptor
        does) or one of its requests, answered here: reflection reads only the protobuf descriptors."""
        servicer = self._servicer
        if raw is None:
            try:
                servicer.service.keys.tenant_for(key)
            except EmbedcarError as exc:
                stream.fail(grpc_code(exc).value[0], exc.message)
            return
        try:
            reply = servicer.reflection.answer(raw)
        except EmbedcarError as exc:
            stream.fail(grpc_code(exc).value[0], exc.message)
            return
        stream.write(reply)

    @contextlib.contextmanager
    def _loop_asleep(self) -> Iterator[bool]:
        """Whether the loop sleeps, kept asleep meanwhile (its idle lock held, let go only while a blocking
        backend call waits: open_channel): then the pipeline's state is this thread's to touch."""
        lock = self._lock
        if lock is None or not lock.acquire(blocking=False):
            yield False
            return
        self._holding.held = True
        try:
            yield True
        finally:
            self._holding.held = False
            lock.release()

    def _message_now(self, raw: bytes, key: str | None, state: _Stream) -> tuple[bytes | None, bool | None]:
        """A Stream message's reply here (a refusal, or an answer that needs no waiting), else None and
        whether its key was checked (it has passed the gate)."""
        servicer = self._servicer
        gate = servicer.gate
        refused = gate.enter() if gate is not None else None
        if refused is not None:
            return servicer.stream_refusal(raw, refused), None
        reply, authenticated = servicer.stream_now(raw, key, state.deadline)
        if reply is not None and gate is not None:
            gate.leave()
        return reply, authenticated

    def _taken(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1

    def _fail(self, call: Any, rpc: str, exc: EmbedcarError) -> None:
        self._servicer.count_error(rpc, exc)
        retry = f"{exc.retry_after_s:.4f}" if exc.retry_after_s is not None else None
        call.fail(grpc_code(exc).value[0], exc.message, retry)

    # --- on the event loop --------------------------------------------------------------------------
    def _later(self, rpc: str, raw: bytes, key: str | None, deadline: float | None, call: Any,
               authenticated: bool) -> None:
        self._taken()
        task = self._loop.create_task(self._answer(rpc, raw, key, deadline, call, authenticated))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # The caller leaving cancels the work, as grpc.aio cancels its handler (a query others joined
        # tells them at once). On a gRPC thread: the loop is told, not touched.
        call.on_cancel(functools.partial(self._loop.call_soon_threadsafe, task.cancel, _CALLER_LEFT))

    def _stream_later(self, raw: bytes, key: str | None, state: _Stream, stream: Any, entered: bool | None) -> None:
        """On the loop: a Stream message's task (the gate passed first where the front's thread did not)."""
        gate = self._servicer.gate
        if entered is None and gate is not None and (refused := gate.enter()) is not None:
            stream.write(self._servicer.stream_refusal(raw, refused))
            return
        if state.cancelled:
            if gate is not None:
                gate.leave()
            return
        task = self._loop.create_task(self._stream_answer(raw, key, state, stream, bool(entered)))
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)
        if gate is not None:  # a callback, not `finally`: a task cancelled before it ran counts too
            task.add_done_callback(lambda _t: gate.leave())

    async def _stream_answer(self, raw: bytes, key: str | None, state: _Stream, stream: Any,
                             authenticated: bool) -> None:
        reply = await self._servicer.stream_one(raw, key, state.deadline, authenticated=authenticated)
        stream.write(reply.SerializeToString())

    async def _answer(self, rpc: str, raw: bytes, key: str | None, deadline: float | None, call: Any,
                      authenticated: bool) -> None:
        try:
            body = await self._servicer.answer(rpc, raw, key, deadline, authenticated=authenticated)
        except EmbedcarError as exc:
            self._fail(call, rpc, exc)
        except asyncio.CancelledError as exc:
            if _CALLER_LEFT not in exc.args:
                self._fail(call, rpc, Unavailable("the sidecar is shutting down"))
            else:  # ended all the same (its status goes nowhere): a call is finished once, always
                call.fail(_CANCELLED, "the caller cancelled the call")
            raise
        except Exception as exc:
            self._fail(call, rpc, Internal(f"unexpected error: {type(exc).__name__}"))
        else:
            call.reply(body)


class _Stream:
    """One Stream call's state on the front: its deadline and the tasks answering its messages on the loop
    (cancelled, on the loop, when the caller leaves)."""

    __slots__ = ("cancelled", "deadline", "tasks")

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.tasks: set[asyncio.Task[None]] = set()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        for task in self.tasks:
            task.cancel()
