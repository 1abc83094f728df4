"""Hostile HTTP/1.1 clients against a real sidecar with API keys (raw sockets): idle requests, headers
sent byte by byte, bodies that never come, keyless bodies, connection floods, requests pipelined and
replies never read. After each, a keyed call is answered (sidecar.http_protocol, sidecar.shedding.HttpGate).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from embedcar_client.client import Client
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from sidecar import http_protocol
from sidecar.admission import Admission
from sidecar.app import Sidecar, SidecarThread
from sidecar.metrics import Metrics
from sidecar.shedding import FRONT_SHARE, Gate
from tests.conftest import ROOT
from tests.fixtures_sidecar import ProbeBackend, sidecar_settings, until

KEY = "sk-hostile-http-" + "ef56" * 8
BODY = b'{"input": "oat milk barista"}'
HEALTH = b"GET /health HTTP/1.1\r\nHost: sidecar\r\n\r\n"
ANSWER_S = 15.0  # generous: only a lock-out or a hang trips it, not a busy machine


def _post_head(length: int, *, key: str | None = KEY, extra: bytes = b"") -> bytes:
    auth = b"" if key is None else b"Authorization: Bearer " + key.encode() + b"\r\n"
    return (b"POST /v1/embeddings HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n" + auth
            + extra + b"Content-Length: " + str(length).encode() + b"\r\n\r\n")


def _connect(port: int, *, rcvbuf: int | None = None) -> socket.socket:
    """`rcvbuf`: this end's receive buffer, set before connecting so the window is small from the start (the
    kernel's own buffers then hold little of what the server writes and the rest backs up in the server)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _response(s: socket.socket, timeout_s: float = 30.0, *, buffer: bytearray | None = None
              ) -> tuple[int, dict[str, str], bytes]:
    """One response read off `s` (status, headers, body); status 0 if the connection closed first.
    Bytes read past it (a pipelined reply that came in the same read) stay in `buffer` for the next."""
    s.settimeout(timeout_s)
    data = buffer if buffer is not None else bytearray()
    try:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                return 0, {}, bytes(data)
            data += chunk
        end = data.index(b"\r\n\r\n")
        lines = data[:end].decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(data) < end + 4 + length:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        return 0, {}, bytes(data)
    body = bytes(data[end + 4:end + 4 + length])
    del data[:end + 4 + length]
    return int(lines[0].split()[1]), headers, body


def _closed(s: socket.socket, timeout_s: float = 30.0) -> bool:
    """The server closed `s` (EOF or reset) within `timeout_s`, nothing else sent."""
    s.settimeout(timeout_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _wait_closed(socks: list[socket.socket], want: int, timeout_s: float = 30.0) -> list[socket.socket]:
    """Those of `socks` the server has closed, once `want` of them are (or `timeout_s` passed)."""
    closed: list[socket.socket] = []
    deadline = time.monotonic() + timeout_s
    while len(closed) < want and time.monotonic() < deadline:
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.1)
        closed += [s for s in readable if _closed(s, 1.0)]
    return closed


def _established(s: socket.socket) -> bool:
    """The server has neither closed (FIN) nor reset `s`: asked of the kernel (TCP_INFO), not by reading it,
    which a client that never reads must not do."""
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == 1  # tcpi_state, TCP_ESTABLISHED


