"""`embedcar bench serving`: every way we serve the model, one query stream, one table, one figure.

Contenders, per ONNX variant (`--variants`, default fp32,int8), all open loop at batch 1 on short
shopper queries that never repeat (QueryMix unique=True: no cache hit anywhere):

  floor     the model alone in its own process with the sidecar's settings (its variant, ORT threads
            as the sidecar chooses them, exact-length padding, no spinning): tokenize + forward +
            pool, no server, keeping the same open-loop schedule itself (loadtest/bench/model_floor.py)
  grpc      the sidecar's gRPC Embed, embedded backend (SidecarProcess backend=embedded)
  stream    the same sidecar process's Embed as messages on one open gRPC Stream call
  grpc-native, stream-native
            the same two, sent by the load generator's compiled C++ sender (loadtest/native.py)
            instead of Python grpc.aio: what a search node's compiled client sees (stream-native
            is in the default --targets; a skipped row, saying why, where gRPC's C++ library
            is missing)
  http      the same sidecar process's HTTP POST /v1/embeddings
  triton    the sidecar's gRPC Embed over the Triton backend (TritonServer + SidecarProcess
            backend=triton); fp32 only unless --triton-variants says more
  infinity  Infinity 0.0.78 serving the same ONNX file over its OpenAI-style HTTP API
            (loadtest/infinity.py, `make infinity`); fp32 only unless --infinity-variants says more

Per variant every server is started once; then:

1. Ceiling: the model's batched throughput here, before any server carries load: OnnxBackend
   with the settings' threads in this process, batches of 32 real queries from the stream,
   tokenized, bucketed (inference.buckets.plan_calls), forwarded and pooled, timed over >= 3 s
   after warm-up -> queries/s. What a perfect server could at best answer.
2. Same-model check: one query embedded by every server against the floor's vector (cosine,
   stored in the JSON; a warning under 0.99).
3. Fixed rate (--rate, default 100/s): --rounds rounds; in each round every contender runs once
   (--duration after --warmup), round 2 in reverse order, fresh queries every run. The table
   gives the median over rounds of P50/P95/P99, the errors of all rounds, P95 / floor P95 and
   P50 - floor P50 against the same variant's floor.
4. Sweep (--sweep START:STOP:STEP, default 25:400:25): per rate, every contender still in runs
   once; the first step with P95 > --sla-ms or ANY error drops it. Its highest passing rate and
   that rate over the variant's ceiling close the table.

Between runs the bench waits --settle seconds; after a failed run it also probes the contender
with single queries until one answers within the SLA (a server still draining an overload must
not slow the next contender on a shared CPU). Latency is from each request's scheduled send time.

Output in --out (default reports/bench/serving): serving.json (machine, commit, date, config,
ceilings, sanity, every run's summary), serving.md (one table) and serving.png (P95 vs offered
rate for every contender with the SLA line and the fixed-rate P95 as stars; fixed-rate P50/P95
bars beside it). A benchmark, not a gate: exit 0 whatever the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from inference.backends.onnx import OnnxBackend
from inference.buckets import plan_calls
from inference.embedder import load_tokenizer
from inference.errors import EmbedcarError, InvalidInput
from inference.files import atomic_write_text
from inference.manifest import Manifest, load_manifest
from inference.tokenizer import QueryTokenizer
from loadtest.bench.model_floor import FloorTarget
from loadtest.infinity import DEFAULT_EXE, InfinityServer, infinity_unavailable_reason
from loadtest.native import NativeTarget, native_unavailable_reason
from loadtest.queries import QueryMix
from loadtest.report import Summary, fmt_ms, save_png, summarize
from loadtest.runner import RunConfig, run_load
from loadtest.sweep import parse_sweep
from loadtest.targets import HttpEmbedTarget, SidecarEmbedTarget, SidecarStreamTarget, Target
from sidecar.settings import Settings

log = logging.getLogger(__name__)

KINDS = ("floor", "grpc", "stream", "grpc-native", "stream-native", "http", "triton", "infinity")
DEFAULT_KINDS = ("floor", "grpc", "stream", "stream-native", "http", "triton", "infinity")
SIDECAR_KINDS = ("grpc", "stream", "grpc-native", "stream-native", "http")  # one embedded sidecar serves them
SANITY_MIN_COSINE = 0.99
NextTexts = Callable[[int], Sequence[str]]
Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ServingConfig:
    variants: tuple[str, ...] = ("fp32", "int8")
    targets: tuple[str, ...] = DEFAULT_KINDS
    triton_variants: tuple[str, ...] = ("fp32",)
    infinity_variants: tuple[str, ...] = ("fp32",)
    rate: float = 100.0
    rounds: int = 2
    duration_s: float = 20.0
    warmup_s: float = 5.0
    sweep_rates: tuple[float, ...] = field(default_factory=lambda: tuple(parse_sweep("25:400:25")))
    sweep_duration_s: float = 15.0
    sweep_warmup_s: float = 3.0
    sla_ms: float = 20.0
    deadline_ms: float = 1000.0
    concurrency: int = 256
    spin_ms: float = 1.0
    seed: int = 0
    ceiling_batch: int = 32
    ceiling_s: float = 3.0
    settle_s: float = 1.0
    settle_max_s: float = 30.0
    infinity_exe: Path = DEFAULT_EXE
    log_dir: Path = Path("var/bench/serving")

    def validate(self) -> ServingConfig:
        unknown = [t for t in self.targets if t not in KINDS]
        if unknown:
            raise InvalidInput(f"unknown target(s) {', '.join(unknown)}; expected some of {', '.join(KINDS)}")
        if not self.variants or not self.targets:
            raise InvalidInput("no variant or no target to measure")
        if self.rounds < 1 or self.ceiling_batch < 1 or self.ceiling_s <= 0 or self.settle_s < 0:
            raise InvalidInput("rounds, ceiling batch and ceiling time must be positive, settle not negative")
        self.fixed_config().validate()
        self.sweep_config().validate()
        return self

    def fixed_config(self) -> RunConfig:
        return RunConfig(rate=self.rate, duration_s=self.duration_s, warmup_s=self.warmup_s,
                         concurrency=self.concurrency, deadline_ms=self.deadline_ms, seed=self.seed,
                         spin_ms=self.spin_ms)

    def sweep_config(self) -> RunConfig:
        first = self.sweep_rates[0] if self.sweep_rates else self.rate
        return dataclasses.replace(self.fixed_config(), rate=first, duration_s=self.sweep_duration_s,
                                   warmup_s=self.sweep_warmup_s)

    def kinds_for(self, variant: str) -> list[str]:
        """The contenders of `variant`, in --targets order (triton/infinity only for their variants)."""
        limited = {"triton": self.triton_variants, "infinity": self.infinity_variants}
        return [k for k in self.targets if k not in limited or variant in limited[k]]

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}


@dataclass(slots=True)
class Contender:
    kind: str
    variant: str
    target: Target | None = None
    skipped: str | None = None  # why it has no figures (not installed, failed to start)
    vector: Callable[[str], np.ndarray] | None = None  # one query's embedding, for the same-model check

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.variant}"


# --- one run ----------------------------------------------------------------------------------

def run_record(summary: Summary) -> Record:
    """The figures the table and the figure need, with the whole summary kept for the JSON."""
    lat = summary["latency_ms"]
    return {
        "rate": summary["config"]["rate"],
        "p50": lat["p50"], "p95": lat["p95"], "p99": lat["p99"], "max": lat["max"], "mean": lat["mean"],
        "requests": summary["requests"], "ok": summary["ok"], "errors": summary["errors"],
        "error_share": summary["error_share"], "achieved_rate": summary["achieved_rate"],
        "pass": summary["sla"]["pass"], "generator_lag_p99_ms": summary["generator"]["lag_p99_ms"],
        "generator_warning": summary["generator"]["warning"], "summary": summary,
    }


async def measure(c: Contender, cfg: RunConfig, next_texts: NextTexts, *, name: str, sla_ms: float) -> Record:
    """One open-loop run of `c` at cfg.rate; any error fails it (max_error_share=0)."""
    assert c.target is not None
    result = await run_load(c.target, next_texts(cfg.requests * cfg.batch), cfg)
    summary = summarize(result, name=name, sla_ms=sla_ms, max_error_share=0.0)
    summary["target"]["spec"] = c.key
    rec = run_record(summary)
    log.info("%s at %g/s: P50 %s P95 %s P99 %s ms, %d errors -> %s", c.key, cfg.rate, fmt_ms(rec["p50"]),
             fmt_ms(rec["p95"]), fmt_ms(rec["p99"]), sum(rec["errors"].values()), "pass" if rec["pass"] else "FAIL")
    return rec


async def settle(c: Contender, next_texts: NextTexts, *, failed: bool, sla_ms: float, pause_s: float,
                 max_s: float) -> float:
    """Pause; after a failed run, probe `c` until one fresh query answers within the SLA. -> seconds."""
    t0 = time.perf_counter()
    await asyncio.sleep(pause_s)
    if failed and c.target is not None:
        while time.perf_counter() - t0 < max_s:
            t = time.perf_counter()
            with contextlib.suppress(EmbedcarError, TimeoutError):
                await asyncio.wait_for(c.target.call(list(next_texts(1)), timeout_s=5.0), 6.0)
                if (time.perf_counter() - t) * 1e3 <= sla_ms:
                    break
            await asyncio.sleep(0.2)
        else:
            log.warning("%s still slow %.0f s after its failed run; going on", c.key, max_s)
    return time.perf_counter() - t0


async def fixed_rounds(contenders: Sequence[Contender], cfg: RunConfig, rounds: int, next_texts: NextTexts, *,
                       sla_ms: float, settle_s: float = 1.0, settle_max_s: float = 30.0) -> dict[str, list[Record]]:
    """`rounds` rounds of one run per contender at cfg.rate, every other round in reverse order."""
    out: dict[str, list[Record]] = {c.key: [] for c in contenders}
    for r in range(rounds):
        order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for pos, c in enumerate(order, 1):
            log.info("fixed rate %g/s, round %d/%d, run %d/%d: %s", cfg.rate, r + 1, rounds, pos, len(order), c.key)
            rec = await measure(c, cfg, next_texts, name=f"{c.kind}-{c.variant}-{cfg.rate:g}qps-r{r + 1}",
                                sla_ms=sla_ms)
            out[c.key].append(rec | {"round": r + 1, "position": pos})
            await settle(c, next_texts, failed=not rec["pass"], sla_ms=sla_ms, pause_s=settle_s, max_s=settle_max_s)
    return out


async def sweep_targets(contenders: Sequence[Contender], rates: Sequence[float], base: RunConfig,
                        next_texts: NextTexts, *, sla_ms: float, settle_s: float = 1.0,
                        settle_max_s: float = 30.0) -> dict[str, Record]:
    """Step the rate up; a contender leaves at its first failing step. -> key -> steps, best_rate, dropped_at."""
    out: dict[str, Record] = {c.key: {"steps": [], "best_rate": None, "dropped_at": None} for c in contenders}
    alive = list(contenders)
    for i, rate in enumerate(rates):
        if not alive:
            break
        cfg = dataclasses.replace(base, rate=rate)
        order = alive if i % 2 == 0 else alive[::-1]
        log.info("sweep %g/s (%d/%d): %s", rate, i + 1, len(rates), ", ".join(c.key for c in order))
        for c in order:
            rec = await measure(c, cfg, next_texts, name=f"{c.kind}-{c.variant}-sweep-{rate:g}", sla_ms=sla_ms)
            entry = out[c.key]
            entry["steps"].append(rec)
            if rec["pass"]:
                entry["best_rate"] = rate
            else:
                entry["dropped_at"] = rate
                log.info("sweep: %s leaves at %g/s (best %s)", c.key, rate,
                         "none" if entry["best_rate"] is None else f"{entry['best_rate']:g}/s")
            await settle(c, next_texts, failed=not rec["pass"], sla_ms=sla_ms, pause_s=settle_s, max_s=settle_max_s)
        alive = [c for c in alive if out[c.key]["dropped_at"] is None]
    return out


# --- ceiling and same-model check -------------------------------------------------------------

def measure_ceiling(model_dir: Path, manifest: Manifest, tokenizer: QueryTokenizer, variant: str,
                    texts: Sequence[str], *, probe: str, threads: int,
                    batch: int = 32, seconds: float = 3.0, warmup_batches: int = 5) -> tuple[Record, np.ndarray]:
    """Batched queries/s of the model alone in this process, and `probe` embedded the floor's way
    (the reference of the same-model check). Its ORT session is closed before it returns."""
    backend = OnnxBackend(model_dir, manifest, variant=variant, threads=threads)
    backend.warm_up()

    def embed(chunk: Sequence[str]) -> tuple[np.ndarray, int]:
        enc = tokenizer.encode(chunk)
        out = np.empty((len(chunk), manifest.dim), dtype=np.float32)
        calls = plan_calls(enc.lengths, tokenizer.buckets, batch)
        for bucket, idx in calls:
            out[idx] = backend.embed_sync(tokenizer.batch([enc.ids[i] for i in idx], length=bucket))
        return out, len(calls)

    try:
        chunks = [list(texts[i:i + batch]) for i in range(0, len(texts) - batch + 1, batch)] or [list(texts)]
        for k in range(warmup_batches):
            embed(chunks[k % len(chunks)])
        queries = calls = k = 0
        per_batch: list[float] = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            chunk = chunks[k % len(chunks)]
            t = time.perf_counter()
            calls += embed(chunk)[1]
            per_batch.append((time.perf_counter() - t) * 1e3)
            queries += len(chunk)
            k += 1
        elapsed = time.perf_counter() - t0
        reference = embed([probe])[0][0]
    finally:
        asyncio.run(backend.close())
    rec = {"variant": variant, "qps": queries / elapsed, "batch": batch, "seconds": elapsed, "queries": queries,
           "backend_calls": calls, "batch_ms_p50": float(np.median(per_batch)),
           "threads": threads or os.cpu_count() or 1}
    log.info("ceiling %s: %.0f queries/s (batches of %d, %.2f ms each, %d threads)", variant, rec["qps"], batch,
             rec["batch_ms_p50"], rec["threads"])
    return rec, reference


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _http_vector(url: str, model: str | None = None) -> Callable[[str], np.ndarray]:
    def get(text: str) -> np.ndarray:
        import httpx

        body: dict[str, Any] = {"input": [text]} | ({"model": model} if model else {})
        r = httpx.post(url, json=body, timeout=30.0, trust_env=False)
        r.raise_for_status()
        return np.asarray(r.json()["data"][0]["embedding"], dtype=np.float32)

    return get


def _grpc_vector(target: str, *, stream: bool = False) -> Callable[[str], np.ndarray]:
    async def one(text: str) -> np.ndarray:
        from embedcar_client.client import AsyncClient

        async with AsyncClient(target, stream=stream) as c:
            return np.asarray((await c.embed([text], timeout_s=30.0)).embeddings[0], dtype=np.float32)

    return lambda text: asyncio.run(one(text))


def same_model_check(contenders: Sequence[Contender], ref: np.ndarray, text: str) -> dict[str, Record]:
    """Cosine of every server's embedding of `text` with the floor's (`ref`); logged, warned under 0.99."""
    out: dict[str, Record] = {}
    for c in contenders:
        if c.vector is None or c.skipped:
            continue
        try:
            cos = cosine(c.vector(text), ref)
        except Exception as exc:  # a report extra: a failed check is shown, not fatal
            out[c.key] = {"cosine": None, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            log.warning("same-model check of %s failed: %s", c.key, exc)
            continue
        out[c.key] = {"cosine": cos, "ok": cos >= SANITY_MIN_COSINE}
        (log.info if cos >= SANITY_MIN_COSINE else log.warning)(
            "same-model check %s: cosine %.6f with the floor's embedding", c.key, cos)
    return out


# --- starting the contenders ------------------------------------------------------------------

def start_contenders(settings: Settings, cfg: ServingConfig, variant: str,
                     stack: contextlib.ExitStack) -> list[Contender]:
    """Every server of `variant`, started once on `stack`; a server that cannot start is a skipped row."""
    model_dir = settings.model.model_dir
    kinds = cfg.kinds_for(variant)
    logs = cfg.log_dir
    logs.mkdir(parents=True, exist_ok=True)
    out: list[Contender] = []
    sidecar: Any = None
    for kind in kinds:
        c = Contender(kind, variant)
        out.append(c)
        try:
            if kind == "floor":
                c.target = FloorTarget.for_model(settings.model, variant)
            elif kind in SIDECAR_KINDS:
                if sidecar is None:
                    from loadtest.stack import SidecarProcess

                    log.info("starting the sidecar (embedded backend, %s)", variant)
                    sidecar = stack.enter_context(SidecarProcess(
                        settings, backend="embedded", variant=variant,
                        log_file=logs / f"sidecar-embedded-{variant}.log"))
                if kind != "http":
                    stream, native = kind.startswith("stream"), kind.endswith("-native")
                    if native and (reason := native_unavailable_reason()):
                        c.skipped = reason
                        log.warning("%s skipped: %s", c.key, reason)
                        continue
                    python = (SidecarStreamTarget if stream else SidecarEmbedTarget)(sidecar.grpc_target)
                    c.target = NativeTarget(python) if native else python
                    c.vector = _grpc_vector(sidecar.grpc_target, stream=stream)
                else:
                    c.target = HttpEmbedTarget(sidecar.http_url)
                    c.vector = _http_vector(f"{sidecar.http_url}/v1/embeddings")
            elif kind == "triton":
                from inference.triton.launcher import TritonServer, triton_unavailable_reason
                from loadtest.stack import SidecarProcess

                reason = triton_unavailable_reason()
                if reason:
                    c.skipped = reason
                    log.warning("triton %s skipped: %s", variant, reason)
                    continue
                log.info("starting tritonserver and a sidecar on it (%s)", variant)
                server = stack.enter_context(TritonServer(settings, variant=variant,
                                                          log_file=logs / f"tritonserver-{variant}.log"))
                sc = stack.enter_context(SidecarProcess(
                    settings, backend="triton", variant=variant, triton_url=server.grpc_url,
                    log_file=logs / f"sidecar-triton-{variant}.log"))
                c.target = SidecarEmbedTarget(sc.grpc_target, triton_stats_url=server.grpc_url)
                c.vector = _grpc_vector(sc.grpc_target)
            elif kind == "infinity":
                reason = infinity_unavailable_reason(cfg.infinity_exe)
                if reason:
                    c.skipped = reason
                    log.warning("infinity %s skipped: %s (%s)", variant, reason, cfg.infinity_exe)
                    continue
                inf = stack.enter_context(InfinityServer(model_dir, variant, exe=cfg.infinity_exe,
                                                         log_file=logs / f"infinity-{variant}.log"))
                c.target = HttpEmbedTarget(inf.url, name="infinity", path="/embeddings", model=inf.served_name)
                c.vector = _http_vector(f"{inf.url}/embeddings", inf.served_name)
        except EmbedcarError as exc:
            c.target, c.vector = None, None
            c.skipped = f"failed to start: {exc.message.splitlines()[0][:200]}"
            log.error("%s: %s", c.key, exc.message)
    return out


# --- the whole bench --------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import onnxruntime

        ort = str(onnxruntime.__version__)
    except ImportError:
        ort = "?"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "cpus_usable": usable, "python": platform.python_version(),
            "onnxruntime": ort}


def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def command_line(fallback: Sequence[str], area: str = "serving") -> str:
    """The command as typed when this process is `embedcar bench AREA ...`, else `fallback` (from code)."""
    argv = sys.argv[1:]
    if "bench" in argv and area in argv:
        return "embedcar " + shlex.join(argv)
    return "embedcar " + shlex.join(fallback)


def run_serving(settings: Settings, cfg: ServingConfig, *, out_dir: Path,
                command: str) -> tuple[Record, dict[str, Path]]:
    """The whole comparison -> (result, the paths of serving.json/.md/.png)."""
    cfg.validate()
    model_dir = settings.model.model_dir
    manifest = load_manifest(model_dir)
    for v in cfg.variants:
        manifest.variant(v)  # an unknown variant fails before anything starts
    tokenizer = load_tokenizer(model_dir, manifest)
    mix = QueryMix(tokenizer, seed=cfg.seed, unique=True)
    result: Record = {
        "name": "serving", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(), "machine": machine_info(), "command": command, "model": manifest.name,
        "config": cfg.to_json(), "ceilings": {}, "sanity": {}, "runs": {}, "complete": False,
    }
    for variant in cfg.variants:
        # Before this variant's servers start: the ceiling has the machine to itself.
        probe = mix.next()
        ceiling, reference = measure_ceiling(model_dir, manifest, tokenizer, variant, mix.take(cfg.ceiling_batch * 32),
                                             probe=probe, threads=settings.model.intra_op_threads,
                                             batch=cfg.ceiling_batch, seconds=cfg.ceiling_s)
        result["ceilings"][variant] = ceiling
        with contextlib.ExitStack() as stack:
            contenders = start_contenders(settings, cfg, variant, stack)
            for c in contenders:
                result["runs"][c.key] = {"target": c.kind, "variant": variant, "skipped": c.skipped,
                                         "fixed": [], "sweep": {"steps": [], "best_rate": None, "dropped_at": None}}
            checks = same_model_check(contenders, reference, probe)
            result["sanity"] |= {k: v | {"text": probe} for k, v in checks.items()}
            asyncio.run(_measure_variant(contenders, cfg, mix.take, result, out_dir))
    result["complete"] = True
    return result, write_reports(result, out_dir)


async def _measure_variant(contenders: Sequence[Contender], cfg: ServingConfig, next_texts: NextTexts,
                           result: Record, out_dir: Path) -> None:
    live = [c for c in contenders if c.target is not None]
    started: list[Contender] = []
    try:
        for c in live:
            assert c.target is not None
            await c.target.start()
            started.append(c)
        fixed = await fixed_rounds(live, cfg.fixed_config(), cfg.rounds, next_texts, sla_ms=cfg.sla_ms,
                                   settle_s=cfg.settle_s, settle_max_s=cfg.settle_max_s)
        for key, recs in fixed.items():
            result["runs"][key]["fixed"] = recs
        write_json(result, out_dir)  # a long run keeps what it has measured should a later step fail
        if cfg.sweep_rates:
            swept = await sweep_targets(live, cfg.sweep_rates, cfg.sweep_config(), next_texts, sla_ms=cfg.sla_ms,
                                        settle_s=cfg.settle_s, settle_max_s=cfg.settle_max_s)
            for key, rec in swept.items():
                result["runs"][key]["sweep"] = rec
            write_json(result, out_dir)
    finally:
        for c in started:
            assert c.target is not None
            await c.target.close()


# --- the report -------------------------------------------------------------------------------

def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return float(statistics.median(got)) if got else None


def table_rows(result: Record) -> list[Record]:
    """One row per target x variant: medians over the fixed-rate rounds, ratios against that
    variant's floor, the highest passing sweep rate and its share of the variant's ceiling."""
    runs: dict[str, Record] = result["runs"]
    medians = {key: {p: _median([x[p] for x in r.get("fixed", [])]) for p in ("p50", "p95", "p99")}
               for key, r in runs.items()}
    rows = []
    for key, r in runs.items():
        variant = r["variant"]
        m = medians[key]
        floor = medians.get(f"floor:{variant}", {})
        sweep = r.get("sweep") or {}
        steps = sweep.get("steps") or []
        best = sweep.get("best_rate")
        rates = result.get("config", {}).get("sweep_rates") or []
        ceiling = (result.get("ceilings", {}).get(variant) or {}).get("qps")
        errors: dict[str, int] = {}
        for x in r.get("fixed", []):
            for code, n in x["errors"].items():
                errors[code] = errors.get(code, 0) + n
        p95f, p50f = floor.get("p95"), floor.get("p50")
        rows.append({
            "key": key, "target": r["target"], "variant": variant, "skipped": r.get("skipped"),
            "p50": m["p50"], "p95": m["p95"], "p99": m["p99"],
            "p95_over_floor": m["p95"] / p95f if m["p95"] is not None and p95f else None,
            "p50_minus_floor": m["p50"] - p50f if m["p50"] is not None and p50f is not None else None,
            "errors": sum(errors.values()), "errors_by_code": errors, "swept": bool(steps),
            "best_rate": best,
            # Never failed up to the sweep's top rate: its capacity is that rate or more.
            "best_is_lower_bound": bool(steps) and sweep.get("dropped_at") is None and bool(rates)
            and best == max(rates),
            "best_over_ceiling": best / ceiling if best is not None and ceiling else None,
        })
    # Variants in --variants order, targets in KINDS order (serving.json keeps its keys sorted).
    variants = list(result.get("config", {}).get("variants") or [])

    def place(row: Record) -> tuple[int, int]:
        v, k = row["variant"], row["target"]
        return (variants.index(v) if v in variants else len(variants),
                KINDS.index(k) if k in KINDS else len(KINDS))

    return sorted(rows, key=place)


def _fmt_ratio(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _floor_facts(result: Record) -> str:
    """The floors' ORT threads and CPU per query (their child's getrusage), from the fixed-rate runs."""
    facts = []
    for r in result.get("runs", {}).values():
        targets = [x["summary"]["target"] for x in r.get("fixed", []) if "summary" in x]
        cpu = _median([t.get("cpu_ms_per_query") for t in targets])
        if r.get("target") == "floor" and cpu is not None:
            facts.append(f"{r['variant']} {targets[0].get('threads', '?')} thread(s), {cpu:.2f} ms CPU per query")
    return "; " + ", ".join(facts) if facts else ""


def serving_markdown(result: Record) -> str:
    cfg = result.get("config", {})
    sla = float(cfg.get("sla_ms", 20.0))
    m = result.get("machine", {})
    rates = cfg.get("sweep_rates") or []
    ceilings = ", ".join(f"{v} **{c['qps']:.0f} queries/s**" for v, c in result.get("ceilings", {}).items()) or "–"
    threads = ", ".join(sorted({str(c.get("threads")) for c in result.get("ceilings", {}).values()}))
    where = m.get("cpu") or m.get("machine", "?")
    lines = [
        f"# Serving comparison: {result.get('model', 'the model')}",
        "",
        f"{result.get('date', '?')} · commit `{result.get('commit') or '?'}` · {where}, "
        f"{m.get('cpus_usable', m.get('cpu_count', '?'))} CPUs, Python {m.get('python', '?')}, "
        f"ONNX Runtime {m.get('onnxruntime', '?')}, {m.get('platform', '?')}",
        "",
        f"Command: `{result.get('command', '?')}`",
        "",
        f"Model ceiling (this machine, one process, batches of {cfg.get('ceiling_batch', 32)} real queries: "
        f"tokenize + bucket + ORT + pool, {threads} ORT threads): {ceilings}.",
        "",
        f"Fixed rate: {cfg.get('rate', 0):g} requests/s open loop, batch 1, short shopper queries, all distinct "
        f"(no cache hits); {cfg.get('rounds', 1)} round(s) of {cfg.get('duration_s', 0):g} s "
        f"(+{cfg.get('warmup_s', 0):g} s warm-up) per target, alternating order, fresh queries every run; "
        "P50/P95/P99 are medians over rounds, errors the sum. Latency from each request's scheduled send time.",
        "",
        "Floor: the model alone in its own process, with the sidecar's settings (its variant, ORT threads as it "
        "chooses them, padding to the exact length, no spinning) and nothing else in that process: no server, no "
        "event loop; it keeps the same open-loop schedule itself and times each query from its scheduled time"
        + _floor_facts(result) + ".",
        "",
    ]
    if rates:
        step = rates[1] - rates[0] if len(rates) > 1 else 0
        lines += [f"Sweep: {rates[0]:g}–{rates[-1]:g}/s" + (f" step {step:g}" if step else "") +
                  f", {cfg.get('sweep_duration_s', 0):g} s (+{cfg.get('sweep_warmup_s', 0):g} s warm-up) per step; "
                  f"a target leaves at its first step with P95 > {sla:g} ms or any error.", ""]
    sanity = result.get("sanity") or {}
    if sanity:
        lines += ["Same model: cosine with the floor's embedding of one query: " + ", ".join(
            f"{k} {'failed' if v.get('cosine') is None else format(v['cosine'], '.6f')}"
            + ("" if v.get("ok") else " (**below 0.99**)") for k, v in sanity.items()) + ".", ""]
    lines += [
        f"| target | variant | P50 ms | P95 ms | P99 ms | P95 / floor | P50 − floor ms | errors "
        f"| highest rate ≤ {sla:g} ms, 0 errors | / ceiling |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table_rows(result):
        if row["skipped"]:
            lines.append(f"| {row['target']} | {row['variant']} | {row['skipped']} | – | – | – | – | – | – | – |")
            continue
        errors = str(row["errors"]) if not row["errors"] else \
            f"{row['errors']} (" + ", ".join(f"{k} {v}" for k, v in sorted(row["errors_by_code"].items())) + ")"
        if not row["swept"]:
            best = "–"
        elif row["best_rate"] is None:
            best = "none"
        else:
            best = ("≥ " if row["best_is_lower_bound"] else "") + f"{row['best_rate']:g}/s"
        delta = row["p50_minus_floor"]
        lines.append(
            f"| {row['target']} | {row['variant']} | {fmt_ms(row['p50'])} | {fmt_ms(row['p95'])} "
            f"| {fmt_ms(row['p99'])} "
            f"| {_fmt_ratio(row['p95_over_floor'], '.2f')} | {'–' if delta is None else f'{delta:+.2f}'} | {errors} "
            f"| {best} | {_fmt_ratio(row['best_over_ceiling'], '.0%')} |")
    warned = [(key, x) for key, r in result.get("runs", {}).items()
              for x in [*r.get("fixed", []), *(r.get("sweep") or {}).get("steps", [])] if x.get("generator_warning")]
    if warned:
        key, last = warned[-1]
        lines += ["", f"**Load generator warning** in {len(warned)} run(s), e.g. {key} at {last['rate']:g}/s: "
                      f"{last['generator_warning']}."]
    if not result.get("complete", True):
        lines += ["", "**Incomplete run**: the figures so far."]
    lines += ["", f"Server logs: {cfg.get('log_dir', 'var/bench/serving')}/. Every run's summary: serving.json."]
    return "\n".join(lines) + "\n"


COLORS = {"floor": "black", "grpc": "tab:blue", "stream": "tab:cyan", "grpc-native": "tab:olive",
          "stream-native": "tab:brown",
          "http": "tab:green", "triton": "tab:purple", "infinity": "tab:red"}
STYLES = {"fp32": "-", "int8": "--", "fp16": ":"}


def write_png(result: Record, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    cfg = result.get("config", {})
    sla = float(cfg.get("sla_ms", 20.0))
    rows = [r for r in table_rows(result) if not r["skipped"]]
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6), constrained_layout=True, width_ratios=(3, 2))
    positive: list[float] = []
    for row in rows:
        run = result["runs"][row["key"]]
        color, style = COLORS.get(row["target"], "tab:gray"), STYLES.get(row["variant"], "-.")
        steps = (run.get("sweep") or {}).get("steps") or []
        best = "none" if row["best_rate"] is None else f"{row['best_rate']:g}/s"
        label = f"{row['target']} {row['variant']}" + (f" (best {best})" if steps else "")
        if steps:
            xs = [s["rate"] for s in steps]
            ys = [float("nan") if s["p95"] is None else s["p95"] for s in steps]
            ax1.plot(xs, ys, ls=style, color=color, marker="o", ms=4, label=label)
            failed = [(s["rate"], s["p95"]) for s in steps if not s["pass"] and s["p95"] is not None]
            if failed:
                ax1.scatter(*zip(*failed, strict=True), marker="x", s=60, color=color, zorder=4)
            # A step without one successful request has no P95: an x on the top edge.
            blank = [s["rate"] for s in steps if s["p95"] is None]
            if blank:
                ax1.scatter(blank, [0.98] * len(blank), marker="x", s=60, color=color, zorder=4,
                            transform=ax1.get_xaxis_transform(), clip_on=False)
            positive += [y for y in ys if y == y and y > 0]
        if row["p95"] is not None:
            ax1.scatter([cfg.get("rate", 0)], [row["p95"]], marker="*", s=180, color=color, edgecolors="white",
                        zorder=5, label=None if steps else label)
            positive.append(row["p95"])
    ax1.axhline(sla, color="tab:orange", ls="--", lw=1.5, label=f"SLA {sla:g} ms")
    if positive:
        ax1.set_yscale("log")
        ax1.yaxis.set_major_formatter(plain)
        ax1.yaxis.set_minor_formatter(plain)
        ax1.tick_params(axis="y", which="minor", labelsize=7)
    ax1.set_xlabel("offered rate (requests/s, batch 1)")
    ax1.set_ylabel("P95 latency (ms)")
    ax1.set_title(f"sweep: P95 vs offered rate (x: failed step, on top: no answer at all; "
                  f"★: fixed-rate {cfg.get('rate', 0):g}/s median)", fontsize=10)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8, ncol=2)
    measured = [r for r in rows if r["p50"] is not None]
    x = np.arange(len(measured))
    for off, key, alpha in ((-0.2, "p50", 1.0), (0.2, "p95", 0.55)):
        ax2.bar(x + off, [r[key] for r in measured], width=0.4, alpha=alpha, label=key.upper(),
                color=[COLORS.get(r["target"], "tab:gray") for r in measured])
    ax2.axhline(sla, color="tab:orange", ls="--", lw=1.5)
    # "stream-native" on two lines: eight or more bars side by side leave no room for it on one.
    ax2.set_xticks(x, [f"{r['target'].replace('-', chr(10))}\n{r['variant']}" for r in measured], fontsize=8)
    ax2.set_ylabel("latency (ms)")
    ax2.set_title(f"fixed rate {cfg.get('rate', 0):g}/s, median over rounds: P50 (solid), P95 (light)",
                  fontsize=10)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Serving comparison: {result.get('model', '')} · {result.get('date', '')} · "
                 f"{result.get('commit') or ''}", fontsize=10)
    save_png(fig, path)
    plt.close(fig)


def write_json(result: Record, out_dir: Path) -> Path:
    path = out_dir / "serving.json"
    atomic_write_text(path, json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    return path


def write_reports(result: Record, out_dir: Path) -> dict[str, Path]:
    """serving.json, serving.md and serving.png in `out_dir`, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(result, out_dir), "md": out_dir / "serving.md", "png": out_dir / "serving.png"}
    atomic_write_text(paths["md"], serving_markdown(result))
    write_png(result, paths["png"])
    return paths
