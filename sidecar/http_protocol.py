"""The HTTP facade's connection protocol: httptools, except for a connection that opens with an
HTTP/2 upgrade offer (`Upgrade: h2c`), which h11 serves; and the limits a hostile client meets.

Every stock JDK HttpClient defaults to HTTP/2 and, on plain http, offers an h2c upgrade on the first
request of each connection, body included; LangChain4j's default transport (Solr's text-to-vector
module) is one. A server may ignore the offer and answer over HTTP/1.1, and h11 does, but uvicorn's
httptools protocol drops the body and answers 400 (uvicorn#2722, open). h11 costs about 0.4 ms more
CPU per request than httptools here, so only those connections get it: the first bytes of each
connection are read up to the end of its header block, and the protocol is chosen then.

Limits (HttpLimits), before any key is checked:
- a header block must be complete `header_timeout_s` after the connection opened or its first byte
  came (408 and close), and within `max_head_bytes` (431 and close);
- header blocks are collected here and scanned only in the bytes that arrived since the last look, so
  a header sent byte by byte costs time linear in its size: httptools appends each piece of a header
  split across reads to the piece before (quadratic), so it is given whole header blocks;
- at most `max_connections` open: past it a new connection closes the one that has waited longest
  without a request in progress (idle keep-alive, or a header block still coming), else it is
  answered 503 and closed at once, never queued. A request in progress is bounded by the body
  timeout (sidecar.shedding.HttpGate) and the deadline.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, Protocol, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Fast
    _HTTPTOOLS = True
except ImportError:  # httptools missing: h11 for every connection, as uvicorn itself would
    _Fast = H11Protocol  # type: ignore[misc,assignment]
    _HTTPTOOLS = False

MAX_HEAD = 32 * 1024  # nginx's default bound (4 x 8 KiB); JDK, OkHttp and httpx heads are under 1 KiB
# The blank line ending a header block; httptools also takes bare LF line ends, so must this.
_HEAD_END = re.compile(rb"\r?\n\r?\n")
# Reads of one header block that began in the read ending the request before it (pipelining), fed to
# httptools as they come: bounds its appending of split headers to a constant factor.
_PIPELINED_HEAD_READS = 64


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    max_connections: int = 1024
    max_head_bytes: int = MAX_HEAD


def offers_upgrade(head: bytes) -> bool:
    """True if a request's header block has an `Upgrade` header other than websocket."""
    for line in re.split(rb"\r?\n", head)[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"upgrade" and value.strip().lower() != b"websocket":
            return True
    return False


def _answer_and_close(transport: asyncio.BaseTransport, status: bytes) -> None:
    """A bodiless reply written by the protocol (no request was handed to the app), then close."""
    if not transport.is_closing():
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        transport.close()


class _Waiting(Protocol):
    @property
    def waiting_since(self) -> float | None:
        """Loop time since which it has had no request in progress; None while it has one."""

    def evict(self) -> None: ...


class Connections:
    """A server's open HTTP connections, at most `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._open: dict[_Waiting, None] = {}  # a set in arrival order

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, conn: _Waiting) -> bool:
        """Count `conn` in, evicting the longest waiter at the limit; False: none to evict, refuse it.
        One scan of the open connections, only at the limit."""
        if len(self._open) >= self.limit:
            victim, since = None, float("inf")
            for c in self._open:
                w = c.waiting_since
                if w is not None and w < since:
                    victim, since = c, w
            if victim is None:
                return False
            del self._open[victim]
            victim.evict()
        self._open[conn] = None
        return True

    def swap(self, old: _Waiting, new: _Waiting) -> None:
        if old in self._open:  # else evicted meanwhile: its closing transport is `new`'s
            del self._open[old]
            self._open[new] = None

    def discard(self, conn: _Waiting) -> None:
        self._open.pop(conn, None)


class _HeadBuffer:
    """A header block being collected: each byte is scanned for the blank line once (the regex is
    restarted 3 bytes back, the longest terminator less one)."""

    __slots__ = ("data", "scanned")

    def __init__(self) -> None:
        self.data = bytearray()
        self.scanned = 0

    def add(self, chunk: bytes) -> int | None:
        """Append `chunk`; the offset where the header block ends (its blank line starts), else None."""
        self.data += chunk
        end = _HEAD_END.search(self.data, max(0, self.scanned - 3))
        self.scanned = len(self.data)
        return None if end is None else end.start()


class UpgradeTolerantHttp(asyncio.Protocol):
    """Buffers a connection's first header block, then hands the connection to the chosen uvicorn
    protocol (built with the same arguments uvicorn passes, so it tracks, times and shuts the
    connection down as usual). `guarded` binds the limits and the connection count of one server."""

    limits = HttpLimits()
    counted_in: Connections | None = None

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._loop: asyncio.AbstractEventLoop = kwargs.get("_loop") or asyncio.get_running_loop()
        self._server_connections: set[Any] = kwargs["server_state"].connections
        self._transport: asyncio.Transport | None = None
        self._head = _HeadBuffer()
        self._timer: asyncio.TimerHandle | None = None
        self.waiting_since: float | None = self._loop.time()

    @classmethod
    def guarded(cls, limits: HttpLimits) -> type[UpgradeTolerantHttp]:
        """This protocol with `limits`, counting its connections apart from any other server's."""
        attrs = {"limits": limits, "counted_in": Connections(limits.max_connections)}
        return cast(type[UpgradeTolerantHttp], type("GuardedHttp", (cls,), attrs))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self.counted_in is not None and not self.counted_in.admit(self):
            _answer_and_close(transport, b"503 Service Unavailable\r\nretry-after: 1")
            return
        self._server_connections.add(self)  # uvicorn's: a graceful shutdown calls `shutdown`, waits for it to go
        self._timer = self._loop.call_later(self.limits.header_timeout_s, _answer_and_close, transport,
                                            b"408 Request Timeout")

    def evict(self) -> None:
        if self._transport is not None:
            self._transport.close()

    shutdown = evict  # no request yet: nothing to finish

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return  # refused or evicted
        end = self._head.add(data)
        size = len(self._head.data) if end is None else end
        if size > self.limits.max_head_bytes:
            self._stop_timer()
            _answer_and_close(transport, b"431 Request Header Fields Too Large")
            return
        if end is None:
            return
        self._stop_timer()
        buffered = bytes(self._head.data)
        self._head = _HeadBuffer()
        cls = _GuardedH11 if offers_upgrade(buffered[:end]) else _GuardedFast
        protocol = cls(**self._kwargs)
        protocol.limits = self.limits
        protocol.counted_in = self.counted_in
        self._server_connections.discard(self)
        protocol.connection_made(transport)
        transport.set_protocol(protocol)
        if self.counted_in is not None:
            self.counted_in.swap(self, protocol)
        protocol.data_received(buffered)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self._head = _HeadBuffer()  # closed before a whole header block: no request to answer
        self._server_connections.discard(self)
        if self.counted_in is not None:
            self.counted_in.discard(self)

    def eof_received(self) -> bool | None:
        return None  # close the transport


class _Tracked:
    """What both guarded uvicorn protocols add alike: the limits they read, the connection count they are
    in, and since when they wait without a request in progress (the one idle longest is evicted first)."""

    limits = HttpLimits()
    counted_in: Connections | None = None
    loop: asyncio.AbstractEventLoop
    cycle: Any
    transport: asyncio.Transport

    def _track(self) -> None:
        self._idle_since = self.loop.time()

    @property
    def waiting_since(self) -> float | None:
        return None if self.cycle is not None and not self.cycle.response_complete else self._idle_since

    def evict(self) -> None:
        self.transport.close()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()  # type: ignore[misc]  # uvicorn's protocol, after this in the MRO

    def _uncount(self) -> None:
        if self.counted_in is not None:
            self.counted_in.discard(self)


class _GuardedFast(_Tracked, _Fast):
    """httptools past the first request: each later header block collected by `_HeadBuffer` (bounded,
    timed) and fed whole. One that begins in the same read as the end of the request before it
    (pipelining) is already inside httptools: it is bounded in reads and bytes instead."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._track()
        self._between = False  # the parser is between two requests: the next bytes begin a header block
        self._in_head = False  # the parser is inside a header block
        self._head: _HeadBuffer | None = None
        self._head_reads = 0
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None

    def on_message_begin(self) -> None:
        self._between, self._in_head, self._head_reads, self._head_bytes = False, True, 0, 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._between = True
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._between and self._head is None:
            self._head = _HeadBuffer()
            self._start_head_timer()
        if self._head is not None:
            self._unset_keepalive_if_required()  # bytes came: the header timeout governs, not keep-alive
            end = self._head.add(data)
            size = len(self._head.data) if end is None else end
            if size > self.limits.max_head_bytes:
                self._refuse(b"431 Request Header Fields Too Large")
                return
            if end is None:
                return
            data, self._head = bytes(self._head.data), None
        was_in_head = self._in_head
        super().data_received(data)
        if not self._in_head:
            self._stop_head_timer()
            return
        # Pipelined: the part of the first read that was head is under one read (256 KiB), then counted.
        self._head_reads += 1
        self._head_bytes += len(data) if was_in_head else 0
        if self._head_bytes > self.limits.max_head_bytes or self._head_reads > _PIPELINED_HEAD_READS:
            self._refuse(b"431 Request Header Fields Too Large")
        elif self._head_timer is None:
            self._start_head_timer()

    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._refuse, b"408 Request Timeout")

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: bytes) -> None:
        self._stop_head_timer()
        if self.waiting_since is None:  # a reply to an earlier request is being written: only close
            self.transport.close()
        else:
            _answer_and_close(self.transport, status)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._uncount()
        super().connection_lost(exc)


class _GuardedH11(_Tracked, H11Protocol):
    """h11 (upgrade offers): h11 scans each byte of a header block once and bounds its size itself
    (`h11_max_incomplete_event_size`); here, the header timeout and the connection count."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._track()
        self._head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():  # no header block pending
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._timed_out)

    def _timed_out(self) -> None:
        self._head_timer = None
        if self.waiting_since is None:
            self.transport.close()
        else:
            _answer_and_close(self.transport, b"408 Request Timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._uncount()
        super().connection_lost(exc)


if not _HTTPTOOLS:
    _GuardedFast = _GuardedH11  # type: ignore[misc,assignment]
