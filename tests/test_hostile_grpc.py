"""Hostile gRPC callers at the HTTP/2 frame level (issue 49 item 8; docs/reliability.md, "Hostile clients").

Each test attacks a real `embedcar sidecar serve` process (API keys on, HTTP off) with what grpcio's
own client never sends (tests/h2_client.py): header names and values outside gRPC's rules on every
method, stream floods, RST_STREAM storms, a caller that never reads, DATA after half-close, garbage
and lying length prefixes. Then the process must be alive and a keyed Embed from a normal grpcio
client answered. A crash shows as the process gone (the failure quotes its log's end); the next test
starts a fresh one. Both gRPC servers: the compiled front (the default) and grpc.aio.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hyperframe.frame import DataFrame

from inference.ports import free_port
from sidecar.proto import embedcar_pb2 as pb
from sidecar.proto import embedcar_pb2_grpc
from sidecar.wire import API_KEY
from tests.conftest import ROOT
from tests.h2_client import H2Caller, Headers, grpc_headers, grpc_message

KEY = "hostile-suite-key-0123456789abcdef"
SERVERS = ("compiled", "aio")
ANSWER_S = 15.0  # generous: only a hang or a lock-out trips it, not a busy machine
START_S = 120.0

_EMBED = pb.EmbedRequest(texts=["milk"])
_HEALTH = health_pb2.HealthCheckRequest(service="").SerializeToString()
METHODS: dict[str, tuple[str, bytes]] = {  # test id: (path, one well-formed request message)
    "embed": ("/embedcar.v1.Embedder/Embed", _EMBED.SerializeToString()),
    "search": ("/embedcar.v1.Embedder/Search", pb.SearchRequest(texts=["milk"]).SerializeToString()),
    "stream": ("/embedcar.v1.Embedder/Stream", pb.StreamRequest(id=1, embed=_EMBED).SerializeToString()),
    "health-check": ("/grpc.health.v1.Health/Check", _HEALTH),
    "health-watch": ("/grpc.health.v1.Health/Watch", _HEALTH),
    "reflection": ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                   reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()),
    "unknown": ("/embedcar.v1.Nowhere/Nothing", b""),
}


# --- the sidecar under attack ---------------------------------------------------------------------
@dataclass
class Served:
    """One `embedcar sidecar serve` process."""

    kind: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def tail(self, lines: int = 8) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def keyed_embed(port: int, timeout_s: float) -> pb.EmbedReply:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = embedcar_pb2_grpc.EmbedderStub(ch)
        reply: pb.EmbedReply = stub.Embed(_EMBED, metadata=((API_KEY, KEY),), timeout=timeout_s)
        return reply


def start(kind: str, models_dir: Path, log: Path) -> Served:
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "EMBEDCAR_SIDECAR_API_KEYS": f"t={KEY}",
           # the attacks, not the tenant's rate limit or latency budget, must be what the sidecar meets
           "EMBEDCAR_SIDECAR_RATE_PER_S": "1000000", "EMBEDCAR_SIDECAR_BURST": "1000000",
           "EMBEDCAR_SIDECAR_ADMISSION_BUDGET_MS": "0"}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inference.cli_main", "sidecar", "serve", "--grpc-server", kind,
             "--grpc-port", str(port), "--http-port", "-1", "--threads", "1", "--models-dir", str(models_dir)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    sc = Served(kind, proc, port, log)
    end = time.monotonic() + START_S
    while True:
        if not sc.alive():
            pytest.fail(f"sidecar ({kind}) exited with {proc.returncode} before serving:\n{sc.tail()}")
        try:
            keyed_embed(port, 2.0)
            break
        except grpc.RpcError:
            if time.monotonic() > end:
                sc.stop()
                pytest.fail(f"sidecar ({kind}) not serving after {START_S:.0f} s:\n{sc.tail()}")
            time.sleep(0.2)
    if kind == "compiled" and "(compiled)" not in log.read_text(errors="replace"):
        sc.stop()
        pytest.skip(f"the compiled front could not be built here; the sidecar said:\n{sc.tail()}")
    return sc


@pytest.fixture(scope="module")
def running() -> Iterator[dict[str, Served]]:
    """The module's sidecars, one per gRPC server, started when first needed (again after a crash)."""
    procs: dict[str, Served] = {}
    yield procs
    for sc in procs.values():
        sc.stop()


