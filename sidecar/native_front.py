"""The compiled gRPC front (`sidecar.native_grpc_port`): Embed and Search on a port of their own,
served by gRPC's C++ library (sidecar/native/front.cc, built on first use) instead of grpc.aio.

A grpc.aio call wakes gRPC's poller thread, which wakes the event loop: two threads, each paying its
cold caches on a shared host. The front's gRPC thread takes the call and, where an Embed needs no
waiting (one text, a cache hit or the model idle while queries come sparsely: EmbedPipeline.run_now),
answers it itself while the event loop sleeps (`sidecar.event_loop`): one thread woken per query.
Anything else (a busy model, several texts, Search, a loop that is awake) goes to the event loop
and the same servicer as the main port's, so replies, errors, metrics and limits are the same.

Calls handed to the loop past `sidecar.transport_backlog` waiting for it are refused on the gRPC
thread (RESOURCE_EXHAUSTED), as gRPC's C core refuses them on the main port. Plaintext and one TCP
port: TLS, the Unix socket, Stream, health and reflection stay on the main port. Answers on the
gRPC thread need the sidecar's loop to be a `SidecarLoop`; on any other loop every call goes to it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from inference.errors import EmbedcarError, Internal, Overloaded, Unavailable
from inference.grpc_io import EXPERIMENTS, POLLING_IO
from sidecar.errors import grpc_code
from sidecar.event_loop import idle_lock
from sidecar.grpc_server import SERVICE, EmbedderServicer
from sidecar.native_build import build_native, load_module

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native" / "front.cc"
METHODS = {f"/{SERVICE}/Embed": "embed", f"/{SERVICE}/Search": "search"}
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]


def unavailable_reason() -> str | None:
    """None when the compiled front builds here (or is built), else why not."""
    try:
        build_native(SOURCE, "embedcar_front", module=True)
    except Unavailable as exc:
        return exc.message
    return None


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
        self._front: Any = None
        self.port = 0

    def start(self, host: str, port: int, max_message_bytes: int) -> int:
        """Build (first time) and start the front; the bound port. Raises Unavailable where it cannot build."""
        try:
            module: Any = load_module(SOURCE, "embedcar_front")
        except Unavailable as exc:
            raise Unavailable(f"sidecar.native_grpc_port: the compiled gRPC front cannot be built here: "
                              f"{exc.message}") from exc
        ours = os.environ.get(EXPERIMENTS) == POLLING_IO  # names only grpcio knows: the C++ library would
        if ours:                                           # log each as unknown when it starts
            del os.environ[EXPERIMENTS]
        try:
            self._front = module.Front(host, port, max_message_bytes, self._on_call)
        finally:
            if ours:
                os.environ[EXPERIMENTS] = POLLING_IO
        self.port = int(self._front.port)
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls; calls in flight finish on the loop within `grace_s` (so it must keep running)."""
        if self._front is not None:
            front, self._front = self._front, None
            await asyncio.to_thread(front.stop, grace_s)

    # --- on the front's gRPC thread, with the GIL ---------------------------------------------------
    def _on_call(self, method: str, raw: bytes, key: str | None, timeout_s: float, call: Any) -> None:
        rpc = METHODS.get(method)
        if rpc is None:
            call.fail(_UNIMPLEMENTED, f"{method} is not served on sidecar.native_grpc_port: Embed and Search only "
                      "(Stream, health and reflection are on the main gRPC port)")
            return
        deadline = time.monotonic() + timeout_s if math.isfinite(timeout_s) else None
        authenticated = False
        lock = self._lock
        if rpc == "embed" and lock is not None and lock.acquire(blocking=False):
            try:  # the loop sleeps and cannot wake into the pipeline until this returns
                body = self._servicer.embed_now(raw, key, deadline)
            except EmbedcarError as exc:
                self._fail(call, rpc, exc)
                return
            except Exception as exc:  # a bug: INTERNAL, and the front keeps serving
                self._fail(call, rpc, Internal(f"unexpected error: {type(exc).__name__}"))
                return
            finally:
                lock.release()
            if body is not None:
                call.reply(body)
                return
            authenticated = True  # the key was checked and a rate-limit token taken: not again
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

    async def _answer(self, rpc: str, raw: bytes, key: str | None, deadline: float | None, call: Any,
                      authenticated: bool) -> None:
        try:
            body = await self._servicer.answer(rpc, raw, key, deadline, authenticated=authenticated)
        except EmbedcarError as exc:
            self._fail(call, rpc, exc)
        except asyncio.CancelledError:
            self._fail(call, rpc, Unavailable("the sidecar is shutting down"))
            raise
        except Exception as exc:
            self._fail(call, rpc, Internal(f"unexpected error: {type(exc).__name__}"))
        else:
            call.reply(body)
