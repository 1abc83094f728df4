"""`embedcar bench triton`: single-query latency through Triton vs the embedded backend vs raw ORT.

For each shape the three paths run in alternating blocks (50 raw ORT calls, 50 Triton, 50
embedded, 50 raw ORT, ...) so slow drifts of the machine hit them alike, while each path runs in
its steady state: call by call interleaving made every path pay for the others (each process
streams its own 90 MB copy of the fp32 weights through the shared L3, and the embedded session's
threads spin on after each call). The first calls of every block settle the caches and are not
counted. Triton's statistics API, read before and after, splits the Triton
time per ensemble step (queue, compute input/infer/output), so the cost of the hop is visible.
Timings are for the machine the command runs on; the report says so.
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from inference.backends.onnx import OnnxBackend
from inference.backends.triton import TritonBackend
from inference.errors import Internal, InvalidInput, Unavailable
from inference.files import atomic_write_text
from inference.manifest import Manifest, load_manifest
from inference.settings import Settings
from inference.tokenizer import TokenBatch
from inference.triton.launcher import TritonServer, triton_unavailable_reason
from inference.triton.names import is_ensemble
from inference.triton.repository import ENCODER_ORT_SPINNING, cpu_sizing
from inference.triton.trace import WHOLE, phase_table, trace_args
from loadtest.bench.triton_shm import SharedMemoryCaller

STEP_KEYS = ("queue", "compute_input", "compute_infer", "compute_output")
SHM_PATH = "triton ensemble, shared memory"  # the same server, tensors in system shared memory
BLOCK = 50  # calls per path before switching to the next path
SETTLE = 5  # first calls of each block, not counted


@dataclass(slots=True)
class PathResult:
    shape: str
    path: str
    p50_ms: float
    p95_ms: float
    p99_ms: float
    n: int


@dataclass(slots=True)
class BenchReport:
    when: str
    host: str
    variant: str
    ort_threads: int
    url: str
    results: list[PathResult] = field(default_factory=list)
    # shape -> model -> step -> mean microseconds per request
    steps_us: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # shape -> (first, last) time.monotonic_ns() of its calls, to pick its requests out of a trace
    windows_ns: dict[str, tuple[int, int]] = field(default_factory=dict)
    # with --trace: shape -> model -> phase -> (P50 µs, P95 µs) from Triton's per-request traces
    phases_us: dict[str, dict[str, dict[str, tuple[float, float]]]] = field(default_factory=dict)

    def markdown(self) -> str:
        lines = [f"Triton hop benchmark, {self.when} on {self.host} (variant {self.variant}, ORT threads "
                 f"{self.ort_threads}, Triton {self.url}); single queries, one at a time. `raw ORT` is a "
                 "session set up like the Triton encoder's; `embedded` is the in-process backend "
                 "(ORT + pooling) as the sidecar runs it.", "",
                 "| shape | path | P50 ms | P95 ms | P99 ms | n |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.shape} | {r.path} | {r.p50_ms:.2f} | {r.p95_ms:.2f} | {r.p99_ms:.2f} | {r.n} |"
                  for r in self.results]
        lines += ["", "Triton overhead over the raw ORT call (the target is <= 1.5 ms at P95):", "",
                  "| shape | P50 +ms | P95 +ms |", "|---|---|---|"]
        by = {(r.shape, r.path): r for r in self.results}
        for shape in dict.fromkeys(r.shape for r in self.results):
            raw, tri = by.get((shape, "raw ORT")), by.get((shape, "triton ensemble"))
            if raw and tri:
                lines.append(f"| {shape} | {tri.p50_ms - raw.p50_ms:+.2f} | {tri.p95_ms - raw.p95_ms:+.2f} |")
        lines += ["", "Where Triton's time goes, mean µs per request (Triton statistics API):", "",
                  "| shape | model | queue | compute input | compute infer | compute output |",
                  "|---|---|---|---|---|---|"]
        for shape, models in self.steps_us.items():
            for model, st in models.items():
                lines.append(f"| {shape} | {model} | " + " | ".join(f"{st.get(k, 0.0):.0f}" for k in STEP_KEYS) + " |")
        if self.phases_us:
            lines += ["", "Per-request phases from Triton's traces, P50 / P95 µs (a traced run: tracing itself "
                      "adds a little), and what is left for the client and the loopback hop:", "",
                      "| shape | model | phase | P50 µs | P95 µs |", "|---|---|---|---|---|"]
            for shape, traced in self.phases_us.items():
                for model, phases in traced.items():
                    for phase, (mid, tail) in phases.items():
                        lines.append(f"| {shape} | {model} | {phase} | {mid:.0f} | {tail:.0f} |")
                ens = next((p for m, p in traced.items() if is_ensemble(m)), {})
                tri, whole = by.get((shape, "triton ensemble")), ens.get(WHOLE)
                if tri is not None and whole is not None:
                    lines.append(f"| {shape} | client | gRPC client + loopback (end to end - server, P50) | "
                                 f"{tri.p50_ms * 1000 - whole[0]:.0f} | |")
        return "\n".join(lines) + "\n"


def _pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1000.0, q))


def encoder_session(path: Path, threads: int, spinning: bool) -> Any:
    """An ORT session set up exactly like the Triton encoder's, so the hop is all that differs."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _query_batch(manifest: Manifest, b: int, n: int) -> TokenBatch:
    rng = np.random.default_rng(n)
    ids = rng.integers(1000, 20000, size=(b, n), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return TokenBatch(ids, np.ones_like(ids), np.zeros_like(ids) if manifest.has_token_type_ids else None)


def _step_delta(before: dict[str, dict[str, float | int]], after: dict[str, dict[str, float | int]]
                ) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for model, a in after.items():
        b = before.get(model, {})
        count = max(int(a.get("success_count", 0)) - int(b.get("success_count", 0)), 1)
        out[model] = {k: (float(a.get(f"{k}_ns", 0)) - float(b.get(f"{k}_ns", 0))) / count / 1000.0
                      for k in STEP_KEYS}
    return out


async def run(settings: Settings, url: str, *, shapes: Sequence[tuple[int, int]] = ((1, 16), (1, 32), (1, 64)),
              reps: int = 300, warmup: int = 30, others: dict[str, str] | None = None,
              shm: bool = False) -> BenchReport:
    """`others`: more Triton servers (path name -> gRPC address) timed in the same blocks, e.g. the
    two-step repository layout next to the fused one; `shm`: also the same server with the tensors
    in system shared memory (path SHM_PATH)."""
    model_dir = settings.model.model_dir
    manifest = load_manifest(model_dir)
    variant = settings.model.variant
    threads = cpu_sizing(settings).ort_threads
    sess = encoder_session(model_dir / manifest.variant(variant).file, threads, ENCODER_ORT_SPINNING)
    onnx_inputs = {i.name for i in sess.get_inputs()}
    embedded = OnnxBackend(model_dir, manifest, variant=variant, threads=threads)
    embedded.warm_up()
    triton = TritonBackend([url], manifest, variant=variant, timeout_s=10.0)
    await triton.start()
    extra: dict[str, TritonBackend | SharedMemoryCaller] = {
        name: TritonBackend([u], manifest, variant=variant, timeout_s=10.0) for name, u in (others or {}).items()}
    if shm:
        extra[SHM_PATH] = SharedMemoryCaller(url, manifest, variant=variant)
    for backend in extra.values():
        await backend.start()
    if shm:
        await _check_same(manifest, triton, extra[SHM_PATH], shapes)
    report = BenchReport(when=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), host=platform.node(),
                         variant=variant, ort_threads=threads, url=url)
    try:
        for b, n in shapes:
            batch = _query_batch(manifest, b, n)
            feed = {k: v for k, v in batch.arrays().items() if k in onnx_inputs}
            times: dict[str, list[float]] = {"raw ORT": [], "triton ensemble": [], **{k: [] for k in extra},
                                             "embedded": []}

            async def call(path: str, batch: TokenBatch = batch, feed: dict[str, Any] = feed) -> None:
                if path == "raw ORT":
                    sess.run(["last_hidden_state"], feed)
                elif path == "embedded":
                    embedded.embed_sync(batch)
                else:
                    await extra.get(path, triton).embed(batch)

            t_start = time.monotonic_ns()
            for path in times:
                for _ in range(warmup):
                    await call(path)
            stats_before = await triton.statistics()
            while min(len(ts) for ts in times.values()) < reps:
                for path, ts in times.items():
                    for j in range(BLOCK):
                        t0 = time.perf_counter()
                        await call(path)
                        if j >= SETTLE and len(ts) < reps:
                            ts.append(time.perf_counter() - t0)
            shape = f"{b}x{n}"
            report.windows_ns[shape] = (t_start, time.monotonic_ns())
            report.steps_us[shape] = _step_delta(stats_before, await triton.statistics())
            for path, ts in times.items():
                report.results.append(PathResult(shape, path, _pct(ts, 50), _pct(ts, 95), _pct(ts, 99), len(ts)))
    finally:
        await triton.close()
        for backend in extra.values():
            await backend.close()
        await embedded.close()
    return report