@pytest.fixture(params=SERVERS)
def sidecar(request: pytest.FixtureRequest, running: dict[str, Served], model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Served:
    kind: str = request.param
    sc = running.get(kind)
    if sc is None or not sc.alive():
        running[kind] = sc = start(kind, model_dir.parent, tmp_path_factory.mktemp("hostile") / f"{kind}.log")
    return sc


def assert_serves(sc: Served, after: str) -> None:
    """The process is alive and a normal keyed Embed is answered (not locked out, not hung)."""
    time.sleep(0.2)  # an abort a moment after the attack's last frame still counts against it
    assert sc.alive(), f"after {after}: the sidecar ({sc.kind}) died, exit {sc.proc.returncode}:\n{sc.tail()}"
    try:
        reply = keyed_embed(sc.port, ANSWER_S)
    except grpc.RpcError as e:
        pytest.fail(f"after {after}: keyed Embed failed ({sc.kind}): {e.code()} {e.details()}\n{sc.tail()}")
    assert reply.rows == 1


def answered(caller: H2Caller, sid: int) -> bool:
    """The server said something about the stream (headers, an end, a reset) or ended the connection."""
    st = caller.streams[sid]
    return caller.terminated is not None or st.done or bool(st.headers)


def one_stream_each(sc: Served, path: str, bodies: list[tuple[Headers, bytes]], *,
                    after_end: bytes | None = None, must_answer: bool = True) -> list[str]:
    """Each (headers, body) on a stream of its own, on a connection of its own (a server that ends a
    connection for one stream's sake does not hide the next one's answer), all at once; each one's
    outcome once answered. `after_end`: DATA sent on the last stream after its END_STREAM. Without
    `must_answer`, a stream still unanswered after a second is "pending" (gRPC leaves a call whose
    last message never completed open, as it does an idle one: the stream limits bound those)."""
    callers: list[tuple[H2Caller, int]] = []
    try:
        for headers, body in bodies:
            c = H2Caller("127.0.0.1", sc.port)
            callers.append((c, sid := c.open(path, headers=headers)))
            c.send(sid, body, end_stream=True, wait_s=1.0)
        if after_end is not None:
            c.data_after_end(sid, after_end)
        end = time.monotonic() + (ANSWER_S if must_answer else 1.0)
        for (c, sid), (headers, body) in zip(callers, bodies, strict=True):
            while not answered(c, sid) and time.monotonic() < end:
                c.pump(0.05)
            assert answered(c, sid) or not must_answer, \
                f"{path}: no answer in {ANSWER_S:.0f} s to {headers!r:.300} {body[:16]!r}"
        return [c.terminated or c.streams[sid].outcome() for c, sid in callers]
    finally:
        for c, _ in callers:
            c.close()


# --- headers outside gRPC's rules, on every method ------------------------------------------------
def bad_headers(attack: str, sc: Served, path: str, key: str | None) -> list[Headers]:
    base = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
            (b":authority", f"127.0.0.1:{sc.port}".encode())]
    grpc_rest = [(b"content-type", b"application/grpc"), (b"te", b"trailers")] + (
        [(b"x-api-key", key.encode())] if key else [])
    if attack == "capital-name":
        return [base + grpc_rest + [(b"X-Odd", b"1")], base + grpc_rest + [(b"x-api-KEY", b"1")]]
    if attack == "control-value":
        return [base + grpc_rest + [(b"x-odd", b"a\x01b")], base + grpc_rest + [(b"x-odd", b"\x00\x7f\n")]]
    if attack == "oversize":
        return [base + grpc_rest + [(b"x-big", b"a" * 65_536)],  # HEADERS + CONTINUATION frames
                base + grpc_rest + [(f"x-many-{i}".encode(), b"v" * 16) for i in range(2_000)]]
    assert attack == "pseudo"
    return [
        [h for h in base if h[0] != b":path"] + grpc_rest,  # no :path
        [*base, (b":evil", b"1"), *grpc_rest],  # an unknown pseudo-header
        base + grpc_rest + [(b":path", b"/other")],  # a pseudo-header after regular ones, twice
        [(b":method", b"GET"), *base[1:], *grpc_rest],  # two :method
        [(b":method", b"CONNECT"), (b":authority", f"127.0.0.1:{sc.port}".encode()), *grpc_rest],
        [(b":Path", path.encode()), *base, *grpc_rest],  # a pseudo-header with a capital
    ]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("attack", ["capital-name", "control-value", "oversize", "pseudo"])