def _until_ended(socks: list[socket.socket], timeout_s: float) -> float:
    """Seconds until the server has ended every one of `socks` (fails past `timeout_s`)."""
    start = time.monotonic()
    while any(_established(s) for s in socks):
        elapsed = time.monotonic() - start
        if elapsed > timeout_s:
            pytest.fail(f"{sum(map(_established, socks))} of {len(socks)} connections still open after {elapsed:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - start


def _pour(socks: list[socket.socket], data: bytes, seconds: float) -> None:
    """Send `data` on each of `socks` as far as the server reads it, for at most `seconds`, never blocking
    on one that it has stopped reading; one that it ends is let go."""
    left = {s: memoryview(data) for s in socks}
    for s in socks:
        s.setblocking(False)
    deadline = time.monotonic() + seconds
    while left and time.monotonic() < deadline:
        _, writable, _ = select.select([], list(left), [], 0.1)
        for s in writable:
            try:
                left[s] = left[s][s.send(left[s]):]
            except BlockingIOError:
                continue
            except OSError:  # reset, broken pipe: ended by the server
                del left[s]
                continue
            if not left[s]:
                del left[s]


def _rss_mib() -> float:
    """This process's resident memory: the sidecar under test runs in it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _keyed_embed(texts: int) -> bytes:
    """A keyed POST of `texts` texts (one text repeated: cache hits), ~8 KB of reply each."""
    body = json.dumps({"input": ["oat milk barista"] * texts}).encode()
    return _post_head(len(body)) + body


def _keyed_calls_answer(sc: Sidecar) -> None:
    with Client(sc.grpc_target, api_key=KEY) as c:
        assert c.embed(["keyed grpc call"], timeout_s=30).embeddings.shape[0] == 1
    r = httpx.post(f"http://127.0.0.1:{sc.http_port}/v1/embeddings", json={"input": "keyed http call"},
                   headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def keyed(settings: Settings, model_dir: object) -> Iterator[Sidecar]:
    """API keys on, timeouts long enough that nothing here times out by accident."""
    s = sidecar_settings(settings, api_keys=f"shop={KEY}", http_header_timeout_s=60.0, http_body_timeout_s=60.0)
    with SidecarThread(s) as sc:
        yield sc


@pytest.fixture(scope="module")
def impatient(settings: Settings, model_dir: object) -> Iterator[Sidecar]:
    s = sidecar_settings(settings, api_keys=f"shop={KEY}", http_header_timeout_s=0.5, http_body_timeout_s=0.5)
    with SidecarThread(s) as sc:
        yield sc


def test_idle_posts_hold_no_place_and_lock_nobody_out(keyed: Sidecar) -> None:
    """110 keyless header-only POSTs are answered 401 at once; 110 keyed ones whose bodies never come
    wait for them outside the in-flight count; keyed gRPC and HTTP calls are answered meanwhile."""
    assert keyed.http_port is not None
    n = 110
    keyless = [_connect(keyed.http_port) for _ in range(n)]
    for s in keyless:
        s.sendall(_post_head(100, key=None))
    keyed_idle = [_connect(keyed.http_port) for _ in range(n)]
    try:
        for s in keyed_idle:
            s.sendall(_post_head(100))
        for s in keyless:
            status, headers, _ = _response(s)
            assert status == 401 and headers.get("connection") == "close"
            assert _closed(s)
        assert keyed.http_gate.in_flight == 0 and keyed.gate.in_flight == 0
        _keyed_calls_answer(keyed)
        for s in keyed_idle[:5]:  # still waiting for their bodies, and served once they come
            s.sendall(b'{"input": "late"}'.ljust(100))
            status, _, body = _response(s)
            assert status == 200 and json.loads(body)["data"][0]["index"] == 0
    finally:
        for s in keyless + keyed_idle:
            s.close()


class _CountingSearch:
    """`http_protocol._HEAD_END` with the bytes each search of `sent` scans counted (not other connections':
    the sidecar's own listener checks send `GET /health` every 2 s)."""

    def __init__(self, pattern: re.Pattern[bytes], sent: bytes) -> None:
        self.pattern = pattern
        self.sent = sent
        self.scanned = 0
        self.searches = 0

    def search(self, data: bytearray, pos: int = 0) -> Any:
        if self.sent.startswith(data):
            self.searches += 1
            self.scanned += len(data) - pos
        return self.pattern.search(data, pos)


def test_header_parsing_is_linear_in_the_bytes_received(keyed: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 30 KB header sent byte by byte, on a fresh connection and again on the same one (keep-alive):
    each byte is scanned for the end of the header block once (plus 3 per read), whatever the reads."""
    assert keyed.http_port is not None
    head = _post_head(len(BODY), extra=b"X-Pad: " + b"a" * 30_000 + b"\r\n")
    counting = _CountingSearch(http_protocol._HEAD_END, head + BODY)
    monkeypatch.setattr(http_protocol, "_HEAD_END", counting)
    with _connect(keyed.http_port) as s:
        for _request in range(2):
            before_scanned, before_searches = counting.scanned, counting.searches
            for i in range(len(head)):
                s.send(head[i:i + 1])
                if i % 100 == 0:
                    time.sleep(0.001)  # let the sidecar read: many reads of a few bytes
            s.sendall(BODY)
            status, _, body = _response(s)
            assert status == 200, body
            scanned, reads = counting.scanned - before_scanned, counting.searches - before_searches
            # The old parser scanned the whole buffer per read: about reads x len(head) / 2. The last read
            # may hold the body too.
            assert scanned <= len(head) + len(BODY) + 3 * reads, (scanned, reads)


def test_a_header_block_over_the_bound_is_refused(keyed: Sidecar) -> None:
    assert keyed.http_port is not None
    with _connect(keyed.http_port) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nX-Pad: " + b"a" * (http_protocol.MAX_HEAD + 10))
        status, _, _ = _response(s)
        assert status == 431 and _closed(s)
    _keyed_calls_answer(keyed)


def test_pipelined_requests_split_mid_header_are_answered(keyed: Sidecar) -> None:
    """A second request whose header block begins in the read that ends the first (pipelining)."""
    assert keyed.http_port is not None
    first, second = _post_head(len(BODY)) + BODY, _post_head(len(BODY)) + BODY
    with _connect(keyed.http_port) as s:
        s.sendall(first + second[:20])
        time.sleep(0.05)
        s.sendall(second[20:])
        pending = bytearray()  # both replies may come in one read
        assert [_response(s, buffer=pending)[0] for _ in range(2)] == [200, 200]


def test_keyless_request_is_refused_before_its_body_is_read(keyed: Sidecar) -> None:
    """A keyless POST announcing 3 MB (and asking to be told before sending it): 401 at once, no
    100 Continue, the connection closed; the body is never sent, so it cannot have been read."""
    assert keyed.http_port is not None
    with _connect(keyed.http_port) as s:
        s.sendall(_post_head(3_000_000, key=None, extra=b"Expect: 100-continue\r\n"))
        status, headers, body = _response(s)
        assert status == 401, body
        assert headers["www-authenticate"] == "Bearer" and headers["connection"] == "close"
        assert json.loads(body)["error"]["type"] == "unauthenticated"
        assert _closed(s)
    with _connect(keyed.http_port) as s:  # a wrong key too
        s.sendall(_post_head(3_000_000, key="sk-wrong-" + "00" * 16))
        assert _response(s)[0] == 401 and _closed(s)


def test_a_body_that_never_arrives_is_closed_after_the_body_timeout(impatient: Sidecar) -> None:
    assert impatient.http_port is not None
    with _connect(impatient.http_port) as s:
        s.sendall(_post_head(100) + b'{"input": ')
        status, headers, body = _response(s)
        assert status == 408 and headers["connection"] == "close", body
        assert json.loads(body)["error"]["type"] == "request_timeout"
        assert _closed(s)
    assert impatient.http_gate.in_flight == 0
    _keyed_calls_answer(impatient)


def test_a_header_block_that_never_ends_is_closed_after_the_header_timeout(impatient: Sidecar) -> None:
    """On a new connection (nothing sent, or part of a header block) and on a keep-alive one."""
    assert impatient.http_port is not None
    with _connect(impatient.http_port) as silent, _connect(impatient.http_port) as partial:
        partial.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
        for s in (silent, partial):
            assert _response(s)[0] == 408 and _closed(s)
    with _connect(impatient.http_port) as s:
        s.sendall(_post_head(len(BODY)) + BODY)
        assert _response(s)[0] == 200
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
        assert _response(s)[0] == 408 and _closed(s)
    _keyed_calls_answer(impatient)


@pytest.fixture
def crowded(settings: Settings, onnx_backend: OnnxBackend) -> Iterator[tuple[Sidecar, ProbeBackend]]:
    probe = ProbeBackend(onnx_backend)
    s = sidecar_settings(settings, api_keys=f"shop={KEY}", http_max_connections=16, http_header_timeout_s=60.0,
                         http_body_timeout_s=60.0)
    with SidecarThread(s, backend=probe) as sc:
        yield sc, probe


def test_a_connection_flood_is_refused_and_a_keyed_call_still_succeeds(crowded: tuple[Sidecar, ProbeBackend]) -> None:
    """16 connections at most: idle ones beyond it push out the longest idle (a keyed call too, and it
    is served); with all 16 busy a new one is answered 503 at once; once they are done, calls succeed."""
    sc, probe = crowded
    assert sc.http_port is not None
    limit = 16
    flood = [_connect(sc.http_port) for _ in range(limit + 44)]
    try:
        closed = _wait_closed(flood, 44)
        assert sorted(flood.index(s) for s in closed) == list(range(44))  # the longest waiting
        r = httpx.post(f"http://127.0.0.1:{sc.http_port}/v1/embeddings", json={"input": "through the flood"},
                       headers={"authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for s in flood:
            s.close()

    probe.hold.clear()  # requests in progress are never pushed out
    busy = [_connect(sc.http_port) for _ in range(limit)]
    try:
        for s in busy:
            s.sendall(_post_head(len(BODY)) + BODY)

        async def all_in_flight() -> None:
            await until(lambda: sc.http_gate.in_flight == limit, f"{limit} HTTP requests in progress")

        asyncio.run(all_in_flight())
        with _connect(sc.http_port) as refused:
            status, headers, _ = _response(refused)
            assert status == 503 and headers["retry-after"] == "1" and _closed(refused)
        probe.hold.set()
        assert [_response(s)[0] for s in busy] == [200] * limit
    finally:
        probe.hold.set()
        for s in busy:
            s.close()
    _keyed_calls_answer(sc)


def test_each_front_holds_at_most_its_share_of_the_in_flight_cap() -> None:
    """HTTP at its share leaves gRPC the rest of the cap, and the other way round."""
    a = Admission(max_outstanding_items=96, s_per_token=1e-4, budget_s=0.010)
    grpc_gate = Gate(lambda: a, Metrics(), 8, share=FRONT_SHARE)
    http_gate = grpc_gate.front(FRONT_SHARE)
    assert grpc_gate.max_in_flight == http_gate.max_in_flight == 6
    for first, other in ((http_gate, grpc_gate), (grpc_gate, http_gate)):
        assert [first.enter() for _ in range(6)] == [None] * 6
        refused = first.enter()
        assert refused is not None and "on this front" in refused.message
        assert [other.enter() for _ in range(2)] == [None, None]  # the rest of the cap
        assert other.enter() is not None  # the whole cap is in use
        for g, n in ((first, 6), (other, 2)):
            for _ in range(n):
                g.leave()
        assert first.in_flight == other.in_flight == 0


def test_a_connection_still_sending_its_first_header_block_is_closed_at_shutdown(
        settings: Settings, model_dir: object) -> None:
    s = sidecar_settings(settings, api_keys=f"shop={KEY}", http_header_timeout_s=600.0)
    with SidecarThread(s) as sc:
        assert sc.http_port is not None
        partial = _connect(sc.http_port)
        partial.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
        _keyed_calls_answer(sc)  # the sidecar has taken the connection meanwhile
    with partial:
        assert _closed(partial, 5.0)


@pytest.fixture(scope="module")
def stalling(settings: Settings, model_dir: object) -> Iterator[Sidecar]:
    """A short write timeout, a low pipelining cap; nothing else times out here."""
    s = sidecar_settings(settings, api_keys=f"shop={KEY}", http_header_timeout_s=60.0, http_body_timeout_s=60.0,
                         http_write_timeout_s=1.0, http_max_pipelined=8)
    with SidecarThread(s) as sc:
        yield sc


# An upgrade offer on a connection's first request: h11 serves it (sidecar.http_protocol).
UPGRADE_HEALTH = (b"GET /health HTTP/1.1\r\nHost: sidecar\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                  b"HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n")


@pytest.mark.parametrize("first", [HEALTH, UPGRADE_HEALTH], ids=["httptools", "h11"])
def test_pipelined_requests_past_the_cap_end_the_connection(stalling: Sidecar, first: bytes) -> None:
    """1 + 8 requests in one write (one answered, 8 sent ahead of their replies): all answered. 1 + 9: the
    connection is reset (httptools: as the 10th is read; h11: once the first reply is written)."""
    assert stalling.http_port is not None
    with _connect(stalling.http_port) as s:
        s.sendall(first + HEALTH * 8)
        pending = bytearray()
        assert [_response(s, buffer=pending)[0] for _ in range(9)] == [200] * 9
    with _connect(stalling.http_port) as s:
        s.sendall(first + HEALTH * 9)
        pending = bytearray()
        statuses = [_response(s, buffer=pending)[0] for _ in range(10)]
        assert statuses.count(200) <= (0 if first is HEALTH else 1) and statuses[-1] == 0, statuses
    _keyed_calls_answer(stalling)


PIPELINING_CONNECTIONS = 100
PIPELINING_GROWTH_MIB = 64.0  # uvicorn alone queued every request of each read: ~10 MB per connection


@pytest.mark.parametrize("first", [HEALTH, UPGRADE_HEALTH], ids=["httptools", "h11"])
def test_pipelining_without_reading_is_bounded(stalling: Sidecar, first: bytes) -> None:
    """100 connections each pipelining 8,000 GET /health (280 KB) and reading nothing: each is reset at
    once (past the pipelining cap), the sidecar's memory stays within bounds, a keyed call is answered."""
    assert stalling.http_port is not None
    before = _rss_mib()
    socks = [_connect(stalling.http_port, rcvbuf=4096) for _ in range(PIPELINING_CONNECTIONS)]
    try:
        _pour(socks, first + HEALTH * 8000, seconds=5.0)
        ended_s = _until_ended(socks, timeout_s=10.0)
        grown = _rss_mib() - before
        start = time.monotonic()
        _keyed_calls_answer(stalling)
        answered_s = time.monotonic() - start
    finally:
        for s in socks:
            s.close()
    print(f"pipelining flood: ended {ended_s:.2f} s after the last send, +{grown:.0f} MiB, "
          f"keyed calls answered in {answered_s:.2f} s")
    assert grown < PIPELINING_GROWTH_MIB, f"{PIPELINING_CONNECTIONS} pipelining connections grew it by {grown:.0f} MiB"
    assert answered_s < ANSWER_S


def _read_slowly(s: socket.socket, chunk: int, pause_s: float) -> bytes:
    """One whole reply off `s` (less if the server ends it), `chunk` bytes at a time, `pause_s` apart."""
    data = bytearray()
    s.settimeout(30)
    while True:
        time.sleep(pause_s)
        want = len(data) + chunk
        while len(data) < want:
            more = s.recv(want - len(data))
            if not more:
                return bytes(data)
            data += more
            end = data.find(b"\r\n\r\n")
            length = re.search(rb"content-length: *(\d+)", data[:end], re.IGNORECASE) if end >= 0 else None
            if end >= 0 and length is not None and len(data) >= end + 4 + int(length[1]):
                return bytes(data)


def test_a_reply_never_read_is_aborted_after_the_write_timeout(stalling: Sidecar) -> None:
    """20 connections each owed two ~2 MB replies (256 texts each, pipelined) that they never read: each is
    aborted within the write timeout of its reply stalling, its buffers freed. A client that reads its
    reply slowly (128 KB every 0.4 s: over three write timeouts) is not: it gets all of it."""
    assert stalling.http_port is not None
    socks = [_connect(stalling.http_port, rcvbuf=4096) for _ in range(20)]
    try:
        for s in socks:
            s.sendall(_keyed_embed(256) * 2)
        ended_s = _until_ended(socks, timeout_s=30.0)
    finally:
        for s in socks:
            s.close()
    start = time.monotonic()
    with _connect(stalling.http_port, rcvbuf=65536) as slow:
        slow.sendall(_keyed_embed(128))
        reply = _read_slowly(slow, 128 * 1024, 0.4)
    slow_s = time.monotonic() - start
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert len(json.loads(body)["data"]) == 128, f"the slow reader got {len(reply)} bytes"
    print(f"never read: the 20 ended {ended_s:.1f} s after their requests; the slow reader got "
          f"{len(reply) / 1e6:.1f} MB in {slow_s:.1f} s")
    _keyed_calls_answer(stalling)


@pytest.fixture
def crowded_stalls(settings: Settings, model_dir: object) -> Iterator[Sidecar]:
    """8 connections at most, 4 requests in progress (HTTP: 3), a write timeout that never comes here."""
    s = sidecar_settings(settings, api_keys=f"shop={KEY}", http_max_connections=8, max_in_flight=4,
                         http_write_timeout_s=600.0, http_header_timeout_s=60.0, http_body_timeout_s=60.0)
    with SidecarThread(s) as sc:
        yield sc


def test_stalled_replies_hold_no_place_and_are_evicted_first(crowded_stalls: Sidecar,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """8 connections (the cap) each owed two ~2 MB replies it never reads: once answered, none holds an
    in-flight place (HTTP may hold 3), and past the connection cap the one stalled longest is reset for a
    new one: a keyed call is answered, not 429 or 503."""
    sc = crowded_stalls
    assert sc.http_port is not None
    answered = 0
    leave = sc.http_gate.leave

    def counted() -> None:
        nonlocal answered
        answered += 1
        leave()

    monkeypatch.setattr(sc.http_gate, "leave", counted)
    socks = [_connect(sc.http_port, rcvbuf=4096) for _ in range(8)]
    try:
        for i, s in enumerate(socks):  # in turn: the first stalls first
            s.sendall(_keyed_embed(256) * 2)

            async def both_answered(n: int = 2 * (i + 1)) -> None:
                await until(lambda: answered == n, f"{n} replies started")

            asyncio.run(both_answered())
        assert sc.http_gate.in_flight == 0
        time.sleep(http_protocol.STALLED_S + 0.2)
        r = httpx.post(f"http://127.0.0.1:{sc.http_port}/v1/embeddings", json={"input": "past the stalls"},
                       headers={"authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 200, r.text
        _until_ended(socks[:1], timeout_s=5.0)
        assert all(_established(s) for s in socks[1:])
    finally:
        for s in socks:
            s.close()


def test_the_limits_hold_on_uvloop(settings: Settings, model_dir: object, tmp_path: Path) -> None:
    """`sidecar serve` on uvloop (sidecar.event_loop), whose transports are not asyncio's classes: HTTP is
    served, a pipelining flood is reset at once, a reply never read is reset after the write timeout."""
    log = tmp_path / "sidecar.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDCAR_")} | {
        "EMBEDCAR_SIDECAR_EVENT_LOOP": "uvloop", "EMBEDCAR_SIDECAR_API_KEYS": f"shop={KEY}",
        "EMBEDCAR_SIDECAR_HTTP_WRITE_TIMEOUT_S": "1", "EMBEDCAR_SIDECAR_HTTP_MAX_PIPELINED": "8",
        "EMBEDCAR_SIDECAR_ADMISSION_BUDGET_MS": "0", "EMBEDCAR_SIDECAR_POLL_S": "0"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "inference.cli_main", "sidecar", "serve", "--models-dir",
                                 str(settings.model.models_dir), "--variant", "fp32", "--threads", "1",
                                 "--grpc-port", "0", "--http-port", "0"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while (ready := re.search(r"sidecar ready: .*, http [\d.]+:(\d+)", log.read_text())) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        port = int(ready[1])

        def keyed_call() -> None:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "on uvloop"},
                           headers={"authorization": f"Bearer {KEY}"}, timeout=ANSWER_S)
            assert r.status_code == 200, r.text

        keyed_call()
        flood = [_connect(port, rcvbuf=4096) for _ in range(20)]
        never_read = [_connect(port, rcvbuf=4096) for _ in range(4)]
        try:
            _pour(flood, HEALTH * 8000, seconds=5.0)
            _until_ended(flood, timeout_s=10.0)
            for s in never_read:
                s.sendall(_keyed_embed(256) * 2)
            _until_ended(never_read, timeout_s=30.0)
        finally:
            for s in flood + never_read:
                s.close()
        keyed_call()
    finally:
        proc.terminate()
        proc.wait(30)
    assert "Traceback" not in log.read_text(), log.read_text()
