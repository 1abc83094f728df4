"""`embedcar bench model|int8|triton|sidecar|serving|neighbour|catalog|demo|refusal|gpu`: the benchmarks
behind docs/performance.md.

Each area takes the settings flags of the runtime command it measures (inference.flags), so a
figure is measured on the settings it is quoted for.

`bench serving` is the serving comparison as one command (loadtest/bench/serving.py): the model
in-process (floor), the sidecar over gRPC and HTTP, the sidecar on Triton and Infinity (`make
infinity`), per variant, on one stream of distinct shopper queries, open loop at batch 1: the
model's batched ceiling, a fixed-rate run per target in alternating rounds, then a rate sweep
that drops a target at its first step over the SLA or with any error. One serving.json, one
serving.md table and one serving.png in --out; a missing Infinity is a row, not a failure:

  embedcar bench serving                                   # everything: ~25 min on 2 cores, 50 at most
  embedcar bench serving --variants fp32 --targets floor,grpc,http --rate 50 --rounds 1 \
      --duration 5 --sweep 50:100:50 --sweep-duration 5    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from catalog import settings as catalog
from embedcar_settings import DemoSettings, Settings
from inference import settings as inference
from inference.cli import add_model_flags
from inference.files import atomic_write_text
from inference.flags import add_flags, flag_overrides
from sidecar import settings as sidecar
from sidecar.cli import add_sidecar_flags


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="the benchmarks behind docs/performance.md (model, int8, triton, sidecar, "
                       "serving, neighbour, catalog, demo, refusal, gpu)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    areas = p.add_subparsers(dest="bench_area", required=True, metavar="AREA")
    _register_model(areas)
    _register_triton(areas)
    _register_sidecar(areas)
    _register_serving(areas)
    _register_neighbour(areas)
    _register_catalog(areas)
    _register_demo(areas)
    _register_refusal(areas)
    _register_int8(areas)
    _register_gpu(areas)


# --- model ----------------------------------------------------------------------------------
def _register_model(areas: Any) -> None:
    p = areas.add_parser("model", help="raw ONNX Runtime latency per variant/shape/threads (Markdown)")
    add_model_flags(p)
    p.add_argument("--variants", type=_items, default="fp32,int8", help="comma-separated variants")
    p.add_argument("--thread-counts", dest="bench_threads", type=_items, default="1,2",
                   help="comma-separated intra-op threads")
    p.add_argument("--reps", type=int, default=300, help="timed calls per batch-1 shape")
    p.set_defaults(func=_model)


def _model(args: argparse.Namespace) -> int:
    from loadtest.bench.model import run

    s = inference.Settings.load(overrides=flag_overrides(args)).model
    print(run(s.model_dir, args.variants, [int(t) for t in args.bench_threads], args.reps))
    return 0


# --- triton ---------------------------------------------------------------------------------
def _register_triton(areas: Any) -> None:
    p = areas.add_parser("triton", help="single-query latency: Triton ensemble vs embedded vs raw ORT")
    add_flags(p, "model", inference.ModelSettings, "models_dir", "variant")
    add_flags(p, "triton", inference.TritonSettings, "max_queue_delay_us", "instances")  # the own server's
    p.add_argument("--url", default=None, help="a running Triton's gRPC address (default: start one)")
    p.add_argument("--shapes", default="1x16,1x32,1x64", help="batch x tokens list")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--compare-step", action="store_true",
                   help="also start a server with pooling as its own step (the GPU layout) and time it alike")
    p.add_argument("--trace", type=Path, default=None,
                   help="trace every request of the own server into this file and add per-phase P50/P95")
    p.add_argument("--shm", action="store_true",
                   help="also time the same server with the tensors in system shared memory instead of the "
                        "gRPC messages (a local Triton)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    p.set_defaults(func=_triton)


def _triton(args: argparse.Namespace) -> int:
    from loadtest.bench.triton import bench, parse_shapes, save_json

    settings = inference.Settings.load(overrides=flag_overrides(args))
    report = bench(settings, url=args.url, shapes=parse_shapes(args.shapes), reps=args.reps, warmup=args.warmup,
                   compare_step=args.compare_step, trace=args.trace, shm=args.shm)
    print(report.markdown())
    if args.json:
        save_json(report, args.json)
    return 0


# --- sidecar --------------------------------------------------------------------------------
def _register_sidecar(areas: Any) -> None:
    p = areas.add_parser("sidecar", help="latency of Embed: cache hit, cache miss per backend, raw ORT")
    add_sidecar_flags(p)
    p.add_argument("-n", "--requests", type=int, default=300, help="requests per measured case")
    p.add_argument("--start-triton", action="store_true", help="also start a local tritonserver and "
                   "measure the Triton backend (needs the nvidia-pytriton wheel)")
    p.add_argument("--overload-qps", type=float, default=0.0,
                   help="also offer this many new queries/s open-loop (beyond capacity) to test backpressure")
    p.add_argument("--overload-seconds", type=float, default=5.0, help="duration of the overload run")
    p.add_argument("--overload-deadline-ms", type=float, default=50.0, help="client deadline in the overload run")
    p.add_argument("--floor", action="store_true", help="also time cache hits against a do-nothing gRPC "
                   "server with the same reply (loadtest/bench/floor.py): what any Python gRPC service pays here")
    p.add_argument("--uds", action="store_true", help="the measured sidecars also listen on a Unix "
                   "socket in a temporary folder and the client calls them over it instead of loopback TCP")
    p.add_argument("--out", type=Path, default=Path("reports/bench_sidecar.json"), help="JSON report path")
    p.set_defaults(func=_sidecar)


def _sidecar(args: argparse.Namespace) -> int:
    from loadtest.bench.sidecar import run_bench

    settings = sidecar.Settings.load(overrides=flag_overrides(args))
    report = run_bench(settings, requests=args.requests, start_triton=args.start_triton,
                       overload_qps=args.overload_qps, overload_s=args.overload_seconds,
                       overload_deadline_ms=args.overload_deadline_ms, uds=args.uds, floor=args.floor,
                       out=args.out)
    print(json.dumps(report["summary"], indent=2))
    return 0


# --- serving --------------------------------------------------------------------------------
# loadtest.bench.serving.DEFAULT_KINDS and KINDS (not imported here: slow)
SERVING_TARGETS = "floor,grpc,stream,stream-native,http,triton,infinity"
SERVING_ALL_TARGETS = "floor,grpc,stream,grpc-native,stream-native,http,triton,infinity"
INFINITY_EXE = Path("var/infinity-venv/bin/infinity_emb")  # loadtest.infinity.DEFAULT_EXE


def _register_serving(areas: Any) -> None:
    p = areas.add_parser(
        "serving", help="floor vs sidecar gRPC/HTTP vs Triton vs Infinity on one query stream: one table, one PNG",
        description="The serving comparison as one command: per variant the model's batched ceiling, fixed-rate "
                    "rounds and a rate sweep of every target, open loop at batch 1 on distinct shopper queries. "
                    "Writes serving.json, serving.md and serving.png to --out. Details: loadtest/bench/serving.py.")
    add_model_flags(p)
    what = p.add_argument_group("what to compare")
    what.add_argument("--variants", type=_items, default="fp32,int8",
                      help="comma-separated variants (default fp32,int8)")
    what.add_argument("--targets", type=_items, default=SERVING_TARGETS,
                      help=f"comma-separated, some of {SERVING_ALL_TARGETS} (default {SERVING_TARGETS}; "
                           "the -native ones: the same calls from the compiled C++ sender)")
    what.add_argument("--triton-variants", type=_items, default="fp32",
                      help="variants with a triton row (default fp32)")
    what.add_argument("--infinity-variants", type=_items, default="fp32",
                      help="variants with an infinity row (default fp32)")
    what.add_argument("--infinity-exe", type=Path, default=INFINITY_EXE,
                      help=f"Infinity's executable (default {INFINITY_EXE}, made by `make infinity`; missing: the "
                           "infinity rows say so and the rest runs)")
    load = p.add_argument_group("load (open loop, batch 1, every query distinct)")
    load.add_argument("--rate", type=float, default=100.0, help="fixed rate, requests/s (default 100)")
    load.add_argument("--rounds", type=int, default=2, help="fixed-rate rounds, every other reversed (default 2)")
    load.add_argument("--duration", type=float, default=20.0, help="measured seconds per fixed-rate run (default 20)")
    load.add_argument("--warmup", type=float, default=5.0, help="uncounted seconds before each (default 5)")
    load.add_argument("--sweep", default="25:400:25", metavar="START:STOP:STEP",
                      help="sweep rates (default 25:400:25); 'off' for none")
    load.add_argument("--sweep-duration", type=float, default=15.0, help="measured seconds per step (default 15)")
    load.add_argument("--sweep-warmup", type=float, default=3.0, help="uncounted seconds per step (default 3)")
    load.add_argument("--sla-ms", type=float, default=20.0, help="P95 budget of a passing step (default 20)")
    load.add_argument("--deadline-ms", type=float, default=1000.0, help="per-request deadline (default 1000)")
    load.add_argument("--seed", type=int, default=0, help="query stream seed (default 0)")
    load.add_argument("--ceiling-seconds", type=float, default=3.0, help="timed seconds of the ceiling (default 3)")
    load.add_argument("--settle", type=float, default=1.0, help="pause between runs, seconds (default 1)")
    rep = p.add_argument_group("report")
    rep.add_argument("--out", type=Path, default=Path("reports/bench/serving"), help="report folder")
    rep.add_argument("--log-dir", type=Path, default=Path("var/bench/serving"), help="server logs")
    p.set_defaults(func=_serving)


def _serving(args: argparse.Namespace) -> int:
    from loadtest.bench.serving import ServingConfig, command_line, run_serving
    from loadtest.sweep import parse_sweep

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    settings = sidecar.Settings.load(overrides=flag_overrides(args))
    rates = () if args.sweep.strip().lower() in ("off", "none", "") else tuple(parse_sweep(args.sweep))
    cfg = ServingConfig(
        variants=tuple(args.variants), targets=tuple(args.targets), triton_variants=tuple(args.triton_variants),
        infinity_variants=tuple(args.infinity_variants), rate=args.rate, rounds=args.rounds,
        duration_s=args.duration, warmup_s=args.warmup, sweep_rates=rates, sweep_duration_s=args.sweep_duration,
        sweep_warmup_s=args.sweep_warmup, sla_ms=args.sla_ms, deadline_ms=args.deadline_ms, seed=args.seed,
        ceiling_s=args.ceiling_seconds, settle_s=args.settle, infinity_exe=args.infinity_exe, log_dir=args.log_dir,
    ).validate()
    fallback = ["bench", "serving", "--variants", ",".join(cfg.variants), "--targets", ",".join(cfg.targets),
                "--rate", f"{cfg.rate:g}", "--rounds", str(cfg.rounds), "--duration", f"{cfg.duration_s:g}",
                "--warmup", f"{cfg.warmup_s:g}", "--sweep", args.sweep, "--sweep-duration",
                f"{cfg.sweep_duration_s:g}", "--sweep-warmup", f"{cfg.sweep_warmup_s:g}", "--out", str(args.out)]
    _result, paths = run_serving(settings, cfg, out_dir=args.out, command=command_line(fallback))
    print(paths["md"].read_text())
    print(f"reports: {', '.join(str(p) for p in paths.values())}")
    return 0  # a benchmark, not a gate


# --- neighbour ------------------------------------------------------------------------------
# loadtest.bench.neighbour.DEFAULT_CONFIGS and CONFIGS (not imported here: slow)
NEIGHBOUR_CONFIGS = ("model-1t,model-2t,default,every-core,event-engine,stream,asyncio-loop,system-malloc,triton,"
                     "triton-system-malloc")
NEIGHBOUR_ALL_CONFIGS = NEIGHBOUR_CONFIGS


def _register_neighbour(areas: Any) -> None:
    p = areas.add_parser(
        "neighbour", help="the sidecar's CPU per query and latency per configuration, and what it costs a "
                          "search-engine process beside it: one table, one PNG",
        description="Per configuration (the model alone, the sidecar's embedded backend as shipped and with "
                    "each lever switched, the Triton backend), open loop at --rate: P50/P95, the sidecar's CPU "
                    "per query from /proc, its idle CPU, then the same load beside a one-core search-engine "
                    "stand-in (tantivy + FAISS over the grocery catalog) and that process's queries/s. Writes "
                    "neighbour.json, neighbour.md and neighbour.png to --out. Details: loadtest/bench/neighbour.py.")
    add_model_flags(p)
    p.add_argument("--configs", type=_items, default=NEIGHBOUR_CONFIGS,
                   help=f"comma-separated, some of {NEIGHBOUR_ALL_CONFIGS} (default {NEIGHBOUR_CONFIGS})")
    p.add_argument("--rate", type=float, default=100.0, help="requests/s, open loop (default 100)")
    p.add_argument("--duration", type=float, default=20.0,
                   help="measured seconds per window (default 20; each configuration has two, quiet and beside)")
    p.add_argument("--warmup", type=float, default=3.0, help="uncounted seconds before them (default 3)")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of the idle-CPU window (default 10)")
    p.add_argument("--sla-ms", type=float, default=20.0, help="P95 budget beside the neighbour (default 20)")
    p.add_argument("--seed", type=int, default=0, help="query stream seed (default 0)")
    p.add_argument("--pairs", type=int, default=4,
                   help="blocks of each sidecar row's quiet window, each beside a block of the model alone in this "
                        "process, the verdicts' reference (default 4; 0 = judge against the model rows)")
    p.add_argument("--no-neighbour", dest="neighbour", action="store_false",
                   help="quiet windows only (no search-engine process, no beside columns)")
    p.add_argument("--items", type=int, default=50_000, help="vectors in the neighbour's FAISS index (default 50000)")
    p.add_argument("--embedded-items", type=int, default=1024,
                   help="of them, titles embedded by the model; the rest noisy copies (default 1024)")
    p.add_argument("--out", type=Path, default=Path("reports/bench/neighbour"), help="report folder")
    p.add_argument("--data-dir", type=Path, default=Path("var/bench/neighbour/data"),
                   help="the neighbour's indexes (built once, reused)")
    p.add_argument("--log-dir", type=Path, default=Path("var/bench/neighbour"), help="server logs")
    p.set_defaults(func=_neighbour)


def _neighbour(args: argparse.Namespace) -> int:
    from loadtest.bench.neighbour import NeighbourConfig, run_neighbour
    from loadtest.bench.serving import command_line

    settings = sidecar.Settings.load(overrides=flag_overrides(args))
    cfg = NeighbourConfig(configs=tuple(args.configs), rate=args.rate, duration_s=args.duration,
                          warmup_s=args.warmup, idle_s=args.idle, sla_ms=args.sla_ms, seed=args.seed,
                          pairs=args.pairs, neighbour=args.neighbour, items=args.items,
                          embedded_items=args.embedded_items, data_dir=args.data_dir,
                          log_dir=args.log_dir).validate()
    fallback = ["bench", "neighbour", "--configs", ",".join(cfg.configs), "--rate", f"{cfg.rate:g}",
                "--duration", f"{cfg.duration_s:g}", "--out", str(args.out)]
    _result, paths = run_neighbour(settings, cfg, out_dir=args.out, command=command_line(fallback, "neighbour"))
    print(paths["md"].read_text())
    print(f"reports: {', '.join(str(p) for p in paths.values())}")
    return 0  # a benchmark, not a gate


# --- catalog --------------------------------------------------------------------------------
def _register_catalog(areas: Any) -> None:
    p = areas.add_parser("catalog", help="batch-job throughput and index build/size/search (run on a quiet machine)")
    csub = p.add_subparsers(dest="bench_catalog", required=True)
    build = csub.add_parser("build", help="full-catalog build time, items/s, and fraction of raw ORT throughput")
    _catalog_flags(build)
    add_flags(build, "catalog", catalog.CatalogSettings, "text_fields")
    build.add_argument("--limit", type=int, default=None, help="only the first N products")
    build.add_argument("--json", dest="json_out", default=None, help="also write the result here")
    build.set_defaults(func=_catalog_build)
    search = csub.add_parser("search", help="index build time/size and single-query latency per type and size")
    _catalog_flags(search)
    search.add_argument("--sizes", type=_items, default="50000,1000000", help="comma-separated item counts")
    search.add_argument("--types", type=_items, default="flat,hnsw,ivf,ivfpq", help="comma-separated index types")
    add_flags(search, "catalog", catalog.CatalogSettings, "ivfpq_refine")
    search.add_argument("--work-dir", type=Path, default=None,
                        help="where sizes too large for memory are memory-mapped from (default: the temp dir)")
    search.add_argument("--queries", type=int, default=500, help="single queries timed per index")
    search.add_argument("--hnsw-max-items", type=int, default=200_000, help="skip HNSW above this size")
    search.add_argument("--json", dest="json_out", default=None, help="also write the rows here")
    search.set_defaults(func=_catalog_search)
    hybrid = csub.add_parser("hybrid", help="hybrid Search's time per query after the embedding, with the index's "
                             "attribute vocabulary against without (alternating rounds; judged queries, every cut)")
    _catalog_flags(hybrid)
    hybrid.add_argument("--rounds", type=int, default=6, help="alternating rounds of every query")
    hybrid.set_defaults(func=_catalog_hybrid)


def _catalog_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, "catalog", catalog.CatalogSettings, "index_root", "index_type", "batch_size", "in_flight")
    add_model_flags(p)


def _catalog_hybrid(args: argparse.Namespace) -> int:
    from loadtest.bench.catalog import bench_hybrid

    print(json.dumps(bench_hybrid(catalog.Settings.load(overrides=flag_overrides(args)), rounds=args.rounds),
                     indent=2))
    return 0


def _catalog_build(args: argparse.Namespace) -> int:
    from loadtest.bench.catalog import bench_build

    result = bench_build(catalog.Settings.load(overrides=flag_overrides(args)), limit=args.limit)
    print(json.dumps(result, indent=2))
    if args.json_out:
        atomic_write_text(Path(args.json_out), json.dumps(result, indent=2, default=str))
    return 0


def _catalog_search(args: argparse.Namespace) -> int:
    from loadtest.bench.catalog import bench_search_newest, search_markdown

    rows, real = bench_search_newest(catalog.Settings.load(overrides=flag_overrides(args)),
                                     sizes=[int(x) for x in args.sizes], types=args.types,
                                     queries=args.queries, hnsw_max_items=args.hnsw_max_items,
                                     work_dir=args.work_dir)
    print(search_markdown(rows))
    print(f"(vectors beyond {real} items are synthetic: noisy copies of real product embeddings)")
    if args.json_out:
        atomic_write_text(Path(args.json_out), json.dumps(rows, indent=2, default=str))
    return 0


# --- demo -----------------------------------------------------------------------------------
def _register_demo(areas: Any) -> None:
    p = areas.add_parser("demo", help="scripted typist on a running demo: per-keystroke P50/P95 by stage")
    add_flags(p, "demo", DemoSettings, "host", "port", "budget_ms")  # the demo's address, the budget line
    p.add_argument("--url", default=None, help="websocket URL (default ws://HOST:PORT/ws from the demo settings)")
    p.add_argument("--queries", type=int, default=200, help="queries to type (default 200)")
    p.add_argument("--key-interval-ms", type=float, default=60.0, help="time between keystrokes (default 60)")
    p.add_argument("--seed", type=int, default=7, help="query sampling seed")
    p.add_argument("--out", type=Path, default=None, help="also write the summary as JSON here")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from loadtest.bench.demo import bench

    s = Settings.load(overrides=flag_overrides(args)).demo
    url = args.url or f"ws://{s.host}:{s.port}/ws"
    bench(url, n_queries=args.queries, key_interval_ms=args.key_interval_ms, seed=args.seed,
          budget_ms=s.budget_ms, out=args.out)
    return 0


# --- refusal --------------------------------------------------------------------------------
def _register_refusal(areas: Any) -> None:
    p = areas.add_parser("refusal", help="server CPU per refused gRPC call: in a handler, by grpc.aio's "
                         "concurrency limit, or by gRPC's C core with the event loop held (heavy overload)")
    p.add_argument("--rounds", type=int, default=3, help="alternating blocks per way (default 3)")
    p.add_argument("--calls", type=int, default=2000, help="calls per block (default 2000)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    p.set_defaults(func=_refusal)


def _refusal(args: argparse.Namespace) -> int:
    from loadtest.bench.refusal import markdown, run

    result = run(rounds=args.rounds, calls=args.calls)
    print(markdown(result, rounds=args.rounds, calls=args.calls))
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0


def _register_int8(areas: Any) -> None:
    p = areas.add_parser("int8", help="int8 schemes against fp32 in one run: latency at batch 1 and 32, quality, "
                         "and whether a text's vector depends on its batch (also `python -m loadtest.bench.int8`)")
    p.add_argument("--model-dir", type=Path, default=None, help="a prepared model (default: the bundled MiniLM's)")
    p.add_argument("--out", type=Path, default=Path("var/bench/int8"), help="report folder")
    p.add_argument("--candidates", type=_items, default=None, help="comma-separated schemes (default: all)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--reps", type=int, default=60, help="batch-1 calls per round and variant (default 60)")
    p.add_argument("--products", type=int, default=5000, help="catalog titles for recall@10 (default 5000)")
    p.set_defaults(func=_int8)


def _int8(args: argparse.Namespace) -> int:
    from loadtest.bench import int8

    argv = ["--out", str(args.out), "--rounds", str(args.rounds), "--reps", str(args.reps),
            "--products", str(args.products)]
    if args.model_dir is not None:
        argv += ["--model-dir", str(args.model_dir)]
    if args.candidates is not None:
        argv += ["--candidates", ",".join(args.candidates)]
    return int8.main(argv)


# --- gpu ------------------------------------------------------------------------------------
def _register_gpu(areas: Any) -> None:
    p = areas.add_parser("gpu", help="the check to run on a GPU machine: its facts, the gpu tests, "
                         "torch floor vs sidecar (torch, Triton) latency (docs/gpu.md; also "
                         "`python3 -m loadtest.bench.gpu` where embedcar is not installed)")
    from loadtest.bench.gpu import add_arguments  # stdlib only at import: cheap

    add_arguments(p)
    p.set_defaults(func=_gpu)


def _gpu(args: argparse.Namespace) -> int:
    from loadtest.bench.gpu import run_args

    return run_args(args)


def _items(text: str) -> list[str]:
    """A comma-separated flag value (an argparse type): its non-empty items."""
    if not (items := [x.strip() for x in text.split(",") if x.strip()]):
        raise argparse.ArgumentTypeError(f"empty list {text!r}")
    return items
