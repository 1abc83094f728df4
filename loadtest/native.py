"""The load generator's compiled sender: a sidecar's gRPC calls sent on schedule from C++.

On two shared cores the load generator's own CPU is in every latency it reports, and a Python
grpc.aio client costs 0.7-1 ms of CPU per call (docs/benchmarks.md): more than the sidecar's own
stages. A search node calls from a compiled client; `loadtest/native/loadgen.cc` is one, on
gRPC's C core (the library the sidecar's server runs on), so a load test can measure what such a
caller sees. Python still does everything but the sending: it builds the schedule and the
serialized requests, reads the records back and summarizes them exactly as for the Python client
(`loadtest.runner`).

Built on first use into the private per-user cache, `~/.cache/embedcar/native/` (loadtest/native_build.py;
g++ and gRPC's C++ library: Debian's `libgrpc++-dev`, which `make test` installs when it can);
`native_unavailable_reason()` says why it cannot be.
Targets: `sidecar-embed`, `sidecar-stream`, `sidecar-search` with the `+native` suffix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedcar_client.client import embed_request, search_request, status_error, stream_error, timings_of
from embedcar_client.proto import embedcar_pb2 as pb
from inference.errors import Internal, InvalidInput, Unavailable
from inference.grpc_io import for_other_grpc
from loadtest.native_build import BUILD_DIR, build_native
from loadtest.runner import RunConfig, RunResult, Sample, SelfPacedTarget, settled_stats
from loadtest.schedule import arrival_offsets, pacer_report
from loadtest.targets import SidecarEmbedTarget, SidecarSearchTarget, SidecarStreamTarget, Target, Timings

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native" / "loadgen.cc"
API_KEY_ENV = "EMBEDCAR_LOADGEN_API_KEY"
_RECORD = struct.Struct("<qqiI")  # send_lag_ns, latency_ns, code, body length
# Each Python target the sender can stand in for (or a subclass: first match): its gRPC method and
# how the calls go.
_METHODS: dict[type[SidecarEmbedTarget], tuple[str, str]] = {
    SidecarStreamTarget: ("/embedcar.v1.Embedder/Stream", "stream"),
    SidecarSearchTarget: ("/embedcar.v1.Embedder/Search", "unary"),
    SidecarEmbedTarget: ("/embedcar.v1.Embedder/Embed", "unary"),
}

def build_loadgen(build_dir: Path = BUILD_DIR) -> Path:
    """The sender's executable, compiled once per source version (atomically: parallel runs are safe)."""
    return build_native(SOURCE, "embedcar-loadgen", build_dir=build_dir)


def native_unavailable_reason(build_dir: Path = BUILD_DIR) -> str | None:
    """None when the sender builds (or is built) here, else why not."""
    try:
        build_loadgen(build_dir)
    except Unavailable as exc:
        return exc.message
    return None


def sender_for(python: SidecarEmbedTarget) -> tuple[Target, str]:
    """The compiled sender standing in for `python` where it builds, else `python` itself; and which
    client that is, for the report ("native", or "python (why not native)")."""
    why = native_unavailable_reason()
    return (python, f"python ({why})") if why else (NativeTarget(python), "native")


