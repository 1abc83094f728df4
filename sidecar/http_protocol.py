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
  without a request in progress (idle keep-alive, or a header block still coming) or with its reply
  stalled (`STALLED_S`), else it is answered 503 and closed at once, never queued. A request in
  progress is bounded by the body timeout (sidecar.shedding.HttpGate) and the deadline;
- replies owed to a client that does not read: writing pauses as soon as one byte is left unsent
  (uvicorn writes nothing more until the client has taken it), so a connection holds at most the one
  reply being written, beyond what the kernel's send buffer took (up to net.ipv4.tcp_wmem's maximum);
  one whose unsent bytes wait `write_timeout_s` with none taken is aborted (a graceful close would wait
  for the client to read them, holding the buffer for ever);
- requests read ahead of the reply being written (pipelining): at most `max_pipelined`, their bytes
  within `max_read_ahead_bytes`; past either the connection is aborted. uvicorn alone parses every
  request in a read (up to 256 KiB: ~7,900 `GET /health`) into a queued request of ~1 KB, and reads on
  after each reply while some are queued.
Aborts reset the connection, so the kernel drops what it still holds for the client too.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import re
import socket
import struct
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from inference.errors import EmbedcarError, HeadersTooLarge, RequestTimeout, Unavailable
from sidecar.errors import status

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
# A reply unsent this long counts as stalled: its connection may be evicted at the connection cap. For a
# client that reads, the kernel's send buffer (autotuned up to MBs) takes the rest of a reply in milliseconds.
STALLED_S = 1.0
# uvicorn's logger on a connection aborted mid-read: its parser is stopped by an exception, which uvicorn
# would log as a malformed request.
_UNLOGGED = logging.Logger("embedcar.http.aborted", logging.CRITICAL + 1)
_NO_LINGER = struct.pack("ii", 1, 0)  # struct linger {l_onoff = 1, l_linger = 0}: close() resets


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    max_connections: int = 1024
    max_head_bytes: int = MAX_HEAD
    write_timeout_s: float = 10.0
    max_pipelined: int = 32
    max_read_ahead_bytes: int = 4 * 1024 * 1024


