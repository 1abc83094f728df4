"""The sidecar's listeners kept alive: open-file headroom, connection caps, and the sidecar's own check.

A server whose accept loop stops leaves its port dead while the process looks healthy to anything that
asks another listener. So the sidecar (1) raises its soft open-files limit to the hard one at start,
(2) caps connections on each listener below that limit (gRPC's connection quota closes a new connection
past it at once; HTTP evicts or refuses past its own), so no accept fails for want of a descriptor, and
(3) checks every listener it was asked to serve from the outside, on a fresh connection each time: a
listener that does not answer turns health NOT_SERVING at once, and one that stays silent past
`sidecar.listener_dead_s` ends the process with one log line, for its supervisor to restart it.

A check is one connection and a few bytes: the HTTP/2 preface (the server's SETTINGS frame is the
answer), an HTTP/1.1 `GET /health` (any status line), or over TLS the server's first handshake bytes
(any answer, even an alert for want of a client certificate). A connection closed at once by a listener
at its cap is an answer too: the listener accepts and decides, which is what the check is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Descriptors kept for everything but client connections: model files, the event loop, threads' pipes,
# index files, Triton channels, the check's own connection (a sidecar at rest holds ~40).
RESERVED_FILES = 128
CHECK_INTERVAL_S = 2.0
CHECK_TIMEOUT_S = 3.0  # generous: a busy 2-core host still answers within it
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Answers too: the server spoke TLS back (say it wants a client certificate), or accepted and reset at once
# (a listener at its cap).
_ANSWERED = (ssl.SSLError, ConnectionResetError)
_H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (systemd's usual soft limit of 1,024
    is a few hundred idle clients); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a container may forbid it: keep what we have, say so
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
    return int(soft)


@dataclass(frozen=True, slots=True)
class ConnectionCaps:
    grpc: int
    http: int


def connection_caps(open_files: int, grpc_wanted: int, http_wanted: int, *, http_on: bool) -> ConnectionCaps:
    """Each listener's connection cap, as configured where the open-files limit leaves room for both, else
    shrunk in proportion (never below 8) so that their sum stays under the limit less RESERVED_FILES."""
    room = max(open_files - RESERVED_FILES, 16)
    wanted = grpc_wanted + (http_wanted if http_on else 0)
    if wanted <= room:
        return ConnectionCaps(grpc_wanted, http_wanted)
    share = room / wanted
    http = max(8, int(http_wanted * share)) if http_on else http_wanted
    caps = ConnectionCaps(max(8, int(grpc_wanted * share)), http)
    log.warning("open-files limit %d: connections capped at %d (gRPC) and %d (HTTP) instead of %d and %d; "
                "raise the limit (ulimit -n, LimitNOFILE=) to allow more", open_files, caps.grpc, caps.http,
                grpc_wanted, http_wanted)
    return caps


@dataclass(frozen=True, slots=True)
class Listener:
    """One address the sidecar serves, and how to ask it for an answer."""

    name: str  # "grpc", "uds", "http": the metric's label
    host: str  # a TCP host, or a Unix socket's path for kind "uds"
    port: int
    protocol: str  # "h2" | "http1"
    tls: bool = False

    def __str__(self) -> str:
        return self.host if self.name == "uds" else f"{self.name} {self.host}:{self.port}"


async def answers(listener: Listener, timeout_s: float = CHECK_TIMEOUT_S) -> bool:
    """Whether `listener` answers a fresh connection within `timeout_s`."""
    try:
        return await asyncio.wait_for(_exchange(listener), timeout_s)
    except (TimeoutError, OSError):
        return False


async def _exchange(listener: Listener) -> bool:
    context: ssl.SSLContext | None = None
    if listener.tls:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the check asks for an answer, not an identity
        context.set_alpn_protocols(["h2" if listener.protocol == "h2" else "http/1.1"])
    host = "127.0.0.1" if listener.host in ("0.0.0.0", "") else "::1" if listener.host == "::" else listener.host
    try:
        if listener.name == "uds":
            reader, writer = await asyncio.open_unix_connection(listener.host, ssl=context)
        else:
            reader, writer = await asyncio.open_connection(host, listener.port, ssl=context)
    except _ANSWERED:
        return True
    try:
        if listener.protocol == "h2":
            writer.write(_H2_PREFACE + _H2_SETTINGS)
        else:
            writer.write(b"GET /health HTTP/1.1\r\nhost: embedcar-self-check\r\nconnection: close\r\n\r\n")
        await writer.drain()
        await reader.read(9)  # a frame header or a status line's start; b"" = closed by a listener at its cap
        return True
    except _ANSWERED:
        return True
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


class ListenerCheck:
    """Checks every listener every CHECK_INTERVAL_S. `on_change(up)` runs when the whole set's state flips;
    `on_dead(message)` once, when a listener has not answered for `dead_after_s` (0 = never)."""

    def __init__(self, listeners: list[Listener], *, dead_after_s: float, on_change: Callable[[bool], None],
                 on_dead: Callable[[str], None], on_state: Callable[[str, bool], None] | None = None,
                 interval_s: float = CHECK_INTERVAL_S, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.listeners = listeners
        self.dead_after_s = dead_after_s
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_change = on_change
        self._on_dead = on_dead
        self._on_state = on_state
        self._silent_since: dict[str, float] = {}
        self.up = True
        self.dead = False

    async def check_once(self) -> bool:
        results = await asyncio.gather(*(answers(lst, self.timeout_s) for lst in self.listeners))
        now = time.monotonic()
        for lst, ok in zip(self.listeners, results, strict=True):
            if self._on_state is not None:
                self._on_state(lst.name, ok)
            if ok:
                if self._silent_since.pop(lst.name, None) is not None:
                    log.warning("listener %s answers again", lst)
                continue
            if lst.name not in self._silent_since:
                self._silent_since[lst.name] = now - self.timeout_s  # silent since the check began
                log.error("listener %s did not answer a new connection within %.1f s: health NOT_SERVING", lst,
                          self.timeout_s)
            since = self._silent_since[lst.name]
            if self.dead_after_s and now - since >= self.dead_after_s and not self.dead:
                self.dead = True
                self._on_dead(f"listener {lst} has not answered a new connection for {now - since:.0f} s "
                              "(sidecar.listener_dead_s): exiting so that the supervisor restarts the sidecar")
        up = all(results)
        if up != self.up:
            self.up = up
            self._on_change(up)
        return up

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_once()