class NativeTarget(SelfPacedTarget):
    """A sidecar gRPC target whose schedule the compiled sender drives.

    Single calls (`call`: probes, the bench's settle step) still go through the Python target it
    wraps, on the same sidecar; `loadtest.runner.run_load` hands whole runs to `run_schedule`.
    """

    def __init__(self, python: SidecarEmbedTarget, *, build_dir: Path = BUILD_DIR) -> None:
        self.python = python
        self.name = python.name
        self.build_dir = build_dir
        self.exe: Path | None = None
        self.method, self.mode = next(m for kind, m in _METHODS.items() if isinstance(python, kind))

    @classmethod
    def wrap(cls, target: Target) -> NativeTarget:
        if not isinstance(target, SidecarEmbedTarget) or not any(isinstance(target, k) for k in _METHODS):
            raise InvalidInput(f"the native client sends the sidecar's gRPC calls to one sidecar: not {target.name} "
                               "(sidecar-embed, sidecar-stream or sidecar-search, one address)")
        return cls(target)

    async def start(self) -> None:
        self.exe = await asyncio.to_thread(build_loadgen, self.build_dir)
        await self.python.start()

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        return await self.python.call(texts, timeout_s=timeout_s)

    async def close(self) -> None:
        await self.python.close()

    async def server_stats(self) -> dict[str, dict[str, int]] | None:
        return await self.python.server_stats()

    def describe(self) -> dict[str, Any]:
        return self.python.describe() | {"client": "native"}

    async def run_schedule(self, texts: Sequence[str], config: RunConfig) -> RunResult:
        return await run_native(self, texts, config)

    # --- the messages, and what comes back ---------------------------------------------------

    def payload(self, index: int, texts: Sequence[str], deadline_ms: float) -> bytes:
        py = self.python
        if isinstance(py, SidecarSearchTarget):
            return search_request(texts, py.k, None, None).SerializeToString()
        req = embed_request(texts, py.float16)
        if self.mode == "stream":  # the id the reply echoes; the sidecar's own deadline for it
            return pb.StreamRequest(id=index + 1, embed=req, timeout_ms=max(1, round(deadline_ms))).SerializeToString()
        return req.SerializeToString()

    def outcome(self, code: int, body: bytes) -> tuple[str, Timings | None, str]:
        """A record's (outcome code, server timings, error message) as the Python target reports them."""
        if code != 0:
            err = status_error(code, body.decode("utf-8", "replace"))
            self.python.observed(err.code, err.message, "")
            return err.code, None, err.message
        reply: Any
        if self.mode == "stream":
            stream = pb.StreamReply.FromString(body)
            if stream.WhichOneof("result") == "error":
                err = stream_error(stream.error)
                self.python.observed(err.code, err.message, "")
                return err.code, None, err.message
            reply = stream.embed
        else:
            reply = (pb.SearchReply if isinstance(self.python, SidecarSearchTarget) else pb.EmbedReply).FromString(body)
        self.python.model = reply.model
        self.python.observed("ok", "", reply.backend)
        return "ok", timings_of(reply.timings), ""


@dataclass(frozen=True, slots=True)
class Record:
    """One request's outcome as the sender saw it (times in ns; latency from its scheduled send)."""

    send_lag_ns: int
    latency_ns: int
    code: int  # gRPC status number, 0 = OK
    body: bytes  # the reply message (OK; on a stream every reply), else the status message


@dataclass(frozen=True, slots=True)
class SenderRun:
    start_ns: int  # when the schedule started, on the time.monotonic_ns() clock
    end_ns: int
    cpu_s: float  # the sender's CPU, and this process's while it waited
    wall_s: float
    records: list[Record]


async def send(exe: Path, address: str, method: str, mode: str, payloads: Sequence[bytes],
               offsets_s: Sequence[float], *, deadline_ms: float = 1000.0, concurrency: int = 256,
               spin_us: float = 50.0, api_key: str | None = None,
               on_start: Callable[[int], None] | None = None) -> SenderRun:
    """Send `payloads[i]` at `offsets_s[i]` after the start on one channel to `address`, `mode`
    "unary" (a call each) or "stream" (messages on one call, each a StreamRequest with id i + 1).
    `on_start(start_ns)` is called once the sender is connected and its schedule set."""
    n = len(payloads)
    if n != len(offsets_s) or mode not in ("unary", "stream"):
        raise InvalidInput("one send time per payload, and mode unary or stream")
    with tempfile.TemporaryDirectory(prefix="embedcar-loadgen-") as tmp:
        req_path, out_path = Path(tmp) / "requests.bin", Path(tmp) / "records.bin"
        with req_path.open("wb") as f:
            for off, body in zip(offsets_s, payloads, strict=True):
                f.write(struct.pack("<QI", round(float(off) * 1e9), len(body)))
                f.write(body)
        env = for_other_grpc(os.environ)
        if api_key:
            env[API_KEY_ENV] = api_key
        cmd = [str(exe), "--target", address, "--method", method, "--mode", mode, "--requests", str(req_path),
               "--out", str(out_path), "--deadline-ms", f"{deadline_ms:g}", "--concurrency", str(concurrency),
               "--spin-us", f"{spin_us:g}"]
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        cpu0 = time.process_time()  # this process's CPU while the sender runs (it mostly waits)
        try:
            first = await asyncio.wait_for(proc.stdout.readline(), 15.0)
            if not first.startswith(b"start "):
                await proc.wait()
                raise Unavailable(f"native load generator did not start: {await _stderr(proc)}")
            start_ns = int(first.split()[1])
            if on_start is not None:
                on_start(start_ns)
            limit = (max(offsets_s) if n else 0.0) + deadline_ms / 1e3 + 30.0
            rest, err = await asyncio.wait_for(proc.communicate(), limit)
            end_ns, cpu = time.monotonic_ns(), time.process_time() - cpu0
        except TimeoutError:
            raise Internal("native load generator did not finish in time") from None
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            raise Unavailable(f"native load generator failed (exit {proc.returncode}): "
                              f"{err.decode(errors='replace').strip()[-400:]}")
        tail = json.loads(rest.decode().strip().splitlines()[-1])
        records = _read_records(out_path.read_bytes(), n)
    return SenderRun(start_ns, end_ns, cpu + float(tail["cpu_s"]), float(tail["wall_s"]), records)