async def _check_same(manifest: Manifest, wire: TritonBackend, shm: TritonBackend | SharedMemoryCaller,
                      shapes: Sequence[tuple[int, int]]) -> None:
    """Both transports must return the same vectors before either is timed."""
    for b, n in shapes:
        batch = _query_batch(manifest, b, n)
        a, c = await wire.embed(batch), await shm.embed(batch)
        if not np.allclose(a, c, atol=1e-6):
            raise Internal(f"{SHM_PATH} returned other vectors than the gRPC message at {b}x{n}")


def bench(settings: Settings, *, url: str | None, shapes: Sequence[tuple[int, int]], reps: int, warmup: int,
          compare_step: bool = False, trace: Path | None = None, shm: bool = False) -> BenchReport:
    """`run` against `url`, or against a server started here (url None; traced into `trace` if given);
    compare_step: also a server with pooling as its own step (the GPU target's layout), timed alike."""
    servers: list[TritonServer] = []
    others: dict[str, str] = {}
    try:
        if url is None or compare_step:
            reason = triton_unavailable_reason()
            if reason:
                raise Unavailable(reason)
        if url is None:
            servers.append(TritonServer(settings, extra_args=trace_args(trace.resolve()) if trace else ()).start())
            url = servers[-1].grpc_url
        elif trace:
            raise InvalidInput("--trace needs the bench's own server (leave out --url)")
        if compare_step:
            repo = settings.triton.repo_dir
            step = settings.with_section("triton", repo_dir=repo.with_name(repo.name + "-step"))
            servers.append(TritonServer(step, pooling_step=True).start())  # its own free ports
            others["triton two-step"] = servers[-1].grpc_url
        report = asyncio.run(run(settings, url, shapes=shapes, reps=reps, warmup=warmup, others=others, shm=shm))
    finally:
        for server in servers:
            server.stop()
    if trace:
        add_trace(report, trace)  # Triton writes the trace file when it stops
    return report


def add_trace(report: BenchReport, trace_file: Path) -> None:
    """Per shape, the phases of the traced server's requests (read after the server stopped)."""
    for shape, window in report.windows_ns.items():
        report.phases_us[shape] = phase_table(trace_file, window_ns=window)


def save_json(report: BenchReport, path: Path) -> None:
    atomic_write_text(path, json.dumps(asdict(report), indent=2))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        b, _, n = part.strip().partition("x")
        out.append((int(b), int(n)))
    return out