def test_headers_outside_grpc_rules(sidecar: Served, attack: str, method: str) -> None:
    path, message = METHODS[method]
    bodies = [(h, grpc_message(message)) for key in (None, KEY) for h in bad_headers(attack, sidecar, path, key)]
    outcomes = one_stream_each(sidecar, path, bodies) if sidecar.alive() else []
    assert_serves(sidecar, f"{attack} headers on {method} ({outcomes})")


# --- floods ----------------------------------------------------------------------------------------
FLOOD = 3_000


def test_stream_flood_on_one_connection(sidecar: Served) -> None:
    """Thousands of HEADERS (keyed Streams, left open) on one connection: the sidecar refuses what is
    beyond its per-connection stream limit, and a normal caller is served while they stay open."""
    path = METHODS["stream"][0]
    with H2Caller("127.0.0.1", sidecar.port) as c:
        c.pump(0.5)  # the server's SETTINGS
        sids = []
        for i in range(FLOOD):
            if c.terminated is not None:
                break
            sids.append(c.open(path, key=KEY))
            if i % 100 == 99:
                c.flush()
                c.pump(0)
        c.flush()
        end = time.monotonic() + 2.0
        while time.monotonic() < end and c.terminated is None:
            c.pump(0.1)
        assert_serves(sidecar, f"{len(sids)} open Streams on one connection")
        refused = sum(1 for s in sids if c.streams[s].reset is not None)
        limit = c.stream_limit
        print(f"{sidecar.kind}: {len(sids)} Streams opened, {refused} refused, limit {limit}, {c.terminated}")
    assert refused or c.terminated or (limit is not None and limit < FLOOD), \
        f"{FLOOD} concurrent Streams on one connection, none refused (advertised limit {limit})"


