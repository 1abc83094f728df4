"""`embedcar loadtest`: open-loop latency SLA test of the sidecar, Triton or the naive baseline.

Examples:
  embedcar loadtest --target sidecar-embed --sidecar 127.0.0.1:50051 --rate 100 --duration 300 --no-cache
  embedcar loadtest --start-stack --compare baseline,sidecar-embed:embedded,sidecar-embed:triton --no-cache
  embedcar loadtest --start-stack --target sidecar-embed:triton --sweep 50:300:25 --duration 30
  embedcar loadtest --start-stack --compare inprocess,http:embedded,infinity --no-cache --duration 60
  embedcar loadtest --start-stack --compare sidecar-stream:embedded,sidecar-stream:embedded+native --no-cache
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from embedcar_settings import Settings
from inference.cli import add_model_flags
from inference.embedder import load_tokenizer
from inference.errors import InvalidInput
from inference.flags import flag_overrides
from inference.manifest import load_manifest
from inference.triton.tls import client_credentials
from loadtest.native import NativeTarget
from loadtest.proc_cpu import CpuMeter
from loadtest.queries import QueryMix
from loadtest.report import Summary, cpu_per_request, markdown, summarize, write_comparison, write_run
from loadtest.runner import RunConfig, run_load
from loadtest.schedule import ARRIVALS
from loadtest.stack import SIDECAR_TARGETS, TargetSpec, sidecar_target, start_stack
from loadtest.sweep import parse_sweep, sweep, write_sweep
from loadtest.targets import (
    TARGETS,
    HttpEmbedTarget,
    InProcessTarget,
    PoolTarget,
    StubTarget,
    Target,
    TritonTarget,
)

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p = sub.add_parser("loadtest", help="open-loop latency SLA load test (P50..P99, Triton stats, SLA verdict)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to test")
    what.add_argument("--target", default="sidecar-embed",
                      help=f"{' | '.join(TARGETS)}, optionally :embedded or :triton for the sidecar's backend "
                           "with --start-stack (default sidecar-embed), @N for N sidecar processes sharing "
                           "the cores (the model's threads split between them), requests spread round-robin, "
                           "and +native for sidecar-embed/-stream/-search sent by the compiled C++ client "
                           "instead of Python's (its CPU per call a search node's, not grpc.aio's)")
    what.add_argument("--compare", default=None,
                      help="comma-separated targets run one after another on the same query stream, "
                           "e.g. baseline,sidecar-embed:embedded,sidecar-embed:triton")
    what.add_argument("--backend", choices=("embedded", "triton"), default="embedded",
                      help="sidecar backend for --start-stack when a target names none")
    what.add_argument("--start-stack", action="store_true",
                      help="start each target's servers here (tritonserver, sidecar, baseline) on free ports")
    addr = p.add_argument_group("where (when not started here)")
    addr.add_argument("--sidecar", default="127.0.0.1:50051",
                      help="sidecar gRPC address; several, comma-separated: a pool, requests spread round-robin")
    addr.add_argument("--http-url", default="http://127.0.0.1:8080",
                      help="sidecar HTTP facade base URL (several, comma-separated: a pool)")
    addr.add_argument("--triton-url", action="append", default=None, help="Triton gRPC address (repeatable)")
    addr.add_argument("--baseline-url", default="http://127.0.0.1:8090", help="baseline base URL")
    addr.add_argument("--infinity-url", default="http://127.0.0.1:7997", help="Infinity base URL")
    addr.add_argument("--infinity-model", default=None,
                      help="Infinity's served model name (default <model>-<variant>, as --start-stack serves it)")
    addr.add_argument("--infinity-exe", type=Path, default=None,
                      help="Infinity's executable for --start-stack (default var/infinity-venv/bin/infinity_emb: "
                           "`make infinity`)")
    addr.add_argument("--triton-stats-url", default=None,
                      help="Triton gRPC address to read per-model statistics from when testing the sidecar")
    addr.add_argument("--api-key-file", type=Path, default=None, help="file holding the sidecar API key")
    addr.add_argument("--index-dir", type=Path, default=None, help="catalog index root for a started sidecar")
    addr.add_argument("--k", type=int, default=10, help="hits per Search request")
    load = p.add_argument_group("load")
    load.add_argument("--rate", type=float, default=100.0, help="requests per second (default 100)")
    load.add_argument("--duration", type=float, default=300.0, help="measured seconds (default 300)")
    load.add_argument("--warmup", type=float, default=10.0, help="seconds sent first and not counted (default 10)")
    load.add_argument("--batch", type=int, default=1, help="texts per request (default 1)")
    load.add_argument("--concurrency", type=int, default=256, help="most requests in flight (default 256)")
    load.add_argument("--deadline-ms", type=float, default=1000.0, help="per-request deadline from its scheduled time")
    load.add_argument("--arrivals", choices=ARRIVALS, default="constant")
    load.add_argument("--spin-ms", type=float, default=1.0,
                      help="pacer yield-spins this long before each send (event-loop timers wake up to 1 ms "
                           "late); costs ~rate*spin/2 of a core; 0 = timers only")
    load.add_argument("--sweep", default=None, metavar="START:STOP:STEP", help="step the rate; report the best rate")
    q = p.add_argument_group("queries")
    q.add_argument("--no-cache", action="store_true", help="every query distinct: measure inference, not the cache")
    q.add_argument("--repeat-share", type=float, default=0.5, help="share of requests repeating popular queries")
    q.add_argument("--seed", type=int, default=0, help="same seed, same query stream and arrivals")
    rep = p.add_argument_group("report")
    rep.add_argument("--out", type=Path, default=Path("reports/loadtest"), help="report folder")
    rep.add_argument("--log-dir", type=Path, default=Path("var/loadtest"),
                     help="server logs of a --start-stack run (kept out of the report folder)")
    rep.add_argument("--name", default=None, help="report file name (default: from target and rate)")
    rep.add_argument("--triton-trace", type=Path, default=None, metavar="FILE",
                     help="with --start-stack: the started tritonserver traces every request into FILE, and the "
                          "report adds per-phase P50/P95 inside Triton over the measured window")
    rep.add_argument("--sla-ms", type=float, default=20.0, help="P95 budget, end to end (default 20)")
    rep.add_argument("--max-error-share", type=float, default=0.01, help="errors allowed by the SLA (default 1%%)")
    add_model_flags(p)
    p.set_defaults(func=main)


def _specs(args: argparse.Namespace) -> list[TargetSpec]:
    raw = args.compare.split(",") if args.compare else [args.target]
    specs = [TargetSpec.parse(x, args.backend) for x in raw if x.strip()]
    if not specs:
        raise InvalidInput("no target given")
    return specs


def _remote_target(spec: TargetSpec, args: argparse.Namespace, settings: Settings, api_key: str | None) -> Target:
    stats = args.triton_stats_url
    if spec.target in SIDECAR_TARGETS:
        # Several addresses: a pool of sidecars, requests spread round-robin over them.
        if spec.processes > 1:
            raise InvalidInput(f"{spec.label}: @N starts N sidecars (--start-stack); for running ones give "
                               "their addresses comma-separated (--sidecar / --http-url)")
        raw = args.http_url if spec.target == "http" else args.sidecar
        addresses = [a.strip() for a in raw.split(",") if a.strip()]
        members = [sidecar_target(spec.target, a, a, api_key=api_key, k=args.k, triton_stats_url=stats,
                                  triton_credentials=client_credentials(settings.triton)) for a in addresses]
        return members[0] if len(members) == 1 else PoolTarget(members)
    if spec.target == "baseline":
        return HttpEmbedTarget(args.baseline_url, name="baseline")
    if spec.target == "stub":
        return StubTarget()
    if spec.target == "infinity":
        served = args.infinity_model or f"{settings.model.name}-{settings.model.served_variant()}"
        return HttpEmbedTarget(args.infinity_url, name="infinity", path="/embeddings", model=served)
    if spec.target == "inprocess":
        return InProcessTarget.for_model(settings.model)
    urls = args.triton_url or list(settings.triton.urls)
    return TritonTarget(urls, settings.model.model_dir, variant=settings.model.variant,
                        credentials=client_credentials(settings.triton))


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = Settings.load(overrides=flag_overrides(args))
    variant = settings.model.served_variant()
    specs = _specs(args)
    config = RunConfig(rate=args.rate, duration_s=args.duration, warmup_s=args.warmup, batch=args.batch,
                       concurrency=args.concurrency, deadline_ms=args.deadline_ms, arrivals=args.arrivals,
                       seed=args.seed, spin_ms=args.spin_ms).validate()
    rates = parse_sweep(args.sweep) if args.sweep else None
    api_key = args.api_key_file.read_text().strip() if args.api_key_file else None
    manifest = load_manifest(settings.model.model_dir)
    tokenizer = load_tokenizer(settings.model.model_dir, manifest)
    cache_tag = "nocache" if args.no_cache else f"repeat{args.repeat_share:g}"
    summaries: list[Summary] = []
    sweeps_ok = True
    # Every target gets the identical stream (same seed); generated up front, off the hot path.
    texts = [] if rates else QueryMix(tokenizer, seed=args.seed, repeat_share=args.repeat_share,
                                      unique=args.no_cache).take(config.requests * config.batch)
    for spec in specs:
        name = args.name if args.name and len(specs) == 1 else \
            f"{spec.label.replace(':', '-')}-{variant}-{args.rate:g}qps-{cache_tag}"
        pids: dict[str, int] = {}
        trace = args.triton_trace if args.start_stack else None
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
            trace.unlink(missing_ok=True)  # tritonserver appends
        with contextlib.ExitStack() as stack:
            target = (start_stack(spec, settings, stack, variant=variant, api_key=api_key, k=args.k,
                                  index_dir=args.index_dir, log_dir=args.log_dir, infinity_exe=args.infinity_exe,
                                  pids=pids, triton_trace=trace)
                      if args.start_stack else _remote_target(spec, args, settings, api_key))
            if spec.client == "native":
                target = NativeTarget.wrap(target)
            if rates:
                sname = f"{args.name or spec.label.replace(':', '-')}-{variant}-sweep-{cache_tag}"
                mix = QueryMix(tokenizer, seed=args.seed, repeat_share=args.repeat_share, unique=args.no_cache)
                res = asyncio.run(_sweep(target, rates, config, mix, sname, spec.label, args))
                sweeps_ok = sweeps_ok and res.best_rate is not None
                paths = write_sweep(res, args.out)
                print(paths["md"].read_text())
                print(f"reports: {', '.join(str(p) for p in paths.values())}")
                continue
            meter = CpuMeter(pids)
            meter.start()
            result = asyncio.run(_run(target, texts, config))
            server_cpu = meter.stop()
        summary = summarize(result, name=name, sla_ms=args.sla_ms, max_error_share=args.max_error_share)
        summary["target"]["spec"] = spec.label
        summary["cpu_ms_per_request"] = cpu_per_request(result, server_cpu)
        if trace is not None and "tritonserver" in pids:  # the file is written as tritonserver stops
            from inference.triton.trace import phase_table

            summary["triton_phases_us"] = phase_table(trace, window_ns=result.window_ns)
        paths = write_run(result, summary, args.out)
        print(markdown(summary))
        print(f"reports: {', '.join(str(p) for p in paths.values())}")
        summaries.append(summary)
    if len(summaries) > 1:
        cname = args.name or f"compare-{variant}-{args.rate:g}qps-{cache_tag}"
        paths = write_comparison(summaries, args.out, cname)
        print(paths["md"].read_text())
        print(f"comparison: {', '.join(str(p) for p in paths.values())}")
    # Exit 1 when a run failed its SLA (or no sweep step met it): usable as a pre-release gate.
    return 0 if sweeps_ok and all(s["sla"]["pass"] for s in summaries) else 1


async def _run(target: Target, texts: Sequence[str], config: RunConfig) -> Any:
    await target.start()
    try:
        return await run_load(target, texts, config)
    finally:
        await target.close()


async def _sweep(target: Target, rates: list[float], config: RunConfig, mix: QueryMix, name: str, label: str,
                 args: argparse.Namespace) -> Any:
    await target.start()
    try:
        return await sweep(target, rates, config, mix.take, name=name, sla_ms=args.sla_ms,
                           max_error_share=args.max_error_share, label=label)
    finally:
        await target.close()
