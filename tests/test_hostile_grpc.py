"""Hostile gRPC callers at the HTTP/2 frame level (docs/reliability.md, "Hostile clients").

Each test attacks a real `embedcar sidecar serve` process (API keys on, HTTP off) with what grpcio's
own client never sends (tests/h2_client.py): header names and values outside gRPC's rules on every
method, stream floods, RST_STREAM storms and rapid resets, CONTINUATION floods, a keyless request
body built to be expensive to parse, callers that never read, DATA after half-close, garbage and lying
length prefixes, connections up to the open-files limit. Then the process must be alive and a keyed
Embed from a normal grpcio client answered; where an attack could cost memory or CPU, the sidecar's
(from /proc) is bounded too. A crash shows as the process gone (the failure quotes its log's end); the
next test starts a fresh one. Each test prints what it measured (`pytest -s`).
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from hyperframe.frame import DataFrame

from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_client.proto import embedcar_pb2_grpc
from embedcar_client.wire import API_KEY
from inference.ports import free_port
from tests.conftest import ROOT
from tests.h2_client import (
    CANCEL,
    CONTINUATION,
    END_HEADERS,
    HEADERS,
    MAX_FRAME,
    RST_STREAM,
    H2Caller,
    Headers,
    RawConnection,
    frame,
    grpc_headers,
    grpc_message,
    header_block,
    literal_header_start,
)

KEY = "hostile-suite-key-0123456789abcdef"
ANSWER_S = 15.0  # generous: only a hang or a lock-out trips it, not a busy machine
START_S = 120.0

_EMBED = pb.EmbedRequest(texts=["milk"])
_HEALTH = health_pb2.HealthCheckRequest(service="").SerializeToString()
_REFLECT = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()  # v1's bytes too
METHODS: dict[str, tuple[str, bytes]] = {  # test id: (path, one well-formed request message)
    "embed": ("/embedcar.v1.Embedder/Embed", _EMBED.SerializeToString()),
    "search": ("/embedcar.v1.Embedder/Search", pb.SearchRequest(texts=["milk"]).SerializeToString()),
    "stream": ("/embedcar.v1.Embedder/Stream", pb.StreamRequest(id=1, embed=_EMBED).SerializeToString()),
    "health-check": ("/grpc.health.v1.Health/Check", _HEALTH),
    "health-watch": ("/grpc.health.v1.Health/Watch", _HEALTH),
    "reflection": ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", _REFLECT),
    "reflection-v1alpha": ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", _REFLECT),
    "unknown": ("/embedcar.v1.Nowhere/Nothing", b""),
}


# --- the sidecar under attack ---------------------------------------------------------------------
@dataclass
class Served:
    """One `embedcar sidecar serve` process."""

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

    def cpu_s(self) -> float:
        """User + system CPU time the process has used."""
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces; utime, stime are 14th, 15th
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_bytes(self) -> int:
        return self.log.stat().st_size

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


def health_check(port: int, timeout_s: float) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        return int(reply.status)


def start(models_dir: Path, log: Path, *, open_files: int | None = None) -> Served:
    """A sidecar on a free port, once it answers a keyed Embed; `open_files`: its RLIMIT_NOFILE, soft and
    hard (so that raising the soft limit to the hard one cannot lift it)."""
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "EMBEDCAR_SIDECAR_API_KEYS": f"t={KEY}",
           # the attacks, not the tenant's rate limit or latency budget, must be what the sidecar meets
           "EMBEDCAR_SIDECAR_RATE_PER_S": "1000000", "EMBEDCAR_SIDECAR_BURST": "1000000",
           "EMBEDCAR_SIDECAR_ADMISSION_BUDGET_MS": "0"}

    def limit_files(n: int = open_files or 0) -> None:  # in the child before exec: in force from the start
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inference.cli_main", "sidecar", "serve", "--grpc-port", str(port),
             "--http-port", "-1", "--threads", "1", "--models-dir", str(models_dir)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
            preexec_fn=limit_files if open_files is not None else None)
    sc = Served(proc, port, log)
    end = time.monotonic() + START_S
    while True:
        if not sc.alive():
            pytest.fail(f"sidecar exited with {proc.returncode} before serving:\n{sc.tail()}")
        try:
            keyed_embed(port, 2.0)
            return sc
        except grpc.RpcError:
            if time.monotonic() > end:
                sc.stop()
                pytest.fail(f"sidecar not serving after {START_S:.0f} s:\n{sc.tail()}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def running() -> Iterator[list[Served]]:
    """The module's shared sidecar, started when first needed (again after a crash)."""
    procs: list[Served] = []
    yield procs
    for sc in procs:
        sc.stop()