def offers_upgrade(head: bytes) -> bool:
    """True if a request's header block has an `Upgrade` header other than websocket."""
    for line in re.split(rb"\r?\n", head)[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"upgrade" and value.strip().lower() != b"websocket":
            return True
    return False


def status_line(exc: EmbedcarError) -> bytes:
    """What the protocol answers for `exc` on its own (no app, no body): its status from the one error
    table (sidecar.errors.status), with Retry-After where it has one."""
    code = status(exc).http
    line = f"{code} {http.HTTPStatus(code).phrase}"
    if exc.retry_after_s:
        line += f"\r\nretry-after: {max(1, round(exc.retry_after_s))}"
    return line.encode()


_FULL = status_line(Unavailable("connection limit reached", retry_after_s=1.0))
_HEAD_LATE = status_line(RequestTimeout("request head not received in time"))
_HEAD_LARGE = status_line(HeadersTooLarge("request head over the limit"))


def _answer_and_close(transport: asyncio.BaseTransport, status: bytes) -> None:
    """A bodiless reply written by the protocol (no request was handed to the app), then close."""
    if not transport.is_closing():
        # A cast, not isinstance: uvloop's transports do not derive from asyncio's classes.
        cast(asyncio.WriteTransport, transport).write(
            b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        transport.close()


def _reset(transport: asyncio.Transport) -> None:
    """Abort with a TCP reset: asyncio's abort frees its own buffer, but a plain close of the socket leaves
    what the kernel holds to be sent, with the FIN behind it, to a client that does not read (minutes of
    retries); no linger discards it."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
    transport.abort()


class _Waiting(Protocol):
    @property
    def waiting_since(self) -> float | None:
        """Loop time since which it has had no request in progress, or its reply has been stalled; None while
        a request is in progress otherwise."""

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
        transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport, but is one
        self._transport = transport
        if self.counted_in is not None and not self.counted_in.admit(self):
            _answer_and_close(transport, _FULL)
            return
        self._server_connections.add(self)  # uvicorn's: a graceful shutdown calls `shutdown`, waits for it to go
        self._timer = self._loop.call_later(self.limits.header_timeout_s, _answer_and_close, transport, _HEAD_LATE)

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
            _answer_and_close(transport, _HEAD_LARGE)
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


class _ReadAheadExceeded(Exception):
    """A client sent more requests ahead of their replies than a connection may hold."""


def _heads(data: bytes, most: int) -> int:
    """Header blocks ending in `data`, counted up to `most` (a blank line inside a body counts too: a client
    pipelining such bodies is cut a little early)."""
    n = pos = 0
    while n < most and (end := _HEAD_END.search(data, pos)) is not None:
        n, pos = n + 1, end.end()
    return n


def _head_bytes(cycle: Any) -> int:
    """What a queued request holds besides its body, near enough: its header names and values."""
    return sum(len(name) + len(value) for name, value in cycle.scope["headers"])


class _Tracked:
    """What both guarded uvicorn protocols add alike: the limits they read, the connection count they are
    in, since when they wait without a request in progress or with a stalled reply (the one waiting longest
    is evicted first), and the write timeout."""

    limits = HttpLimits()
    counted_in: Connections | None = None
    loop: asyncio.AbstractEventLoop
    cycle: Any
    transport: asyncio.Transport

    def _track(self) -> None:
        self._idle_since = self.loop.time()
        self._stalled_since: float | None = None  # since when bytes have been left unsent
        self._unsent = 0  # unsent bytes at the last look: fewer since means the client is reading
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        # Pause at the first byte the kernel would not take (asyncio's default: 64 KiB): uvicorn then awaits
        # the drain before it writes again, and every unsent byte is under the write timeout. Not 0: TLS
        # transports pause at >= the mark, so with nothing unsent.
        cast(asyncio.WriteTransport, transport).set_write_buffer_limits(high=1, low=0)

    @property
    def replying(self) -> bool:
        """A request is in progress: its reply not yet wholly handed to the transport."""
        return self.cycle is not None and not self.cycle.response_complete

    @property
    def waiting_since(self) -> float | None:
        if not self.replying:
            return self._idle_since
        stalled = self._stalled_since
        return stalled if stalled is not None and self.loop.time() - stalled >= STALLED_S else None

    def evict(self) -> None:
        if self.transport.get_write_buffer_size():
            _reset(self.transport)  # close() would wait for a client that does not read
        else:
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        self._stop_write_timer()
        self._stalled_since = self.loop.time()
        self._unsent = self.transport.get_write_buffer_size()
        self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._stalled_since = None
        self._stop_write_timer()
        super().resume_writing()  # type: ignore[misc]

    def _write_stalled(self) -> None:
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent:  # some was taken: a slow reader, not a stalled one
            self._unsent = unsent
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_stalled)
        else:
            self._write_timer = None
            _reset(self.transport)

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()  # type: ignore[misc]  # uvicorn's protocol, after this in the MRO

    def _lost(self) -> None:
        self._stop_write_timer()
        if self.counted_in is not None:
            self.counted_in.discard(self)


class _GuardedFast(_Tracked, _Fast):
    """httptools past the first request: each later header block collected by `_HeadBuffer` (bounded,
    timed) and fed whole. One that begins in the same read as the end of the request before it
    (pipelining) is already inside httptools: it is bounded in reads and bytes instead, and the requests
    queued behind the one being answered (uvicorn's `pipeline`) in number and bytes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._track()
        self._between = False  # the parser is between two requests: the next bytes begin a header block
        self._in_head = False  # the parser is inside a header block
        self._head: _HeadBuffer | None = None
        self._head_reads = 0
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._ahead = 0  # bytes of the queued requests (headers and bodies so far)

    def on_message_begin(self) -> None:
        self._between, self._in_head, self._head_reads, self._head_bytes = False, True, 0, 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        if self.pipeline and self._queued():
            self._ahead += _head_bytes(self.cycle)
            if len(self.pipeline) > self.limits.max_pipelined or self._ahead > self.limits.max_read_ahead_bytes:
                self._abort_reading()

    def on_body(self, body: bytes) -> None:
        if self.pipeline and self._queued():
            self._ahead += len(body)
            if self._ahead > self.limits.max_read_ahead_bytes:
                self._abort_reading()
        super().on_body(body)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next queued request, if any
        self._ahead = sum(_head_bytes(c) + len(c.body) for c, _ in self.pipeline) if self.pipeline else 0

    def _queued(self) -> bool:
        """The request being parsed waits behind another (uvicorn queues the newest at the left)."""
        return self.pipeline[0][0] is self.cycle

    def _abort_reading(self) -> NoReturn:
        """Abort the connection from inside the parser, which stops at a callback's exception: the rest of
        the read is never parsed. uvicorn takes it for a bad request: its 400 goes nowhere (aborted) and its
        log line is not written (a client sending too much ahead is not a malformed request)."""
        _reset(self.transport)
        self.logger = _UNLOGGED
        raise _ReadAheadExceeded

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
                self._refuse(_HEAD_LARGE)
                return
            if end is None:
                return
            data, self._head = bytes(self._head.data), None
        was_in_head = self._in_head
        super().data_received(data)
        if self.transport.is_closing():  # aborted for reading too far ahead, or refused
            self._stop_head_timer()
            return
        if not self._in_head:
            self._stop_head_timer()
            return
        # Pipelined: the part of the first read that was head is under one read (256 KiB), then counted.
        self._head_reads += 1
        self._head_bytes += len(data) if was_in_head else 0
        if self._head_bytes > self.limits.max_head_bytes or self._head_reads > _PIPELINED_HEAD_READS:
            self._refuse(_HEAD_LARGE)
        elif self._head_timer is None:
            self._start_head_timer()

    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._refuse, _HEAD_LATE)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: bytes) -> None:
        self._stop_head_timer()
        if self.replying:  # a reply to an earlier request is being written: only close
            self.transport.close()
        else:
            _answer_and_close(self.transport, status)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._lost()
        super().connection_lost(exc)


class _GuardedH11(_Tracked, H11Protocol):
    """h11 (upgrade offers): h11 scans each byte of a header block once and bounds its size itself
    (`h11_max_incomplete_event_size`), and parses no request ahead of the reply being written, but keeps
    the bytes after it; here, the header timeout, the connection count, and the requests in those bytes
    (counted by their header blocks' ends once a reply is done) and their size."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._track()
        self._head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if len(self.conn._receive_buffer) > self.limits.max_read_ahead_bytes + self.limits.max_head_bytes:
            _reset(self.transport)  # requests sent ahead of their replies, unparsed
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():  # no header block pending
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._timed_out)

    def on_response_complete(self) -> None:
        waiting, _ = self.conn.trailing_data  # the requests sent after this one, unparsed
        if waiting and _heads(waiting, self.limits.max_pipelined + 1) > self.limits.max_pipelined:
            _reset(self.transport)  # before the next is started: uvicorn starts none on a closing transport
        super().on_response_complete()

    def _timed_out(self) -> None:
        self._head_timer = None
        if self.replying:
            self.transport.close()
        else:
            _answer_and_close(self.transport, _HEAD_LATE)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._lost()
        super().connection_lost(exc)


if not _HTTPTOOLS:
    _GuardedFast = _GuardedH11  # type: ignore[misc,assignment]
