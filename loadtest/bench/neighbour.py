"""`embedcar bench neighbour`: what the sidecar costs the search node beside it, per configuration.

One command, one table (neighbour.md), one JSON, one PNG. Per configuration, open loop at --rate
(default 100 requests/s), batch 1, distinct shopper queries (no cache hit), unary gRPC Embed sent by
the compiled sender (loadtest.native; the Python client where it cannot build, the report says):

  quiet    P50/P95 latency and the sidecar's CPU per query: utime + stime of every thread of the
           sidecar process and its children, from /proc (loadtest.proc_cpu), over the measured
           window divided by the requests sent in it; its idle CPU (share of one core) before load.
           The window runs in --pairs blocks, each beside a block of the model alone in its own
           process (loadtest/bench/model_floor.py) with the sidecar's default settings (its
           variant, ORT threads as it chooses them at load, exact lengths, no spinning) at the
           same rate, its CPU from that process's getrusage (ABBA order): this host's speed
           drifts by ±15 % over minutes, more than the 1 ms the sidecar may add, so each row is
           judged against the model blocks of its own minutes ("model beside it"), not model rows
           measured minutes before
  beside   the same run while the neighbour (loadtest/bench/search_node.py: one thread of tantivy + FAISS
           queries over the grocery catalog, like a search engine's core) runs; its queries/s
           against its queries/s alone (measured before the first and after the last configuration)

Configurations (--configs, in this order by default; every embedded one states all its levers, so a
shell's EMBEDCAR_* variables do not leak into them; the levers that lost, and their configurations,
are gone: their figures are in docs/benchmarks.md, and a report of them still renders):

  model-1t, model-2t  the model alone in its own process (loadtest/bench/model_floor.py: no server,
                      no event loop, the same open-loop schedule kept there): tokenize, pad to the
                      exact length, ORT on 1 / all threads without spinning, pool; its CPU per
                      query from that process's getrusage. With --pairs 0, the reference of the
                      verdicts: their lowest CPU per query, and the latency of the one with the
                      lower P50 (the model's best thread setting)
  default             the sidecar as shipped (model settings' defaults; its ORT threads chosen at load)
  every-core          + model.intra_op_threads=<cores>: every pass on every core, not chosen
  event-engine        + GRPC_EXPERIMENTS="" (gRPC's own default I/O: sockets on EventEngine threads,
                      which the sidecar turns off, inference.grpc_io)
  stream              the defaults, each query a message on one open `Stream` call (how a search node
                      that keeps a stream open calls) instead of a unary Embed call
  asyncio-loop        + sidecar.event_loop=asyncio: the standard library's event loop instead of uvloop
  system-malloc       + sidecar.allocator=system: the C library's malloc instead of mimalloc
                      (sidecar/allocator.py; the same as `default` where mimalloc is not installed)
  triton              the sidecar over a local tritonserver (CPU, Python backend); skipped, saying
                      why, where the binary cannot run. Its sidecar CPU excludes tritonserver's
                      (a separate column)
  triton-system-malloc  the `triton` row with sidecar.allocator=system

Verdicts (the neighbour targets; a benchmark, not a gate: exit 0 whatever they say), per sidecar row,
against the model beside it (or, with --pairs 0, the model rows: their lowest CPU per query and the
latency of the faster thread setting):
cpu: CPU per query <= the model's + 1.0 ms (Stream: + 0.6 ms; Triton: <= 1.0 ms); p50: <= the model's best + 1.0 ms;
p95: <= 1.5x the model's best; beside: P95 <= --sla-ms with 0 errors next to the neighbour;
neighbour: its loss of queries/s <= the sidecar's cores beside it + 10 points; idle: < 1 % of a core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inference.errors import EmbedcarError, InvalidInput
from inference.files import atomic_write_text
from inference.grpc_io import EXPERIMENTS, POLLING_IO
from inference.settings import ModelSettings, env_name
from loadtest.bench.model_floor import OK, FloorSpec, ModelFloor
from loadtest.bench.search_node import Neighbour, NeighbourData, prepare_data
from loadtest.proc_cpu import CpuMeter
from loadtest.report import fmt_ms, save_png, summarize
from loadtest.runner import RunConfig, run_load
from sidecar.settings import Settings, SidecarSettings

log = logging.getLogger(__name__)
Record = dict[str, Any]

# The embedded path's levers this bench compares: ("section.field", value) per configuration.
LEVERS = ("model.intra_op_threads", "sidecar.allocator", "sidecar.event_loop")
SYSTEM_MALLOC: dict[str, object] = {"sidecar.allocator": "system"}
EMBEDDED: dict[str, dict[str, object]] = {
    "default": {},
    "every-core": {"model.intra_op_threads": os.cpu_count() or 1},
    "event-engine": {EXPERIMENTS: ""},
    "stream": {},  # the defaults; its calls go on the Stream RPC (STREAMED)
    "asyncio-loop": {"sidecar.event_loop": "asyncio"},
    "system-malloc": SYSTEM_MALLOC,
}
MODEL = {"model-1t": 1, "model-2t": 0}  # ORT threads (0 = every core)
# The sidecar over a local tritonserver.
TRITON = {"triton": {}, "triton-system-malloc": SYSTEM_MALLOC}
CONFIGS = (*MODEL, *EMBEDDED, *TRITON)
DEFAULT_CONFIGS = ("model-1t", "model-2t", "default", "every-core", "event-engine", "stream", "asyncio-loop",
                   "system-malloc", "triton", "triton-system-malloc")
STREAMED = {"stream"}  # configurations whose queries are messages on one open Stream call
DESCRIPTIONS = {
    "model-1t": "the model alone in its own process, 1 thread, exact lengths",
    "model-2t": "the model alone in its own process, all threads, exact lengths",
    "default": "sidecar, embedded, the defaults",
    "every-core": "sidecar, embedded, ORT on every core (the default before the threads were chosen)",
    "event-engine": "sidecar, embedded, gRPC's sockets on its EventEngine threads",
    "stream": "sidecar, embedded, the defaults, queries as Stream messages",
    "asyncio-loop": "sidecar, embedded, asyncio's event loop (not uvloop)",
    "system-malloc": "sidecar, embedded, the C library's malloc (not mimalloc)",
    "triton": "sidecar, Triton backend (CPU)",
    "triton-system-malloc": "sidecar, Triton backend (CPU), the C library's malloc (not mimalloc)",
}
CPU_MARGIN_MS = 1.0  # unary gRPC: the sidecar may add this much CPU per query to the model's own
STREAM_CPU_MARGIN_MS = 0.6  # a message on an open Stream call: no call to set up per query
P50_MARGIN_MS = 1.0
P95_FACTOR = 1.5
TRITON_CPU_MS = 1.0
NEIGHBOUR_SLACK = 0.10
IDLE_MAX = 0.01


@dataclass(frozen=True, slots=True)
class NeighbourConfig:
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    rate: float = 100.0
    duration_s: float = 20.0
    warmup_s: float = 3.0
    # CPU is counted in 10-ms ticks: 10 s tells 0.1 % of a core apart (3 s only 0.33 %, coarse for a 1 % line).
    idle_s: float = 10.0
    sla_ms: float = 20.0
    deadline_ms: float = 1000.0
    seed: int = 0
    pairs: int = 4  # quiet-window blocks of each sidecar row, each beside a block of the model alone (0 = none)
    neighbour: bool = True
    items: int = 50_000
    embedded_items: int = 1024
    data_dir: Path = Path("var/bench/neighbour/data")
    log_dir: Path = Path("var/bench/neighbour")

    def validate(self) -> NeighbourConfig:
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown:
            raise InvalidInput(f"unknown configuration(s) {', '.join(unknown)}; expected some of {', '.join(CONFIGS)}")
        if not self.configs:
            raise InvalidInput("no configuration to measure")
        if self.idle_s < 0 or self.items < 1 or not 1 <= self.embedded_items <= self.items or self.pairs < 0:
            raise InvalidInput("idle time and pairs not negative; 1 <= embedded items <= items")
        self.run_config(self.duration_s).validate()
        return self

    def run_config(self, duration_s: float) -> RunConfig:
        return RunConfig(rate=self.rate, duration_s=duration_s, warmup_s=0.0, deadline_ms=self.deadline_ms,
                         seed=self.seed)

    def to_json(self) -> Record:
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}


def embedded_env(config: str) -> dict[str, str]:
    """The environment of a sidecar configuration: every lever stated (defaults from the settings
    classes and inference.grpc_io), as EMBEDCAR_* and GRPC_EXPERIMENTS."""
    defaults = {"model": ModelSettings(), "sidecar": SidecarSettings()}
    values: dict[str, object] = {lever: getattr(defaults[lever.partition(".")[0]], lever.partition(".")[2])
                                 for lever in LEVERS}
    values[EXPERIMENTS] = POLLING_IO
    values |= EMBEDDED.get(config) or TRITON.get(config) or {}
    return {(k if k == EXPERIMENTS else env_name(*k.split("."))): (str(v).lower() if isinstance(v, bool) else str(v))
            for k, v in values.items()}


# --- measuring ------------------------------------------------------------------------------------

@dataclass(slots=True)
class Tally:
    """One window's raw figures (blocks of a window add up): latencies of the answered, CPU seconds."""

    lat_ms: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    server_cpu_s: float | None = None  # tritonserver's, where one runs
    errors_by_code: dict[str, int] = field(default_factory=dict)
    generator_cpu_s: float = 0.0

    def add(self, other: Tally) -> Tally:
        self.lat_ms += other.lat_ms
        self.errors += other.errors
        self.requests += other.requests
        self.cpu_s += other.cpu_s
        self.wall_s += other.wall_s
        if other.server_cpu_s is not None:
            self.server_cpu_s = (self.server_cpu_s or 0.0) + other.server_cpu_s
        for code, n in other.errors_by_code.items():
            self.errors_by_code[code] = self.errors_by_code.get(code, 0) + n
        self.generator_cpu_s += other.generator_cpu_s
        return self

    def figures(self) -> Record:
        a = np.asarray(self.lat_ms, dtype=np.float64)
        n = self.requests
        return {
            "requests": n, "errors": self.errors,
            "p50": float(np.percentile(a, 50)) if a.size else None,
            "p95": float(np.percentile(a, 95)) if a.size else None,
            "p99": float(np.percentile(a, 99)) if a.size else None,
            "cpu_ms_per_query": self.cpu_s * 1e3 / n if n else None,
            "cores": self.cpu_s / self.wall_s if self.wall_s > 0 else None,
            "server_cpu_ms_per_query": None if self.server_cpu_s is None or not n else self.server_cpu_s * 1e3 / n,
            "wall_s": self.wall_s,
            "errors_by_code": dict(self.errors_by_code),
            "generator_cpu_ms_per_query": self.generator_cpu_s * 1e3 / max(1, n),
        }