@pytest.fixture
def sidecar(running: list[Served], model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Served:
    if not running or not running[-1].alive():
        running.append(start(model_dir.parent, tmp_path_factory.mktemp("hostile") / "sidecar.log"))
    return running[-1]


def assert_serves(sc: Served, after: str) -> None:
    """The process is alive and a normal keyed Embed is answered (not locked out, not hung)."""
    time.sleep(0.2)  # an abort a moment after the attack's last frame still counts against it
    assert sc.alive(), f"after {after}: the sidecar died, exit {sc.proc.returncode}:\n{sc.tail()}"
    try:
        reply = keyed_embed(sc.port, ANSWER_S)
    except grpc.RpcError as e:
        pytest.fail(f"after {after}: keyed Embed failed: {e.code()} {e.details()}\n{sc.tail()}")
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
        print(f"{len(sids)} Streams opened, {refused} refused, limit {limit}, {c.terminated}")
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
    """1,800 calls whose callers keep sending messages after the server has answered (a server that
    relays calls races them: a write to an upstream call already torn down)."""
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
NEVER_READ_GROWTH_MIB = 32.0  # generous: a capped read-ahead costs a few MiB (+2 measured)


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
        print(f"never-reading Stream: {sent} messages sent, +{grown:.0f} MiB")
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


# --- a normal caller beside an attack, and what the attack cost --------------------------------------
PROBE_EVERY_S = 0.1
LATENCY_S = 5.0  # generous: only a starved or locked-out keyed caller takes this long on a busy machine
PEAK_GROWTH_MIB = 160.0  # generous: these attacks cost grpc.aio a few MiB; an unbounded buffer, hundreds
SETTLED_GROWTH_MIB = 96.0


class KeyedProbe:
    """A normal keyed caller on its own grpcio channel, one Embed every PROBE_EVERY_S while an attack
    runs: each one's latency, and the sidecar's peak RSS sampled as it goes."""

    def __init__(self, sc: Served) -> None:
        self.sc = sc
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.peak_rss_mib = sc.rss_mib()
        self._channel = grpc.insecure_channel(f"127.0.0.1:{sc.port}")
        self._stub = embedcar_pb2_grpc.EmbedderStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _call(self) -> None:
        t0 = time.monotonic()
        try:
            self._stub.Embed(_EMBED, metadata=((API_KEY, KEY),), timeout=ANSWER_S)
            self.latencies.append(time.monotonic() - t0)
        except grpc.RpcError as e:
            self.failures.append(f"{e.code()} after {time.monotonic() - t0:.1f} s")
        with contextlib.suppress(OSError, AssertionError):  # the process gone: the test says so afterwards
            self.peak_rss_mib = max(self.peak_rss_mib, self.sc.rss_mib())

    def _run(self) -> None:
        while not self._stop.wait(PROBE_EVERY_S):
            self._call()

    def __enter__(self) -> KeyedProbe:
        self._call()  # connected before the attack starts: its latencies are the calls', not a connect's
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(ANSWER_S + 5)
        self._channel.close()

    def summary(self) -> str:
        lat = sorted(self.latencies) or [float("nan")]
        return (f"keyed Embeds: {len(self.latencies)} answered (median {lat[len(lat) // 2] * 1000:.0f} ms, "
                f"max {lat[-1] * 1000:.0f} ms), {len(self.failures)} failed")

    def check(self, during: str) -> None:
        assert not self.failures, f"during {during}: keyed Embeds failed: {self.failures[:5]}"
        assert len(self.latencies) >= 3, f"during {during}: only {len(self.latencies)} keyed Embeds answered"
        assert max(self.latencies) < LATENCY_S, f"during {during}: {self.summary()}"


@dataclass
class Cost:
    """What an attack cost the sidecar: CPU seconds, RSS growth (peak and settled), log bytes."""

    cpu_s: float
    peak_mib: float
    settled_mib: float
    log_bytes: int

    def __str__(self) -> str:
        return (f"sidecar CPU {self.cpu_s:.2f} s, RSS +{self.peak_mib:.0f} MiB at peak, "
                f"+{self.settled_mib:.0f} MiB 1 s after, log +{self.log_bytes} bytes")


class Metered:
    """The sidecar's CPU, RSS and log before, during (a probe) and a second after an attack."""

    def __init__(self, sc: Served) -> None:
        self.sc = sc
        self.probe = KeyedProbe(sc)
        self.cost: Cost | None = None

    def __enter__(self) -> Metered:
        self._rss, self._cpu, self._log = self.sc.rss_mib(), self.sc.cpu_s(), self.sc.log_bytes()
        self.probe.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.probe.__exit__()
        if not self.sc.alive():
            return
        time.sleep(1.0)  # what the attack left behind is freed, or not
        self.cost = Cost(self.sc.cpu_s() - self._cpu, max(self.probe.peak_rss_mib, self.sc.rss_mib()) - self._rss,
                         self.sc.rss_mib() - self._rss, self.sc.log_bytes() - self._log)

    def result(self) -> Cost:
        assert self.cost is not None, f"the sidecar died, exit {self.sc.proc.returncode}:\n{self.sc.tail()}"
        return self.cost


# --- rapid reset -------------------------------------------------------------------------------------
RAPID_RESET_S = 3.0
RAPID_RESET_CONNECTIONS = 2
BURST = 100  # streams per write
_CANCEL = CANCEL.to_bytes(4, "big")  # RST_STREAM's payload


def rapid_reset(port: int, block: bytes, until: float) -> tuple[int, list[str]]:
    """HEADERS then RST_STREAM on fresh streams as fast as the server takes them until `until`, a new
    connection whenever the server ends one: (streams opened and reset, how each connection ended)."""
    streams, ends = 0, []
    while time.monotonic() < until:
        try:
            c = RawConnection("127.0.0.1", port, timeout_s=2.0)
        except OSError as e:
            ends.append(f"connect failed: {e}")
            time.sleep(0.05)
            continue
        with c:
            sid = 1
            while c.terminated is None and time.monotonic() < until:
                burst = b"".join(frame(HEADERS, END_HEADERS, s, block) + frame(RST_STREAM, 0, s, _CANCEL)
                                 for s in range(sid, sid + 2 * BURST, 2))
                if c.send(burst):
                    streams += BURST
                sid += 2 * BURST
                c.pump(0)
            ends.append(c.terminated or "ours")
    return streams, ends


@pytest.mark.parametrize(("method", "key"), [("health-check", None), ("embed", KEY), ("embed", None)],
                         ids=["health-check", "embed-keyed", "embed-keyless"])
def test_rapid_reset(sidecar: Served, method: str, key: str | None) -> None:
    """Rapid reset: HEADERS and RST_STREAM in a tight loop on two connections for a few seconds. Keyed
    Embeds from another connection stay answered throughout; memory comes back within bounds."""
    path = METHODS[method][0]
    what = f"rapid reset on {method} ({'keyed' if key else 'no key'})"
    block = header_block(grpc_headers(f"127.0.0.1:{sidecar.port}", path, key=key))
    with Metered(sidecar) as m, ThreadPoolExecutor(RAPID_RESET_CONNECTIONS) as pool:
        until = time.monotonic() + RAPID_RESET_S
        runs = [f.result() for f in [pool.submit(rapid_reset, sidecar.port, block, until)
                                     for _ in range(RAPID_RESET_CONNECTIONS)]]
    streams = sum(n for n, _ in runs)
    ends = [e for _, es in runs for e in es]
    cost = m.result()
    print(f"{what}: {streams} streams reset over {len(ends)} connection(s) ({sorted(set(ends))}); {cost}; "
          f"{m.probe.summary()}")
    assert_serves(sidecar, f"{what} ({streams} streams)")
    m.probe.check(what)
    assert cost.peak_mib < PEAK_GROWTH_MIB, f"{what}: {cost}"
    assert cost.settled_mib < SETTLED_GROWTH_MIB, f"{what}: {cost}"


# --- CONTINUATION floods -----------------------------------------------------------------------------
CONTINUATION_CONNECTIONS = 20  # one after another, a moment apart (stopping at one the server never ends)
CONTINUATION_END_S = 2.0  # generous: a server that checks ends a connection at once
CONTINUATION_CPU_S = 1.0  # for all of them: one connection pinning a core would spend this in a second


def continuation_flood(port: int, first: bytes, fragment: bytes, per_write: int) -> float:
    """HEADERS without END_HEADERS holding `first`, then CONTINUATIONs of `fragment` (none ending the
    block) until the server ends the connection or CONTINUATION_END_S pass; how long it lasted (one
    the server has not ended by then lasted forever, even one it stopped reading)."""
    with RawConnection("127.0.0.1", port, timeout_s=1.0) as c:
        assert c.settle(), f"no SETTINGS from the server: {c.terminated}"
        t0 = time.monotonic()
        c.send(frame(HEADERS, 0, 1, first))
        burst = frame(CONTINUATION, 0, 1, fragment) * per_write
        while c.terminated is None and time.monotonic() - t0 < CONTINUATION_END_S:
            c.send(burst)
            c.pump(0)
        ended = c.terminated is not None and not c.terminated.startswith("send blocked")
        return time.monotonic() - t0 if ended else float("inf")


def continuation_shape(shape: str, authority: str) -> tuple[bytes, bytes, int]:
    """(what the HEADERS frame holds, each CONTINUATION's fragment, fragments per write) for `shape`."""
    start = header_block(grpc_headers(authority, METHODS["health-check"][0]))
    if shape == "empty-frames":
        return start, b"", 4096
    if shape == "one-huge-value":  # 2 GiB - 1: a length from 4 GiB up is refused at once
        return start + literal_header_start(b"x-big", (1 << 31) - 1), b"a" * MAX_FRAME, 8
    assert shape == "many-headers"  # `x: a` again and again, each a literal never indexed
    return start, b"\x00\x01x\x01a" * (MAX_FRAME // 5), 8


# grpcio 1.85's C core resets the stream but keeps reading these connections to their end (HPACK state must
# stay in step), a core's worth of CPU per sending connection; no server option bounds it (tried:
# grpc.max_metadata_size, grpc.absolute_max_metadata_size, grpc.http2.max_header_list_size). Keyed callers
# are still answered. Kept as known: the day grpcio ends them, this test says so (docs/reliability.md).
STILL_READ_BY_GRPCIO = {"one-huge-value", "many-headers"}


@pytest.mark.parametrize("shape", ["empty-frames", "one-huge-value", "many-headers"])
def test_continuation_flood(sidecar: Served, shape: str) -> None:
    """A header block that never ends, on up to 20 connections in turn (no key): endless empty
    CONTINUATION frames, one 2 GiB header value, or endless small headers. Keyed callers are answered
    meanwhile; the server ends each connection at once, at little CPU cost (but for the shapes grpcio
    still reads to their end: STILL_READ_BY_GRPCIO)."""
    first, fragment, per_write = continuation_shape(shape, f"127.0.0.1:{sidecar.port}")
    lasted: list[float] = []
    with Metered(sidecar) as m:
        while len(lasted) < CONTINUATION_CONNECTIONS and (not lasted or lasted[-1] < CONTINUATION_END_S):
            lasted.append(continuation_flood(sidecar.port, first, fragment, per_write))
            time.sleep(PROBE_EVERY_S)
    cost = m.result()
    print(f"CONTINUATION flood ({shape}): {len(lasted)} connection(s), ended by the server after "
          f"{', '.join(f'{s * 1000:.0f}' for s in lasted[:5])}{'...' if len(lasted) > 5 else ''} ms; {cost}; "
          f"{m.probe.summary()}")
    assert_serves(sidecar, f"a CONTINUATION flood ({shape})")
    m.probe.check(f"a CONTINUATION flood ({shape})")
    if shape in STILL_READ_BY_GRPCIO:
        if max(lasted) >= CONTINUATION_END_S:
            pytest.xfail(f"grpcio reads a header block that never ends ({shape}) to its end: {cost}")
        pytest.fail(f"grpcio now ends a never-ending header block ({shape}): drop it from STILL_READ_BY_GRPCIO")
    assert max(lasted) < CONTINUATION_END_S, \
        f"a header block that never ends ({shape}): the server had not ended the connection after " \
        f"{CONTINUATION_END_S:.0f} s; {cost}"
    assert cost.cpu_s < CONTINUATION_CPU_S, f"CONTINUATION flood ({shape}): {cost}"
    assert cost.peak_mib < PEAK_GROWTH_MIB, f"CONTINUATION flood ({shape}): {cost}"


# --- a request built to be expensive to parse, without a key -----------------------------------------
UNKNOWN_FIELDS = 2_000_000
PRE_AUTH_CALLS = 3
PRE_AUTH_CPU_S = 0.6  # for all calls together; decoding one costs the sidecar ~2 s


@pytest.mark.parametrize("method", ["search", "embed"])
def test_keyless_request_built_to_be_expensive(sidecar: Served, method: str) -> None:
    """A 4 MB request of 2M unknown fields (2 bytes each) without a key: UNAUTHENTICATED, for the cost of
    receiving it, never of decoding it. With the key the same bytes are decoded: INVALID_ARGUMENT, and
    what that costs the sidecar shows what the key check saved."""
    path = METHODS[method][0]
    body = b"\x78\x00" * UNKNOWN_FIELDS  # field 15, varint 0: unknown to EmbedRequest and SearchRequest
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.port}") as ch:
        call = ch.unary_unary(path)
        with contextlib.suppress(grpc.RpcError):  # connected, the connection's own costs paid, before the count
            call(b"", timeout=ANSWER_S)
        codes, cpu0 = [], sidecar.cpu_s()
        for _ in range(PRE_AUTH_CALLS):
            with pytest.raises(grpc.RpcError) as refused:
                call(body, timeout=ANSWER_S)
            codes.append(refused.value.code())
        spent, cpu0 = sidecar.cpu_s() - cpu0, sidecar.cpu_s()
        with pytest.raises(grpc.RpcError) as decoded:
            call(body, metadata=((API_KEY, KEY),), timeout=ANSWER_S)
        keyed = sidecar.cpu_s() - cpu0
    print(f"keyless {len(body):,}-byte {method} of {UNKNOWN_FIELDS:,} unknown fields ×{PRE_AUTH_CALLS}: {codes[0]}, "
          f"sidecar CPU {spent:.2f} s; keyed, once: {decoded.value.code()}, sidecar CPU {keyed:.2f} s")
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * PRE_AUTH_CALLS
    assert decoded.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert spent < PRE_AUTH_CPU_S, f"{PRE_AUTH_CALLS} keyless {method}s cost the sidecar {spent:.2f} s of CPU"
    # Keyed, the same bytes are decoded and refused: unknown fields found in C, not listed one by one
    # (that took ~2 s of the event loop).
    assert keyed < 0.5, f"a keyed {method} of {UNKNOWN_FIELDS:,} unknown fields cost the sidecar {keyed:.2f} s"
    assert_serves(sidecar, f"keyless {method}s of {UNKNOWN_FIELDS:,} unknown fields")


# --- unary calls whose replies are never read --------------------------------------------------------
UNREAD_CALLS = 3_000
UNREAD_TEXTS = 8  # each reply 8 embeddings (12 KiB)
UNREAD_GROWTH_MIB = 32.0  # generous: the stream limit bounds what one connection is owed (+3 measured)


def test_unary_caller_that_never_reads(sidecar: Served) -> None:
    """A keyed caller sends 3,000 Embeds on one connection granting its streams a window of 0 and never
    a WINDOW_UPDATE (no reply can be sent): the sidecar holds at most the stream limit's replies, and
    others are answered."""
    path = METHODS["embed"][0]
    message = grpc_message(pb.EmbedRequest(texts=["milk"] * UNREAD_TEXTS).SerializeToString())
    with Metered(sidecar) as m, H2Caller("127.0.0.1", sidecar.port, window=0) as c:
        c.pump(0.5)  # the server's SETTINGS
        sids = []
        for i in range(UNREAD_CALLS):
            if c.terminated is not None:
                break
            sid = c.open(path, key=KEY)
            sids.append(sid)
            c.send(sid, message, end_stream=True, wait_s=0.5)
            if i % 100 == 99:
                c.pump(0)
        end = time.monotonic() + 2.0  # what was taken is answered, as far as the windows let it
        while time.monotonic() < end and c.terminated is None:
            c.pump(0.1)
        refused = sum(1 for s in sids if c.streams[s].reset is not None)
        owed = sum(1 for s in sids if c.streams[s].headers and not c.streams[s].done)
        assert_serves(sidecar, f"{len(sids)} unread Embeds")
    cost = m.result()
    print(f"never-reading unary caller: {len(sids)} Embeds sent, {refused} refused, {owed} answered with "
          f"replies unsent, connection {c.terminated or 'open'}, stream limit {c.stream_limit}; {cost}; "
          f"{m.probe.summary()}")
    m.probe.check("a caller that never reads")
    assert c.terminated is not None or (c.stream_limit is not None and owed <= c.stream_limit < UNREAD_CALLS), \
        f"{UNREAD_CALLS} Embeds on one connection: {owed} replies owed, stream limit {c.stream_limit}"
    assert cost.peak_mib < UNREAD_GROWTH_MIB, f"{len(sids)} Embeds never read: {cost}"


# --- connections up to the open-files limit ----------------------------------------------------------
OPEN_FILES = 256
IDLE_CONNECTIONS = 400  # past the limit: without a connection cap, accept() fails for want of a descriptor
HOLD_S = 3.0
RECOVER_S = 10.0  # generous
LOG_GROWTH_BYTES = 64 * 1024  # a few warnings, not a line per failed accept
OUT_OF_FILES = ("Too many open files", "File descriptor limit", "Errno 24")  # EMFILE as Python and gRPC say it


@pytest.mark.slow
def test_connections_past_the_open_files_limit(model_dir: Path, tmp_path: Path) -> None:
    """A sidecar allowed 256 open files (soft and hard) meets 400 idle keyless HTTP/2 connections, held
    then closed: it never runs out of descriptors (its connection cap stays below the limit), afterwards
    its port accepts, health and a keyed Embed are answered, and it has not flooded its log."""
    sc = start(model_dir.parent, tmp_path / "sidecar.log", open_files=OPEN_FILES)
    try:
        log0, cpu0 = sc.log_bytes(), sc.cpu_s()
        conns: list[RawConnection] = []
        refused = 0
        for _ in range(IDLE_CONNECTIONS):
            try:
                conns.append(RawConnection("127.0.0.1", sc.port, timeout_s=2.0))
            except OSError:
                refused += 1
        time.sleep(HOLD_S / 2)
        try:  # while they are held: a capped listener turns a newcomer away (measured, not asserted)
            keyed_embed(sc.port, 2.0)
            held = "answered"
        except grpc.RpcError as e:
            held = str(e.code())
        time.sleep(HOLD_S / 2)
        for c in conns:
            c.pump(0)
        ended = sum(1 for c in conns if c.terminated is not None)
        for c in conns:
            c.close()
        t0 = time.monotonic()
        status, reply, errors = None, None, []
        while time.monotonic() - t0 < RECOVER_S and (status is None or reply is None):
            try:
                with socket.create_connection(("127.0.0.1", sc.port), timeout=2.0):
                    pass
                status = health_check(sc.port, 2.0)
                reply = keyed_embed(sc.port, 2.0)
            except (OSError, grpc.RpcError) as e:
                errors.append(repr(e)[:120])
                time.sleep(0.2)
        recovered = time.monotonic() - t0
        grown, cpu = sc.log_bytes() - log0, sc.cpu_s() - cpu0
        print(f"{IDLE_CONNECTIONS} idle connections under a {OPEN_FILES}-file limit: {refused} refused at connect, "
              f"{ended} of {len(conns)} ended by the server, a keyed Embed meanwhile {held}; "
              f"answered again after {recovered:.1f} s "
              f"({len(errors)} failed tries); log +{grown} bytes, sidecar CPU {cpu:.2f} s")
        assert sc.alive(), f"the sidecar died, exit {sc.proc.returncode}:\n{sc.tail()}"
        assert status == health_pb2.HealthCheckResponse.SERVING and reply is not None and reply.rows == 1, \
            f"not answering {RECOVER_S:.0f} s after the connections closed: {errors[-3:]}\n{sc.tail()}"
        assert grown < LOG_GROWTH_BYTES, f"the log grew by {grown} bytes:\n{sc.tail()}"
        with sc.log.open("rb") as f:
            f.seek(log0)
            said = f.read().decode(errors="replace")
        # capped below the limit, no accept (nor any file the sidecar opens meanwhile) fails for want of one
        assert not any(s in said for s in OUT_OF_FILES), f"the sidecar ran out of descriptors:\n{said[-2000:]}"
    finally:
        sc.stop()
