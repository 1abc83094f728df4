"""A hostile gRPC caller at the HTTP/2 frame level (the `h2` library), for tests/test_hostile_grpc.py.

grpcio's own client refuses to send what a hostile client sends (header names with capitals, values
with control bytes, bad pseudo-headers, frames out of order), so this speaks HTTP/2 itself: h2 with
its header validation and normalisation off, and raw frames (hyperframe, h2's own framing layer)
where h2's state machine would refuse (DATA after END_STREAM, DATA on a stream never opened), and
frames as bytes with no state machine at all for floods (`RawConnection`: rapid resets, CONTINUATIONs).
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes
from hpack import Encoder, NeverIndexedHeaderTuple
from hyperframe.frame import DataFrame

Headers = list[tuple[bytes, bytes]]
HeaderSeq = Sequence[tuple[bytes, bytes]]

UNLIMITED_STREAMS = 2**31 - 1


def grpc_message(payload: bytes, *, compressed: bool = False, declared: int | None = None) -> bytes:
    """One gRPC length-prefixed message; `declared` overrides the length prefix (a lying one)."""
    length = len(payload) if declared is None else declared
    return bytes([1 if compressed else 0]) + length.to_bytes(4, "big") + payload


def grpc_headers(authority: str, path: str, *, key: str | None = None, extra: HeaderSeq = ()) -> Headers:
    """A well-formed gRPC request's headers, then `extra` as given (not checked, not lower-cased)."""
    headers: Headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                        (b":authority", authority.encode()), (b"content-type", b"application/grpc"),
                        (b"te", b"trailers")]
    if key is not None:
        headers.append((b"x-api-key", key.encode()))
    return headers + list(extra)


def read_some(sock: socket.socket, timeout_s: float) -> tuple[bytes | None, str | None]:
    """(what arrived within `timeout_s`, None if nothing did; why the connection ended, None while open)."""
    ready, _, _ = select.select([sock], [], [], timeout_s)
    if not ready:
        return None, None
    try:
        chunk = sock.recv(1 << 20)
    except OSError as e:
        return None, f"recv failed: {e}"
    return (chunk, None) if chunk else (None, "closed by the server")


@dataclass
class StreamResult:
    """What the server did with one stream."""

    headers: Headers = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    trailers: Headers = field(default_factory=list)
    reset: int | None = None  # RST_STREAM's error code
    ended: bool = False

    @property
    def grpc_status(self) -> int | None:
        for k, v in self.trailers or self.headers:  # a trailers-only reply puts it in the headers
            if k == b"grpc-status":
                return int(v)
        return None

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    def outcome(self) -> str:
        if self.reset is not None:
            try:
                return f"RST_STREAM {ErrorCodes(self.reset).name}"
            except ValueError:
                return f"RST_STREAM {self.reset}"
        if self.ended:
            return f"grpc-status {self.grpc_status}"
        return "pending"


