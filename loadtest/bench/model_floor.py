"""The floor of every bench: the model alone, in its own process, with the served settings.

A floor measured inside the load generator's process pays for that process: its event loop, its
pacer's spinning and its other threads share the cores with the model. On a Zen 4 host int8 read
P50 5.00 / P95 6.28 ms there, and 2.80 / 4.09 ms called in a plain loop on its own, so every server
looked closer to the model than it is. Here a child process (`python -m
loadtest.bench.model_floor`: a fresh interpreter, pickles on its stdin and stdout) holds only the
tokenizer and the backend as the sidecar builds it (`FloorSpec.served`: the variant, the ORT
threads and their choice at load, the lanes; the torch backend's device, precision and CUDA
graphs). Per block it receives the requests and their arrival offsets and keeps that open-loop
schedule itself: it sleeps to each arrival (no spinning), runs one request at a time (one that
arrives while the model is busy waits, as in a one-lane server), pads each to its exact length (the
backends trim), and times each from its scheduled arrival with time.perf_counter; it sends back the
latencies and its own CPU over the block (getrusage RUSAGE_SELF). Nothing else runs in it: no
asyncio, no gRPC, no server.

`ModelFloor` is the child's blocking handle (`bench neighbour`'s model rows and model blocks);
`FloorTarget` drives it as a load-test target whose runs `loadtest.runner.run_load` hands over
whole (`bench serving`'s and `bench gpu`'s floors).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from inference.errors import ERROR_CODES, DeadlineExceeded, EmbedcarError, Internal, Unavailable
from loadtest.runner import RunConfig, RunResult, Sample, SelfPacedTarget
from loadtest.schedule import arrival_offsets, pacer_report
from loadtest.targets import Timings

if TYPE_CHECKING:
    from inference.settings import ModelSettings

OK = "ok"
ROOT = Path(__file__).resolve().parents[2]  # where `-m loadtest...` imports from
BACKENDS = ("embedded", "torch")


@dataclass(frozen=True, slots=True)
class FloorSpec:
    """What the child loads: a backend as inference.backends.factory.make_backend builds it."""

    model_dir: Path
    backend: str = "embedded"
    variant: str | None = None
    threads: int = 0  # ORT (torch on a CPU) threads; 0 = every core, or the choice below
    lanes: int = 1
    choose_threads: bool = False  # the embedded backend's one-or-every-core choice at load
    max_batch: int = 256
    graphs: bool = True  # torch on a GPU: CUDA graphs per bucket (False: every pass eager)

    @classmethod
    def served(cls, m: ModelSettings, *, backend: str = "embedded", variant: str | None = None,
               graphs: bool = True) -> FloorSpec:
        """The backend the sidecar serves from these model settings (its query path, not a batch job)."""
        return cls(m.model_dir, backend, variant or m.variant, m.intra_op_threads, m.forward_lanes,
                   choose_threads=True, max_batch=m.max_texts_per_call, graphs=graphs)


@dataclass(slots=True)
class FloorBlock:
    """One block's records, as the child measured them (seconds; latency from each scheduled arrival)."""

    send_lag_s: list[float]
    latency_s: list[float]
    codes: list[str]
    messages: list[str]
    cpu_s: float  # the child's utime + stime over the block (every thread: ORT's too)
    wall_s: float
    start_ns: int  # the schedule's start on the time.monotonic_ns() clock
    end_ns: int
    pid: int
    errors_seen: dict[str, str] = field(default_factory=dict)

    def ok_latencies_ms(self, first: int = 0) -> list[float]:
        return [x * 1e3 for x, c in zip(self.latency_s[first:], self.codes[first:], strict=True) if c == OK]


# --- the child ------------------------------------------------------------------------------------

def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _load(spec: FloorSpec) -> tuple[Callable[[Sequence[str]], object], dict[str, Any]]:
    """The backend warmed up and one request's whole path (tokenize, pad, forward, pool) -> (embed, facts)."""
    from inference.embedder import load_tokenizer
    from inference.manifest import load_manifest

    manifest = load_manifest(spec.model_dir)
    tokenizer = load_tokenizer(spec.model_dir, manifest)
    backend: Any
    if spec.backend == "embedded":
        from inference.backends.onnx import OnnxBackend

        backend = OnnxBackend(spec.model_dir, manifest, variant=spec.variant, threads=spec.threads, lanes=spec.lanes,
                              max_batch=spec.max_batch, choose_threads=spec.choose_threads)
    else:
        from inference.backends.torch import TorchBackend

        class Eager(TorchBackend):
            """The same backend with every pass run eagerly: what the graphs save."""

            def _capture_all(self, enc: Any) -> None:
                for n in self.length_buckets:
                    self._eager(self._filler(1, n))

        backend = (TorchBackend if spec.graphs else Eager)(spec.model_dir, manifest, variant=spec.variant,
                                                           threads=spec.threads, max_batch=spec.max_batch)
    # Its own start, as the sidecar's: the torch backend captures its CUDA graphs on the worker thread that
    # embed_sync then replays them on. No event loop is left once it has loaded.
    asyncio.run(backend.start())

    def embed(texts: Sequence[str]) -> object:
        return backend.embed_sync(tokenizer.batch(tokenizer.encode(texts).ids))

    facts = {"pid": os.getpid(), "backend": spec.backend, "variant": backend.version_id,
             "threads": getattr(backend, "threads", None), "thread_choice": getattr(backend, "thread_choice", {})}
    return embed, facts


