"""The compiled gRPC front: the sidecar's main gRPC port by default (`sidecar.grpc_server=compiled`,
its Unix socket and TLS too), served by gRPC's C++ library (sidecar/native/front.cc, built on first
use) instead of grpc.aio.

A grpc.aio call wakes gRPC's poller thread, which wakes the event loop: two threads, each paying its
cold caches on a shared host. The front's gRPC thread takes the call and, where an Embed (or a Stream
message) needs no waiting (one text, a cache hit or the model idle while queries come sparsely:
EmbedPipeline.run_now), answers it itself while the event loop sleeps (`sidecar.event_loop`): one
thread woken per query. Anything else (a busy model, several texts, Search, a loop that is awake) goes
to the event loop and the same requests as grpc.aio's (sidecar.calls: `Requests`, `StreamSession`), so
replies, errors, metrics and limits are the same. Health is gRPC C++'s own service (its status set by
the sidecar: `set_serving`); reflection is answered on the gRPC thread by grpc_reflection's servicer,
one reply per request, after the stream's key is checked as it opens. No caller's metadata is ever
copied into another gRPC call (gRPC's client side asserts on headers its server side accepts: one odd
header used to abort the process).

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

from inference.backends.base import Backend, BlockingCall, CallFailed
from inference.errors import EmbedcarError, Overloaded, Unavailable
from inference.grpc_io import EXPERIMENTS, POLLING_IO
from inference.triton.tls import ClientCredentials
from sidecar.calls import Parsed, Requests, StreamSession
from sidecar.errors import status
from sidecar.event_loop import idle_lock
from sidecar.grpc_server import FrontLimits, Reflection, grpc_address
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
    def __init__(self, requests: Requests, loop: asyncio.AbstractEventLoop, *, backlog: int = 0) -> None:
        """`backlog`: calls handed to the loop that may wait for it to take them; past it a call is
        refused on the front's thread (RESOURCE_EXHAUSTED) without waking the loop, as gRPC's C core
        does on the main port (sidecar.transport_backlog). 0 = no bound."""
        self._requests = requests
        self._reflection = Reflection()
        self._loop = loop
        self._lock = idle_lock(loop)
        self._backlog = backlog
        self._waiting = 0  # handed to the loop, not yet taken by it
        self._waiting_lock = threading.Lock()  # the front's threads and the loop's count together
        self._shed = requests.metrics.rejections.labels("shed")
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
        calls = backend.blocking()
        if calls is not None and self._module is not None and self._lock is not None:
            calls.use_blocking_channels(functools.partial(open_channel, lock=self._lock, holding=self._holding))

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
        answer: bytes | Parsed | None = None
        if rpc == "embed":
            with self._loop_asleep() as asleep:
                if asleep:
                    try:
                        answer = self._requests.now(raw, key, deadline)
                    except Exception as exc:  # a bug too: INTERNAL, and the front keeps serving
                        self._fail(call, self._requests.failure(rpc, exc))
                        return
            if isinstance(answer, bytes):
                call.reply(answer)
                return
        parsed = answer if isinstance(answer, Parsed) else None  # admitted on this thread
        with self._waiting_lock:
            waiting = self._waiting
            if not self._backlog or waiting < self._backlog:
                self._waiting += 1
        if self._backlog and waiting >= self._backlog:
            self._shed.inc()
            self._fail(call, self._requests.failure(rpc, Overloaded(
                f"the sidecar's event loop is behind ({waiting} calls wait for it); retry shortly",
                retry_after_s=0.05)))
            return
        try:
            self._loop.call_soon_threadsafe(self._later, rpc, raw, key, deadline, call, parsed)
        except RuntimeError:  # the loop has closed: the sidecar is gone
            self._taken()
            self._fail(call, self._requests.failure(rpc, Unavailable("the sidecar is shutting down")))

    def _on_message(self, raw: bytes | None, key: str | None, timeout_s: float, stream: Any) -> None:
        """A Stream's opening (`raw` None: its key checked, sidecar.calls.StreamSession) or one of its
        messages: refused by the gate or answered (here where it needs no waiting, else by a task on the
        loop), an error as its reply."""
        if raw is None:
            deadline = time.monotonic() + timeout_s if math.isfinite(timeout_s) else None
            try:
                opened = stream.state = StreamSession(self._requests, key, deadline)
            except EmbedcarError as exc:  # counted
                stream.fail(status(exc).grpc.value[0], exc.message)
                return
            stream.on_cancel(functools.partial(self._loop.call_soon_threadsafe, opened.cancel))
            return
        session: StreamSession = stream.state
        reply: bytes | None = None
        message: bytes | Parsed = raw
        entered = False
        with self._loop_asleep() as asleep:
            if asleep:  # the gate and the pipeline are the loop's: touched only while it sleeps
                reply = session.enter(raw)
                if reply is None:
                    entered = True
                    now = session.now(raw)
                    if isinstance(now, bytes):
                        reply = now
                    elif now is not None:
                        message = now
        if reply is not None:
            stream.write(reply)
            return
        try:
            self._loop.call_soon_threadsafe(self._stream_later, session, message, stream, entered)
        except RuntimeError:  # the loop has closed: the sidecar is gone
            stream.fail(grpc.StatusCode.UNAVAILABLE.value[0], "the sidecar is shutting down")

    def _on_reflection(self, raw: bytes | None, key: str | None, stream: Any) -> None:
        """A reflection stream's opening (its key checked where keys are set, as grpc.aio's KeyInterceptor
        does) or one of its requests, answered here: reflection reads only the protobuf descriptors."""
        try:
            if raw is None:
                self._requests.service.keys.tenant_for(key)
                return
            reply = self._reflection.answer(raw)
        except EmbedcarError as exc:
            stream.fail(status(exc).grpc.value[0], exc.message)
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

    def _taken(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1

    @staticmethod
    def _fail(call: Any, exc: EmbedcarError) -> None:
        """End `call` with `exc`'s status (already counted: sidecar.calls.failure)."""
        err = status(exc)
        retry = f"{err.retry_after_s:.4f}" if err.retry_after_s is not None else None
        call.fail(err.grpc.value[0], err.message, retry)

    # --- on the event loop --------------------------------------------------------------------------
    def _later(self, rpc: str, raw: bytes, key: str | None, deadline: float | None, call: Any,
               parsed: Parsed | None) -> None:
        """`parsed`: the request as the front's thread admitted it (its key checked, a rate-limit token
        taken), else None: all of it here."""
        self._taken()
        task = self._loop.create_task(self._answer(rpc, raw, key, deadline, call, parsed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # The caller leaving cancels the work, as grpc.aio cancels its handler (a query others joined
        # tells them at once). On a gRPC thread: the loop is told, not touched.
        call.on_cancel(functools.partial(self._loop.call_soon_threadsafe, task.cancel, _CALLER_LEFT))

    def _stream_later(self, session: StreamSession, message: bytes | Parsed, stream: Any, entered: bool) -> None:
        """On the loop: a Stream message's task (the gate passed first where the front's thread did not)."""
        if not entered:
            assert isinstance(message, bytes)  # parsed only after the gate
            refusal = session.enter(message)
            if refusal is not None:
                stream.write(refusal)
                return
        session.spawn(message, stream.write, self._loop.create_task)

    async def _answer(self, rpc: str, raw: bytes, key: str | None, deadline: float | None, call: Any,
                      parsed: Parsed | None) -> None:
        requests = self._requests
        try:
            body = await (requests.answer(rpc, raw, key, deadline) if parsed is None else requests.reply(parsed))
        except asyncio.CancelledError as exc:
            if _CALLER_LEFT not in exc.args:
                self._fail(call, requests.failure(rpc, Unavailable("the sidecar is shutting down")))
            else:  # ended all the same (its status goes nowhere): a call is finished once, always
                call.fail(_CANCELLED, "the caller cancelled the call")
            raise
        except Exception as exc:  # a bug too: INTERNAL
            self._fail(call, requests.failure(rpc, exc))
        else:
            call.reply(body)