class H2Caller:
    """One HTTP/2 connection to a gRPC server, driven by hand.

    `window`: the initial stream window this caller grants the server (a tiny one plus never
    acknowledging data = a caller that never reads). Events for streams are gathered in `streams`;
    `terminated` is set when the server sends GOAWAY or closes the socket.
    """

    def __init__(self, host: str, port: int, *, window: int | None = None, timeout_s: float = 10.0) -> None:
        self.authority = f"{host}:{port}"
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        config = H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False,
                                 normalize_outbound_headers=False, validate_inbound_headers=False,
                                 normalize_inbound_headers=False)
        self.conn = H2Connection(config=config)
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.streams: dict[int, StreamResult] = {}
        self.terminated: str | None = None
        self.stream_limit: int | None = None  # the server's SETTINGS_MAX_CONCURRENT_STREAMS, once sent
        self.acknowledge = window is None  # a reading caller gives back window as data arrives
        self.flush()

    # --- sending -----------------------------------------------------------------------------------
    def flush(self) -> None:
        out = self.conn.data_to_send()
        if out and self.terminated is None:
            try:
                self.sock.sendall(out)
            except OSError as e:
                self.terminated = f"send failed: {e}"

    def send_raw(self, frame: bytes) -> None:
        """Bytes past h2's state machine (it does not learn of them)."""
        self.flush()
        try:
            self.sock.sendall(frame)
        except OSError as e:
            self.terminated = f"send failed: {e}"

    def open(self, path: str, *, key: str | None = None, extra: HeaderSeq = (), headers: Headers | None = None,
             end_stream: bool = False) -> int:
        """A new stream: the gRPC headers for `path` (or `headers` exactly as given)."""
        # A hostile caller ignores the server's SETTINGS_MAX_CONCURRENT_STREAMS (h2 would refuse):
        # the server must refuse the excess itself.
        if self.conn.remote_settings.max_concurrent_streams < UNLIMITED_STREAMS:
            self.conn.remote_settings.update({SettingCodes.MAX_CONCURRENT_STREAMS: UNLIMITED_STREAMS})
            self.conn.remote_settings.acknowledge()
        sid = self.conn.get_next_available_stream_id()
        self.streams[sid] = StreamResult()
        self.conn.send_headers(sid, headers if headers is not None else
                               grpc_headers(self.authority, path, key=key, extra=extra), end_stream=end_stream)
        return sid

    def send(self, sid: int, data: bytes, *, end_stream: bool = False, wait_s: float = 10.0) -> bool:
        """DATA on `sid` within the flow-control windows the server grants (reading its WINDOW_UPDATEs
        while blocked); False if the window stayed shut for `wait_s` or the stream/connection ended."""
        view = memoryview(data)
        deadline = time.monotonic() + wait_s
        while True:
            if self.terminated is not None or self.streams[sid].done:
                return False
            try:
                room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            except ProtocolError:  # the stream is closed on h2's side
                return False
            if room >= len(view):
                self.conn.send_data(sid, bytes(view), end_stream=end_stream)
                self.flush()
                return True
            if room > 0:
                self.conn.send_data(sid, bytes(view[:room]))
                self.flush()
                view = view[room:]
                deadline = time.monotonic() + wait_s
                continue
            if time.monotonic() > deadline:
                return False
            self.pump(0.05)

    def end(self, sid: int) -> None:
        with contextlib.suppress(ProtocolError):
            self.conn.end_stream(sid)
        self.flush()

    def reset(self, sid: int) -> None:
        with contextlib.suppress(ProtocolError):
            self.conn.reset_stream(sid, ErrorCodes.CANCEL)
        self.flush()

    def data_after_end(self, sid: int, payload: bytes) -> None:
        """DATA on a stream this caller already half-closed (h2 itself would refuse to send it)."""
        self.send_raw(DataFrame(sid, data=payload, flags=["END_STREAM"]).serialize())

    # --- receiving ---------------------------------------------------------------------------------
    def pump(self, timeout_s: float) -> None:
        """Reads what has arrived (waiting up to `timeout_s` for the first bytes) and records it."""
        if self.terminated is not None:
            return
        chunk, self.terminated = read_some(self.sock, timeout_s)
        if chunk is None:
            return
        try:
            events = self.conn.receive_data(chunk)
        except ProtocolError as e:  # the server broke HTTP/2 (or answered our breakage): the end
            self.terminated = f"h2 error: {e!r}"
            return
        for ev in events:
            sid = getattr(ev, "stream_id", None)
            st = self.streams.get(sid) if sid else None
            if isinstance(ev, ResponseReceived) and st is not None:
                st.headers = list(ev.headers)
            elif isinstance(ev, DataReceived):
                if st is not None:
                    st.data += ev.data or b""
                if self.acknowledge and ev.stream_id:
                    with contextlib.suppress(ProtocolError):
                        self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, TrailersReceived) and st is not None:
                st.trailers = list(ev.headers)
            elif isinstance(ev, StreamEnded) and st is not None:
                st.ended = True
            elif isinstance(ev, StreamReset) and st is not None:
                st.reset = int(ev.error_code) if ev.error_code is not None else -1
            elif isinstance(ev, RemoteSettingsChanged):
                changed = ev.changed_settings.get(SettingCodes.MAX_CONCURRENT_STREAMS)
                if changed is not None:
                    self.stream_limit = changed.new_value
            elif isinstance(ev, ConnectionTerminated):
                self.terminated = f"GOAWAY {ev.error_code!r}"
        self.flush()

    def wait(self, sids: list[int], timeout_s: float) -> bool:
        """Until every stream in `sids` is answered (ended or reset) or the connection ends;
        False if some stream is still pending after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.terminated is None and time.monotonic() < deadline:
            if all(self.streams[s].done for s in sids):
                return True
            self.pump(0.1)
        return self.terminated is not None or all(self.streams[s].done for s in sids)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close_connection()
            self.flush()
        self.sock.close()

    def __enter__(self) -> H2Caller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- below h2: whole frames as bytes ---------------------------------------------------------------
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS, GOAWAY, CONTINUATION = 0x1, 0x3, 0x4, 0x7, 0x9  # frame types
ACK, END_HEADERS = 0x1, 0x4  # flags
CANCEL = 0x8  # error code
MAX_FRAME = 16_384  # every HTTP/2 peer's SETTINGS_MAX_FRAME_SIZE floor: a frame this size is always allowed


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame, exactly as given."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + sid.to_bytes(4, "big") + payload


def header_block(headers: HeaderSeq) -> bytes:
    """An HPACK block of literals never indexed: each block stands alone (no dynamic table between blocks),
    so one block can be sent on any number of streams."""
    return bytes(Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in headers], huffman=False))


def hpack_integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK's integer (RFC 7541 5.1) with `first`'s high bits set in its first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def literal_header_start(name: bytes, value_length: int) -> bytes:
    """The start of a literal header (without indexing, a new name) whose value is `value_length` bytes:
    the value's bytes follow in whatever frames the sender likes."""
    return b"\x00" + hpack_integer(len(name), 7) + name + hpack_integer(value_length, 7)