def test_many_connections_with_health_watch(sidecar: Served) -> None:
    """3,000 unauthenticated health Watch streams over 200 connections, held open while a normal
    caller is served."""
    path, message = METHODS["health-watch"]
    callers: list[H2Caller] = []
    try:
        for _ in range(200):
            c = H2Caller("127.0.0.1", sidecar.port)
            callers.append(c)
            for _ in range(FLOOD // 200):
                c.send(c.open(path), grpc_message(message), end_stream=True)
        end = time.monotonic() + ANSWER_S
        for c in callers:
            while time.monotonic() < end and not all(answered(c, s) for s in c.streams):
                c.pump(0.05)
        assert_serves(sidecar, f"{FLOOD} health Watch streams on 200 connections")
    finally:
        for c in callers:
            c.close()


# --- RST_STREAM storms -----------------------------------------------------------------------------
RESETS = 2_000


@pytest.mark.parametrize("mid_message", [False, True], ids=["after-message", "mid-message"])
@pytest.mark.parametrize("method", ["embed", "stream", "health-check"])
def test_rst_stream_storm(sidecar: Served, method: str, mid_message: bool) -> None:
    """Open and reset thousands of streams (keyed), each just after its whole request or in the middle
    of it (a length prefix promising more than was sent); reconnecting when the server ends the
    connection (its answer to rapid resets may be GOAWAY)."""
    path, message = METHODS[method]
    framed = grpc_message(message, declared=len(message) + 100) if mid_message else grpc_message(message)
    connections = 0
    c: H2Caller | None = None
    try:
        for i in range(RESETS):
            if c is None or c.terminated is not None:
                if c is not None:
                    c.close()
                if not sidecar.alive():
                    break
                c = H2Caller("127.0.0.1", sidecar.port)
                connections += 1
            sid = c.open(path, key=KEY)
            c.send(sid, framed, wait_s=1.0)
            c.reset(sid)
            c.streams.pop(sid)  # thousands of them: keep only the connection's state
            if i % 50 == 49:
                c.pump(0)
    finally:
        if c is not None:
            c.close()
    assert_serves(sidecar, f"{RESETS} reset {method} streams ({connections} connection(s))")


@pytest.mark.parametrize("method", ["health-check", "embed", "stream"])
def test_callers_that_keep_sending_after_the_answer(sidecar: Served, method: str) -> None:
    """1,800 calls whose callers keep sending messages after the server has answered (the relay's
    race in issue 49: a write to an upstream call already torn down)."""
    path, message = METHODS[method]
    framed = grpc_message(message)
    for _ in range(18):
        if not sidecar.alive():
            break
        with H2Caller("127.0.0.1", sidecar.port) as c:
            sids = [c.open(path, key=KEY) for _ in range(100)]
            for s in sids:
                c.send(s, framed, wait_s=1.0)
            c.pump(0.02)  # some answers arrive: the rest of the messages race them
            for _ in range(4):
                for s in sids:
                    c.send(s, framed, wait_s=1.0)
            for s in sids:
                c.end(s)
            c.wait(sids, 2.0)
    assert_serves(sidecar, f"1,800 {method} calls sending after the answer")


# --- a caller that never reads ---------------------------------------------------------------------
NEVER_READ_MESSAGES = 20_000
NEVER_READ_TEXTS = 8  # per message: each owed reply holds 8 embeddings (12 KiB), the request ~100 bytes
NEVER_READ_GROWTH_MIB = 32.0  # generous: a capped read-ahead costs a few MiB (today: +45 compiled, +2 aio)


@pytest.mark.slow
def test_stream_caller_that_never_reads(sidecar: Served) -> None:
    """A keyed Stream caller with a 1-byte window that sends many messages and reads nothing: the
    sidecar must stop reading (flow control) rather than hold every reply; its memory stays bounded."""
    path = METHODS["stream"][0]
    before = sidecar.rss_mib()
    sent = 0
    with H2Caller("127.0.0.1", sidecar.port, window=1) as c:
        sid = c.open(path, key=KEY)
        embed = pb.EmbedRequest(texts=["milk"] * NEVER_READ_TEXTS)  # cache hits: cheap to answer
        batch = b"".join(grpc_message(pb.StreamRequest(id=i + 1, embed=embed).SerializeToString())
                         for i in range(100))
        for _ in range(NEVER_READ_MESSAGES // 100):
            # the window staying shut for a few seconds is the server pushing back: what is wanted
            if not c.send(sid, batch, wait_s=3.0):
                break
            sent += 100
        time.sleep(2.0)  # what was read is being answered
        grown = sidecar.rss_mib() - before
        print(f"{sidecar.kind}: never-reading Stream: {sent} messages sent, +{grown:.0f} MiB")
        assert_serves(sidecar, f"a never-reading Stream ({sent} messages sent, +{grown:.0f} MiB)")
    assert grown < NEVER_READ_GROWTH_MIB, \
        f"{sent} messages sent by a caller that reads nothing grew the sidecar by {grown:.0f} MiB"


# --- DATA the protocol does not allow --------------------------------------------------------------
@pytest.mark.parametrize("method", list(METHODS))
def test_bad_data_frames(sidecar: Served, method: str) -> None:
    """Per method, keyed and not: garbage messages (a bad compressed flag, random bytes), length
    prefixes larger than the data (and than any message), a message after the caller half-closed."""
    path, message = METHODS[method]
    bodies = [grpc_message(b"\x07garbage\xff\xfe" * 8, compressed=True),
              b"\x05\x00\x00\x00\x03abc",  # an undefined flag byte
              grpc_message(message, declared=len(message) + 1_000),
              grpc_message(message, declared=0xFFFF_FFFF),
              b"\x00\x00"]  # a prefix cut short
    sent = [(grpc_headers(f"127.0.0.1:{sidecar.port}", path, key=key), b)
            for key in (None, KEY) for b in [*bodies, grpc_message(message)]]
    outcomes = one_stream_each(sidecar, path, sent, after_end=grpc_message(message), must_answer=False)
    assert_serves(sidecar, f"bad DATA on {method} ({outcomes})")


def test_data_on_streams_never_opened(sidecar: Served) -> None:
    """DATA frames on stream ids the caller never opened (odd, even, far ahead), then a normal call."""
    callers = [H2Caller("127.0.0.1", sidecar.port) for _ in range(4)]
    try:
        for c, sid in zip(callers, (1, 2, 101, 2**31 - 1), strict=True):
            c.send_raw(DataFrame(sid, data=grpc_message(b"junk"), flags=["END_STREAM"]).serialize())
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            for c in callers:
                c.pump(0.02)
        assert_serves(sidecar, f"DATA on streams never opened ({[c.terminated for c in callers]})")
    finally:
        for c in callers:
            c.close()