def run_block(embed: Callable[[Sequence[str]], object], requests: Sequence[Sequence[str]],
              offsets_s: Sequence[float], deadline_s: float) -> FloorBlock:
    """`embed` each request at its arrival (open loop, one at a time) -> its records and this process's CPU."""
    clock = time.perf_counter
    n = len(requests)
    lags, lats, codes, messages = [0.0] * n, [0.0] * n, [OK] * n, [""] * n
    seen: dict[str, str] = {}
    cpu0 = _cpu_s()
    start = clock() + 0.01
    start_ns = time.monotonic_ns() + 10_000_000
    free = start  # when the model was last done: waiting behind a request is queueing, not lag
    for i, (texts, off) in enumerate(zip(requests, offsets_s, strict=True)):
        due = start + off
        if (wait := due - clock()) > 0:
            time.sleep(wait)
        sent = clock()
        lags[i] = max(0.0, sent - max(due, free))
        if sent - due >= deadline_s:
            codes[i], messages[i] = DeadlineExceeded.code, "waited out its deadline behind the queries before it"
        else:
            try:
                embed(texts)
            except EmbedcarError as exc:
                codes[i], messages[i] = exc.code, exc.message
        free = clock()
        lats[i] = free - due
        if codes[i] == OK and lats[i] > deadline_s:  # a server would have given up on it
            codes[i], messages[i] = DeadlineExceeded.code, "answered after its deadline"
        if messages[i]:
            seen.setdefault(codes[i], messages[i][:300])
    return FloorBlock(lags, lats, codes, messages, _cpu_s() - cpu0, clock() - start, start_ns, time.monotonic_ns(),
                      os.getpid(), seen)


def main() -> None:
    """The child: `python -m loadtest.bench.model_floor`, pickled messages on stdin and stdout."""
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the channel
    inbox = sys.stdin.buffer
    spec: FloorSpec = pickle.load(inbox)
    try:
        embed, facts = _load(spec)
    except Exception as exc:  # said to the parent, which raises it there
        _send(channel, {"error": f"{type(exc).__name__}: {exc}"[:500]})
        return
    _send(channel, facts)
    while (msg := pickle.load(inbox)) is not None:
        requests, offsets, deadline_s = msg
        _send(channel, run_block(embed, requests, offsets, deadline_s))


def _send(channel: IO[bytes], obj: object) -> None:
    pickle.dump(obj, channel, protocol=pickle.HIGHEST_PROTOCOL)
    channel.flush()


# --- the parent's handle --------------------------------------------------------------------------