def model_tally(floor: ModelFloor, texts: Sequence[str], rate: float, deadline_s: float = 1.0) -> Tally:
    """`texts` one at a time on a constant-rate schedule kept by the floor's own process -> latency and
    that process's CPU (the bench's own never counts)."""
    block = floor.at_rate([[t] for t in texts], rate, deadline_s=deadline_s)
    lat = block.ok_latencies_ms()
    errors: dict[str, int] = {}
    for code in block.codes:
        if code != OK:
            errors[code] = errors.get(code, 0) + 1
    return Tally(lat, len(texts) - len(lat), len(texts), block.cpu_s, block.wall_s, errors_by_code=errors)


def model_run(floor: ModelFloor, texts: Sequence[str], rate: float, deadline_s: float = 1.0) -> Record:
    return model_tally(floor, texts, rate, deadline_s).figures()


class Window:
    """The neighbour's queries over one window (None without a neighbour)."""

    def __init__(self, neighbour: Neighbour | None, run: bool) -> None:
        self.neighbour = neighbour if run else None
        self.qps: float | None = None

    def __enter__(self) -> Window:
        if self.neighbour is not None:
            self.neighbour.resume()
            time.sleep(0.2)  # it is running before the window opens
            self._n0, self._t0 = self.neighbour.queries(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.neighbour is not None:
            self.qps = (self.neighbour.queries() - self._n0) / (time.perf_counter() - self._t0)
            self.neighbour.pause()


def neighbour_alone(neighbour: Neighbour, seconds: float) -> float:
    with Window(neighbour, True) as w:
        time.sleep(seconds)
    assert w.qps is not None
    return w.qps


def measure_model(settings: Settings, cfg: NeighbourConfig, name: str, next_texts: Callable[[int], list[str]],
                  neighbour: Neighbour | None) -> Record:
    m = settings.model
    spec = FloorSpec(m.model_dir, variant=m.variant, threads=MODEL[name], max_batch=m.max_texts_per_call)
    n = int(cfg.rate * cfg.duration_s)
    deadline_s = cfg.deadline_ms / 1e3
    with ModelFloor(spec) as model:
        model_run(model, next_texts(int(cfg.rate * cfg.warmup_s) or 1), cfg.rate, deadline_s)
        quiet = model_run(model, next_texts(n), cfg.rate, deadline_s)
        beside: Record | None = None
        if neighbour is not None:
            with Window(neighbour, True) as w:
                beside = model_run(model, next_texts(n), cfg.rate, deadline_s)
            beside["neighbour_qps"] = w.qps
    return {"config": name, "kind": "model", "threads": model.threads, "pid": model.pid, "quiet": quiet,
            "beside": beside}


async def _load(target: Any, texts: list[str], cfg: RunConfig, meter: CpuMeter) -> Tally:
    meter.start()
    result = await run_load(target, texts, cfg)
    cpu = meter.stop()
    summary = summarize(result, name="neighbour", max_error_share=0.0)
    lat = [s.latency_s * 1e3 for s in result.measured if s.code == "ok"]
    return Tally(lat, len(result.measured) - len(lat), len(result.measured), cpu["sidecar"], result.wall_s,
                 cpu.get("tritonserver"), dict(summary["errors"]), result.generator_cpu_s)


async def paired_windows(target: Any, next_texts: Callable[[int], list[str]], cfg: NeighbourConfig,
                         meter: CpuMeter, model: ModelFloor | None) -> tuple[Tally, Tally | None]:
    """The quiet window in `cfg.pairs` blocks, each beside a block of the model alone in its own process at
    the same rate,
    in ABBA order (model, sidecar, sidecar, model, ...): the host's drift over minutes (±15 % here)
    falls on both alike, so the sidecar's cost over the model is read from blocks minutes apart at most."""
    blocks = max(1, cfg.pairs if model is not None else 1)
    n = max(1, int(cfg.rate * cfg.duration_s) // blocks)
    run = cfg.run_config(n / cfg.rate)
    sidecar, alone = Tally(), Tally() if model is not None else None
    for i in range(blocks):
        for step in (("model", "sidecar") if i % 2 == 0 else ("sidecar", "model")):
            if step == "sidecar":
                sidecar.add(await _load(target, next_texts(n), run, meter))
            elif model is not None and alone is not None:
                alone.add(await asyncio.to_thread(model_tally, model, next_texts(n), cfg.rate, cfg.deadline_ms / 1e3))
    return sidecar, alone


def measure_sidecar(settings: Settings, cfg: NeighbourConfig, name: str, next_texts: Callable[[int], list[str]],
                    neighbour: Neighbour | None, model: ModelFloor | None = None) -> Record:
    from loadtest.native import sender_for
    from loadtest.stack import SidecarProcess
    from loadtest.targets import SidecarEmbedTarget, SidecarStreamTarget

    variant = settings.model.variant
    logs = cfg.log_dir
    logs.mkdir(parents=True, exist_ok=True)
    rec: Record = {"config": name, "kind": "triton" if name in TRITON else "embedded",
                   "rpc": "stream" if name in STREAMED else "unary"}
    with contextlib.ExitStack() as stack:
        pids: dict[str, int] = {}
        triton_url = None
        env = embedded_env(name)  # a Triton sidecar's fallback model, when it loads one, as shipped
        if name in TRITON:
            from inference.triton.launcher import TritonServer, triton_unavailable_reason

            if reason := triton_unavailable_reason():
                return rec | {"skipped": reason}
            server = stack.enter_context(TritonServer(settings, variant=variant,
                                                      log_file=logs / f"tritonserver-{variant}.log"))
            triton_url = server.grpc_url
            if server.pid is not None:
                pids["tritonserver"] = server.pid
        rec["env"] = env
        sc = stack.enter_context(SidecarProcess(settings, backend="triton" if triton_url else "embedded",
                                                variant=variant, triton_url=triton_url, http=False, extra_env=env,
                                                log_file=logs / f"sidecar-{name}-{variant}.log"))
        assert sc.pid is not None
        pids["sidecar"] = sc.pid
        meter = CpuMeter(pids)
        time.sleep(1.0)  # start-up's own work done
        meter.start()
        time.sleep(cfg.idle_s)
        idle = meter.stop()
        rec["idle_core_share"] = idle["sidecar"] / cfg.idle_s if cfg.idle_s else None

        async def runs() -> None:
            # From a compiled client, as a search node calls: a Python one would spend 0.7-1 ms of the
            # same two cores per call (loadtest.native) and add its own latency to the sidecar's.
            rpc = SidecarStreamTarget if name in STREAMED else SidecarEmbedTarget
            target, rec["client"] = sender_for(rpc(sc.grpc_target))
            await target.start()
            try:
                n = int(cfg.rate * cfg.duration_s)
                await run_load(target, next_texts(int(cfg.rate * cfg.warmup_s) or 1), cfg.run_config(cfg.warmup_s))
                # Triton's row is judged by its own CPU: no model blocks beside it.
                quiet, alone = await paired_windows(target, next_texts, cfg, meter,
                                                    model if rec["kind"] == "embedded" else None)
                rec["quiet"] = quiet.figures()
                if alone is not None and model is not None:
                    rec["model_paired"] = alone.figures() | {"threads": model.threads, "pid": model.pid}
                rec["beside"] = None
                if neighbour is not None:
                    with Window(neighbour, True) as w:
                        beside = await _load(target, next_texts(n), cfg.run_config(cfg.duration_s), meter)
                    rec["beside"] = beside.figures() | {"neighbour_qps": w.qps}
            finally:
                await target.close()

        asyncio.run(runs())
    return rec


# --- the table ------------------------------------------------------------------------------------

def _client(result: Record) -> str:
    """Who sent the sidecar rows' calls: the compiled sender, or the Python client and why."""
    clients = sorted({r["client"] for r in result.get("rows", []) if r.get("client")})
    return f" sent by the {' / '.join(clients)} client" if clients else ""


def reference(result: Record) -> Record:
    """The model's own figures: its lowest CPU per query, and the latency of its lower-P50 thread setting."""
    models = [r for r in result["rows"] if r["kind"] == "model" and not r.get("skipped") and r["quiet"]["p50"]]
    if not models:
        return {}
    best = min(models, key=lambda r: r["quiet"]["p50"])
    return {"cpu_ms": min(r["quiet"]["cpu_ms_per_query"] for r in models), "p50": best["quiet"]["p50"],
            "p95": best["quiet"]["p95"], "latency_from": best["config"]}


def row_reference(row: Record, ref: Record) -> Record:
    """What `row` is judged against: the model's blocks interleaved with its own (same minutes), else `ref`."""
    paired = row.get("model_paired")
    if paired and paired.get("p50") is not None and paired.get("cpu_ms_per_query") is not None:
        return {"cpu_ms": paired["cpu_ms_per_query"], "p50": paired["p50"], "p95": paired["p95"],
                "latency_from": "paired"}
    return ref


def neighbour_baseline(result: Record) -> float | None:
    alone = [x for x in result.get("neighbour_alone", []) if x]
    return float(np.mean(alone)) if alone else None


def checks(row: Record, ref: Record, alone_qps: float | None, sla_ms: float) -> dict[str, bool]:
    """Issue #25's targets that apply to `row` -> name: met (a check whose inputs are missing is left out).
    `ref` is the run's model reference; a row with its own interleaved model blocks is judged by those."""
    if row["kind"] == "model" or row.get("skipped"):
        return {}
    ref = row_reference(row, ref)
    q, b = row["quiet"], row.get("beside")
    out: dict[str, bool] = {}
    cpu = q["cpu_ms_per_query"]
    if row["kind"] == "triton":
        out["cpu"] = cpu <= TRITON_CPU_MS
    elif ref:
        out["cpu"] = cpu <= ref["cpu_ms"] + (STREAM_CPU_MARGIN_MS if row.get("rpc") == "stream" else CPU_MARGIN_MS)
        if q["p50"] is not None and q["p95"] is not None:
            out["p50"] = q["p50"] <= ref["p50"] + P50_MARGIN_MS
            out["p95"] = q["p95"] <= P95_FACTOR * ref["p95"]
    if b is not None:
        out["beside"] = b["p95"] is not None and b["p95"] <= sla_ms and b["errors"] == 0
        if alone_qps and b.get("neighbour_qps") is not None and b.get("cores") is not None:
            out["neighbour"] = neighbour_loss(alone_qps, b["neighbour_qps"]) <= b["cores"] + NEIGHBOUR_SLACK
    if row.get("idle_core_share") is not None:
        out["idle"] = row["idle_core_share"] < IDLE_MAX
    return out


def neighbour_loss(alone: float, beside: float) -> float:
    return 1.0 - beside / alone


def table_rows(result: Record) -> list[Record]:
    ref = reference(result)
    alone = neighbour_baseline(result)
    sla = float(result.get("config", {}).get("sla_ms", 20.0))
    out = []
    for row in result["rows"]:
        c = checks(row, ref, alone, sla)
        b = row.get("beside") or {}
        nq = b.get("neighbour_qps")
        out.append(row | {
            "checks": c, "failed": [k for k, ok in c.items() if not ok],
            "neighbour_loss": neighbour_loss(alone, nq) if alone and nq is not None else None,
        })
    return out


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def markdown(result: Record) -> str:
    cfg = result.get("config", {})
    m = result.get("machine", {})
    ref = reference(result)
    alone = result.get("neighbour_alone", [])
    lines = [
        "# A good neighbour: the sidecar's CPU per query and the search node beside it",
        "",
        f"{result.get('date', '?')} · commit `{result.get('commit') or '?'}` · {m.get('cpu', '?')}, "
        f"{m.get('cpus_usable', '?')} CPUs · model {result.get('model', '?')} {result.get('variant', '?')}",
        "",
        f"Command: `{result.get('command', '?')}`",
        "",
        f"Open loop {cfg.get('rate', 0):g} requests/s, batch 1, distinct shopper queries (no cache hits), unary "
        f"gRPC Embed calls (Stream messages on one open call where the row says so){_client(result)}; "
        f"{cfg.get('duration_s', 0):g} s measured per window after "
        f"{cfg.get('warmup_s', 0):g} s of "
        "warm-up. CPU per query: utime + stime of every thread of the sidecar (and its children) from /proc over "
        "the window, per request sent; cores = that CPU over the window. "
        + "Model rows and blocks: the model alone in its own process (no server, no event loop; it keeps the "
        "same open-loop schedule itself), their CPU per query from that process's getrusage. "
        + (f"Each sidecar row's quiet window ran in {cfg.get('pairs')} blocks interleaved with blocks of the model "
           "alone (the sidecar's default settings, ABBA order): its verdicts compare it with those blocks "
           "(\"model beside it\"), not with model rows measured minutes apart on a host that drifts. "
           if cfg.get("pairs") else "")
        + "Beside: the same load while the "
        "neighbour (one thread of tantivy + FAISS queries over the grocery catalog) runs.",
        "",
        "Neighbour alone: " + (", ".join(f"{x:.0f}" for x in alone if x) + " queries/s (before, after)"
                               if any(alone) else "not run") + ".",
        "",
    ]
    if ref:
        lines += [f"Model reference (same run): CPU {ref['cpu_ms']:.2f} ms per query (lowest of the model rows); "
                  f"latency of {ref['latency_from']}: P50 {ref['p50']:.2f} ms, P95 {ref['p95']:.2f} ms.", ""]
    lines += [
        "| configuration | P50 ms | P95 ms | errors | CPU ms / query | model beside it: CPU / P50 ms "
        "| CPU over model ms | cores | idle % core "
        "| Triton CPU ms / query | P95 beside ms | errors beside | neighbour q/s beside | neighbour loss | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in table_rows(result):
        name = f"{r['config']} ({DESCRIPTIONS.get(r['config'], '')})"
        if r.get("skipped"):
            lines.append(f"| {name} | skipped: {r['skipped']} |" + " – |" * 13)
            continue
        q, b = r["quiet"], r.get("beside") or {}
        idle = r.get("idle_core_share")
        verdict = ("reference" if r["kind"] == "model" else
                   "pass" if not r["failed"] else "fails " + ", ".join(r["failed"]))
        loss = r["neighbour_loss"]
        own = row_reference(r, ref) if r["kind"] == "embedded" else {}  # Triton's target is its own CPU
        over = q["cpu_ms_per_query"] - own["cpu_ms"] if own and q["cpu_ms_per_query"] is not None else None
        mp = r.get("model_paired") or {}
        paired = f"{_f(mp.get('cpu_ms_per_query'))} / {fmt_ms(mp.get('p50'))}" if mp else "–"
        lines.append(
            f"| {name} | {fmt_ms(q['p50'])} | {fmt_ms(q['p95'])} | {q['errors']} | {_f(q['cpu_ms_per_query'])} "
            f"| {paired} | {_f(over, '+.2f')} | {_f(q['cores'])} | {_f(None if idle is None else idle * 100, '.1f')} "
            f"| {_f(q.get('server_cpu_ms_per_query'))} | {fmt_ms(b.get('p95'))} | {b.get('errors', '–')} "
            f"| {_f(b.get('neighbour_qps'), '.0f')} | {'–' if loss is None else f'{loss * 100:+.1f} %'} "
            f"| {verdict} |")
    lines += [
        "",
        f"Verdicts (the targets): cpu ≤ model + {CPU_MARGIN_MS:g} ms (Stream: + {STREAM_CPU_MARGIN_MS:g} ms; "
        f"Triton: sidecar ≤ {TRITON_CPU_MS:g} ms); "
        f"p50 ≤ model + {P50_MARGIN_MS:g} ms; p95 ≤ {P95_FACTOR:g}× model; beside: P95 ≤ {cfg.get('sla_ms', 20):g} ms, "
        f"0 errors; neighbour: loss ≤ the sidecar's cores beside it + {NEIGHBOUR_SLACK * 100:g} points; "
        f"idle < {IDLE_MAX * 100:g} % of a core.",
    ]
    if not result.get("complete", True):
        lines += ["", "**Incomplete run**: the figures so far."]
    return "\n".join(lines) + "\n"


def write_png(result: Record, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table_rows(result) if not r.get("skipped")]
    names = [r["config"] for r in rows]
    x = np.arange(len(rows))
    colors = ["black" if r["kind"] == "model" else "tab:purple" if r["kind"] == "triton" else "tab:blue"
              for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5), constrained_layout=True)

    def val(r: Record, phase: str, key: str) -> float:
        v = (r.get(phase) or {}).get(key)
        return float("nan") if v is None else float(v)

    ax1.bar(x - 0.2, [val(r, "quiet", "p50") for r in rows], 0.4, color=colors, label="P50")
    ax1.bar(x + 0.2, [val(r, "quiet", "p95") for r in rows], 0.4, color=colors, alpha=0.5, label="P95")
    ax1.set_title("latency (quiet): P50 solid, P95 light", fontsize=10)
    ax1.set_ylabel("ms")
    own = [val(r, "quiet", "cpu_ms_per_query") for r in rows]
    ax2.bar(x, own, color=colors)
    server = [val(r, "quiet", "server_cpu_ms_per_query") for r in rows]  # tritonserver's, on top
    ax2.bar(x, server, bottom=own, color=colors, alpha=0.35, hatch="//")
    paired = [val({"p": r.get("model_paired")}, "p", "cpu_ms_per_query") for r in rows]
    if any(np.isfinite(paired)):
        ax2.scatter(x, paired, marker="_", s=600, color="black", lw=2, zorder=3, label="model beside it")
    tops = [v for v in (*own, *(a + b for a, b in zip(own, server, strict=True)), *paired) if np.isfinite(v)]
    if tops:
        ax2.set_ylim(0, 1.15 * max(tops))
    ref = reference(result)
    if ref:
        ax2.axhline(ref["cpu_ms"], color="black", ls=":", lw=1, label="model rows")
        ax2.axhline(ref["cpu_ms"] + CPU_MARGIN_MS, color="tab:orange", ls="--", lw=1,
                    label=f"model + {CPU_MARGIN_MS:g} ms")
        ax2.legend(fontsize=8)
    ax2.set_title("CPU per query (all threads, /proc; hatched: tritonserver's; –: the model beside it)", fontsize=10)
    ax2.set_ylabel("ms CPU")
    ax3.bar(x, [val(r, "beside", "neighbour_qps") for r in rows], color=colors)
    if (alone := neighbour_baseline(result)) is not None:
        ax3.axhline(alone, color="tab:green", ls="--", lw=1.5, label="neighbour alone")
        ax3.legend(fontsize=8)
    ax3.set_title("neighbour's queries/s beside each", fontsize=10)
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"A good neighbour: {result.get('model', '')} {result.get('variant', '')} at "
                 f"{result.get('config', {}).get('rate', 0):g} req/s · {result.get('date', '')} · "
                 f"{result.get('commit') or ''}", fontsize=10)
    save_png(fig, path)
    plt.close(fig)


def write_reports(result: Record, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "neighbour.json", "md": out_dir / "neighbour.md", "png": out_dir / "neighbour.png"}
    atomic_write_text(paths["json"], json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    atomic_write_text(paths["md"], markdown(result))
    write_png(result, paths["png"])
    return paths


# --- the whole bench ------------------------------------------------------------------------------

def paired_model(settings: Settings) -> ModelFloor:
    """The model the sidecar rows are paired with, in its own process: the embedded backend as the
    `default` row's sidecar builds it (its threads lever as that row states it, chosen at load)."""
    spec = FloorSpec.served(settings.model)
    return ModelFloor(dataclasses.replace(spec, threads=ModelSettings().intra_op_threads)).start()


def run_neighbour(settings: Settings, cfg: NeighbourConfig, *, out_dir: Path,
                  command: str) -> tuple[Record, dict[str, Path]]:
    from inference.embedder import load_tokenizer
    from inference.manifest import load_manifest
    from loadtest.bench.serving import git_commit, machine_info
    from loadtest.queries import QueryMix

    cfg.validate()
    m = settings.model
    manifest = load_manifest(m.model_dir)
    manifest.variant(m.variant)  # an unknown variant fails before anything starts
    mix = QueryMix(load_tokenizer(m.model_dir, manifest), seed=cfg.seed, unique=True)
    result: Record = {
        "name": "neighbour", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": git_commit(),
        "machine": machine_info(), "command": command, "model": manifest.name, "variant": m.variant,
        "config": cfg.to_json(), "neighbour_alone": [], "rows": [], "complete": False,
    }
    with contextlib.ExitStack() as stack:
        neighbour: Neighbour | None = None
        if cfg.neighbour:
            log.info("preparing the neighbour's indexes in %s (once)", cfg.data_dir)
            data: NeighbourData = prepare_data(cfg.data_dir, m.model_dir, m.variant, items=cfg.items,
                                               embedded=cfg.embedded_items, seed=cfg.seed)
            neighbour = stack.enter_context(Neighbour(data))
            neighbour_alone(neighbour, min(2.0, cfg.duration_s))  # caches and page faults out of the way
            result["neighbour_alone"].append(neighbour_alone(neighbour, cfg.duration_s))
            log.info("neighbour alone: %.0f queries/s", result["neighbour_alone"][-1])
        paired: ModelFloor | None = None  # the model beside each sidecar row's blocks, loaded once
        for name in cfg.configs:
            log.info("measuring %s", name)
            try:
                if name in MODEL:
                    row = measure_model(settings, cfg, name, mix.take, neighbour)
                else:
                    if paired is None and cfg.pairs:
                        paired = paired_model(settings)
                        stack.callback(paired.close)
                    row = measure_sidecar(settings, cfg, name, mix.take, neighbour, paired)
            except EmbedcarError as exc:
                row = {"config": name, "kind": "model" if name in MODEL else "embedded",
                       "skipped": f"failed: {exc.message.splitlines()[0][:200]}"}
                log.error("%s: %s", name, exc.message)
            result["rows"].append(row)
            if not row.get("skipped"):
                q = row["quiet"]
                log.info("%s: P50 %s P95 %s ms, CPU %.2f ms per query", name, fmt_ms(q["p50"]), fmt_ms(q["p95"]),
                         q["cpu_ms_per_query"] or 0.0)
        if neighbour is not None:
            result["neighbour_alone"].append(neighbour_alone(neighbour, cfg.duration_s))
    result["complete"] = True
    return result, write_reports(result, out_dir)