class RawConnection:
    """One HTTP/2 connection written frame by frame with no state machine: what a flood sends. What the
    server sends is read only for its end (GOAWAY or EOF), and its SETTINGS are acknowledged so that the
    connection stays valid while idle."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._in = bytearray()
        self.terminated: str | None = None
        self.received: dict[int, int] = {}  # frame type: how many the server sent
        self.send(PREFACE + frame(SETTINGS, 0, 0))

    def send(self, data: bytes) -> bool:
        """False once the connection has ended, or when the server let `data` wait past the socket's
        timeout (the connection is then given up: part of a frame may have gone)."""
        if self.terminated is not None:
            return False
        try:
            self.sock.sendall(data)
            return True
        except TimeoutError:
            self.terminated = "send blocked: the server stopped reading"
        except OSError as e:
            self.terminated = f"send failed: {e}"
        return False

    def pump(self, timeout_s: float = 0.0) -> None:
        """Reads what has arrived (waiting up to `timeout_s` for the first bytes)."""
        while self.terminated is None:
            chunk, self.terminated = read_some(self.sock, timeout_s)
            if chunk is None:
                return
            timeout_s = 0.0
            self._in += chunk
            self._frames()

    def _frames(self) -> None:
        while len(self._in) >= 9:
            length = int.from_bytes(self._in[:3], "big")
            if len(self._in) < 9 + length:
                return
            kind, flags = self._in[3], self._in[4]
            payload = bytes(self._in[9:9 + length])
            del self._in[:9 + length]
            self.received[kind] = self.received.get(kind, 0) + 1
            if kind == SETTINGS and not flags & ACK:
                self.send(frame(SETTINGS, ACK, 0))
            elif kind == GOAWAY:
                code = int.from_bytes(payload[4:8], "big") if len(payload) >= 8 else -1
                try:
                    name = ErrorCodes(code).name
                except ValueError:
                    name = str(code)
                self.terminated = f"GOAWAY {name}"

    def settle(self, timeout_s: float = 5.0) -> bool:
        """Until the server's SETTINGS have come and been acknowledged: after this no frame of ours is
        sent unasked, so a header block can be left open without a SETTINGS ACK landing inside it."""
        end = time.monotonic() + timeout_s
        while self.terminated is None and SETTINGS not in self.received and time.monotonic() < end:
            self.pump(0.05)
        return SETTINGS in self.received

    def wait_end(self, timeout_s: float) -> bool:
        """Whether the server ended the connection within `timeout_s`."""
        end = time.monotonic() + timeout_s
        while self.terminated is None and time.monotonic() < end:
            self.pump(0.05)
        return self.terminated is not None

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