async def run_native(target: NativeTarget, texts: Sequence[str], config: RunConfig) -> RunResult:
    """`loadtest.runner.run_load` for a NativeTarget: the same schedule, samples and result."""
    if target.exe is None:
        raise InvalidInput("start the target before running load on it")
    offsets = arrival_offsets(config.rate, config.warmup_s + config.duration_s, arrivals=config.arrivals,
                              seed=config.seed)
    payloads = [target.payload(i, [texts[(i * config.batch + j) % len(texts)] for j in range(config.batch)],
                               config.deadline_ms) for i in range(len(offsets))]
    stats_before = await target.server_stats() if config.warmup_s == 0 else None
    snaps: list[asyncio.Task[dict[str, dict[str, int]] | None]] = []

    def window_starts(start_ns: int) -> None:  # the window's "before" statistics, read as it begins
        if config.warmup_s > 0:
            snaps.append(asyncio.create_task(_stats_at(target, start_ns + round(config.warmup_s * 1e9))))

    # The sender's own spin before each send: a timer wakes ~50 us late, not the event loop's ~1 ms.
    run = await send(target.exe, target.python.grpc_target, target.method, target.mode, payloads, offsets.tolist(),
                     deadline_ms=config.deadline_ms, concurrency=config.concurrency,
                     spin_us=min(config.spin_ms * 1e3, 50.0), api_key=target.python.api_key,
                     on_start=window_starts)
    if snaps:
        stats_before = await snaps[0]
    stats_after = await settled_stats(target)
    samples: list[Sample] = []
    errors_seen: dict[str, str] = {}
    lags = np.zeros(len(offsets))
    for i, r in enumerate(run.records):
        outcome, timings, message = target.outcome(r.code, r.body)
        if message:
            errors_seen.setdefault(outcome, message[:300])
        off = float(offsets[i]) - config.warmup_s
        lags[i] = max(r.send_lag_ns, 0) / 1e9
        samples.append(Sample(i, off, r.send_lag_ns / 1e9, r.latency_ns / 1e9, outcome, off < 0, timings, message))
    pacer = pacer_report(lags[offsets >= config.warmup_s], late_ms=config.late_ms)
    window = (run.start_ns + round(config.warmup_s * 1e9), run.end_ns)
    return RunResult(target.describe(), config, samples, pacer, run.wall_s, run.cpu_s, stats_before,
                     stats_after, errors_seen, window)


def _read_records(data: bytes, n: int) -> list[Record]:
    out: list[Record] = []
    pos = 0
    for _ in range(n):
        if pos + _RECORD.size > len(data):
            raise Internal(f"native load generator wrote {len(out)} of {n} records")
        lag, latency, code, length = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        out.append(Record(lag, latency, code, data[pos:pos + length]))
        pos += length
    return out


async def _stats_at(target: Target, at_ns: int) -> dict[str, dict[str, int]] | None:
    await asyncio.sleep(max(at_ns - time.monotonic_ns(), 0) / 1e9)
    return await target.server_stats()


async def _stderr(proc: asyncio.subprocess.Process) -> str:
    if proc.stderr is None:
        return ""
    return (await proc.stderr.read()).decode(errors="replace").strip()[-400:]