class ModelFloor:
    """The floor's child process: `start()`, then `run()` blocks of requests on their schedule."""

    def __init__(self, spec: FloorSpec, *, startup_timeout_s: float = 300.0) -> None:
        if spec.backend not in BACKENDS:
            raise Unavailable(f"no floor for backend {spec.backend!r}: one of {', '.join(BACKENDS)}")
        self.spec = spec
        self.startup_timeout_s = startup_timeout_s
        self.facts: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one block at a time on the pipe

    @property
    def pid(self) -> int | None:
        return self.facts.get("pid")

    @property
    def threads(self) -> int | None:
        return self.facts.get("threads")

    def start(self) -> ModelFloor:
        if self._proc is not None:
            return self
        # A fresh interpreter on this module alone: none of the bench's threads, loop, imports or ORT state.
        self._proc = subprocess.Popen([sys.executable, "-m", "loadtest.bench.model_floor"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=_env())
        assert self._proc.stdin is not None and self._proc.stdout is not None
        _send(self._proc.stdin, self.spec)
        ready, _, _ = select.select([self._proc.stdout], [], [], self.startup_timeout_s)
        if not ready:
            self.close()
            raise Unavailable(f"the model floor did not load within {self.startup_timeout_s:g} s")
        try:
            got = pickle.load(self._proc.stdout)
        except EOFError:
            self.close()
            raise Unavailable("the model floor's process ended while loading (its error is on stderr)") from None
        if "error" in got:
            self.close()
            raise Unavailable(f"the model floor could not load: {got['error']}")
        self.facts = got
        return self

    def run(self, requests: Sequence[Sequence[str]], offsets_s: Sequence[float], *,
            deadline_s: float = 1.0) -> FloorBlock:
        """Send `requests[i]` at `offsets_s[i]` after the block's start; wait for the child's records."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.stdin is None or proc.stdout is None:
                raise Unavailable("start the model floor before running it")
            try:
                _send(proc.stdin, ([list(r) for r in requests], [float(x) for x in offsets_s], deadline_s))
                block: FloorBlock = pickle.load(proc.stdout)
            except (EOFError, BrokenPipeError):
                raise Unavailable("the model floor's process ended during a block") from None
            return block

    def at_rate(self, requests: Sequence[Sequence[str]], rate: float, *, deadline_s: float = 1.0) -> FloorBlock:
        """`run` on a constant-rate schedule."""
        return self.run(requests, (np.arange(len(requests)) / rate).tolist(), deadline_s=deadline_s)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None and proc.stdout is not None
        with contextlib.suppress(OSError):  # a child that already ended
            _send(proc.stdin, None)
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()

    def __enter__(self) -> ModelFloor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _env() -> dict[str, str]:
    """This environment, with this checkout first on the child's import path (the caller's cwd kept)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def _error(code: str, message: str) -> EmbedcarError:
    cls = next((c for c in ERROR_CODES if c.code == code), Internal)
    return cls(message)


class FloorTarget(SelfPacedTarget):
    """The model floor as a load-test target: whole runs go to its child's own clock; single calls
    (the serving bench's settle probes) are one-request blocks."""

    name = "model-floor"

    def __init__(self, spec: FloorSpec, *, startup_timeout_s: float = 300.0) -> None:
        self.floor = ModelFloor(spec, startup_timeout_s=startup_timeout_s)
        self.last_cpu_s: float | None = None
        self.last_requests = 0

    @classmethod
    def for_model(cls, m: ModelSettings, variant: str | None = None) -> FloorTarget:
        """The embedded backend as the sidecar serves it from these model settings."""
        return cls(FloorSpec.served(m, variant=variant))

    async def start(self) -> None:
        await asyncio.to_thread(self.floor.start)

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        block = await asyncio.to_thread(self.floor.run, [texts], [0.0], deadline_s=timeout_s)
        if block.codes[0] != OK:
            raise _error(block.codes[0], block.messages[0])
        return None

    async def close(self) -> None:
        await asyncio.to_thread(self.floor.close)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target": self.name, "where": "the model alone in its own process",
                               "model": self.floor.facts.get("variant", ""), **self.floor.facts}
        if self.last_cpu_s is not None and self.last_requests:
            out |= {"cpu_s": self.last_cpu_s, "cpu_ms_per_query": self.last_cpu_s * 1e3 / self.last_requests}
        return out

    async def run_schedule(self, texts: Sequence[str], config: RunConfig) -> RunResult:
        offsets = arrival_offsets(config.rate, config.warmup_s + config.duration_s, arrivals=config.arrivals,
                                  seed=config.seed)
        requests = [[texts[(i * config.batch + j) % len(texts)] for j in range(config.batch)]
                    for i in range(len(offsets))]
        block = await asyncio.to_thread(self.floor.run, requests, offsets.tolist(), deadline_s=config.deadline_ms / 1e3)
        self.last_cpu_s, self.last_requests = block.cpu_s, len(requests)
        samples = []
        for i, off in enumerate(offsets):
            at = float(off) - config.warmup_s
            samples.append(Sample(i, at, block.send_lag_s[i], block.latency_s[i], block.codes[i], at < 0, None,
                                  block.messages[i]))
        lags = np.asarray(block.send_lag_s)
        pacer = pacer_report(lags[offsets >= config.warmup_s], late_ms=config.late_ms)
        window = (block.start_ns + round(config.warmup_s * 1e9), block.end_ns)
        # The "generator" here is the floor's child: its CPU is the model's, with its sleeps' wake-ups.
        return RunResult(self.describe(), config, samples, pacer, block.wall_s, block.cpu_s, None, None,
                         block.errors_seen, window)


if __name__ == "__main__":
    # Run from the module by its name: what it pickles must name loadtest.bench.model_floor, not __main__.
    from loadtest.bench.model_floor import main as child_main

    child_main()
