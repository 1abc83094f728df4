"""`embedcar bench model|triton|sidecar|catalog|demo`: the benchmarks behind docs/benchmarks.md.

Each area takes the settings flags of the runtime command it measures (inference.flags), so a
figure is measured on the settings it is quoted for.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from catalog import settings as catalog
from demo_ui import settings as demo
from inference import settings as inference
from inference.cli import add_model_flags
from inference.files import atomic_write_text
from inference.flags import add_flags, flag_overrides
from sidecar import settings as sidecar
from sidecar.cli import add_sidecar_flags


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="the benchmarks behind docs/benchmarks.md (model, triton, sidecar, catalog, demo)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    areas = p.add_subparsers(dest="bench_area", required=True, metavar="AREA")
    _register_model(areas)
    _register_triton(areas)
    _register_sidecar(areas)
    _register_catalog(areas)
    _register_demo(areas)


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
    add_flags(p, "triton", inference.TritonSettings, "max_queue_delay_us", "cpu_instances")  # the own server's
    p.add_argument("--url", default=None, help="a running Triton's gRPC address (default: start one)")
    p.add_argument("--shapes", default="1x16,1x32,1x64", help="batch x tokens list")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--compare-step", action="store_true",
                   help="also start a server with pooling as its own step (cpu_pooling=step) and time it alike")
    p.add_argument("--trace", type=Path, default=None,
                   help="trace every request of the own server into this file and add per-phase P50/P95")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    p.set_defaults(func=_triton)


def _triton(args: argparse.Namespace) -> int:
    from loadtest.bench.triton import bench, parse_shapes, save_json

    settings = inference.Settings.load(overrides=flag_overrides(args))
    report = bench(settings, url=args.url, shapes=parse_shapes(args.shapes), reps=args.reps, warmup=args.warmup,
                   compare_step=args.compare_step, trace=args.trace)
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
    search.add_argument("--types", type=_items, default="flat,ivf,hnsw", help="comma-separated index types")
    search.add_argument("--queries", type=int, default=500, help="single queries timed per index")
    search.add_argument("--hnsw-max-items", type=int, default=200_000, help="skip HNSW above this size")
    search.add_argument("--json", dest="json_out", default=None, help="also write the rows here")
    search.set_defaults(func=_catalog_search)


def _catalog_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, "catalog", catalog.CatalogSettings, "index_root", "index_type", "batch_size", "in_flight")
    add_model_flags(p)


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
                                     queries=args.queries, hnsw_max_items=args.hnsw_max_items)
    print(search_markdown(rows))
    print(f"(vectors beyond {real} items are synthetic: noisy copies of real product embeddings)")
    if args.json_out:
        atomic_write_text(Path(args.json_out), json.dumps(rows, indent=2, default=str))
    return 0


# --- demo -----------------------------------------------------------------------------------
def _register_demo(areas: Any) -> None:
    p = areas.add_parser("demo", help="scripted typist on a running demo: per-keystroke P50/P95 by stage")
    add_flags(p, "demo", demo.DemoSettings, "host", "port", "budget_ms")  # the demo's address, the budget line
    p.add_argument("--url", default=None, help="websocket URL (default ws://HOST:PORT/ws from the demo settings)")
    p.add_argument("--queries", type=int, default=200, help="queries to type (default 200)")
    p.add_argument("--key-interval-ms", type=float, default=60.0, help="time between keystrokes (default 60)")
    p.add_argument("--seed", type=int, default=7, help="query sampling seed")
    p.add_argument("--out", type=Path, default=None, help="also write the summary as JSON here")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from loadtest.bench.demo import bench

    s = demo.Settings.load(overrides=flag_overrides(args)).demo
    url = args.url or f"ws://{s.host}:{s.port}/ws"
    bench(url, n_queries=args.queries, key_interval_ms=args.key_interval_ms, seed=args.seed,
          budget_ms=s.budget_ms, out=args.out)
    return 0


def _items(text: str) -> list[str]:
    """A comma-separated flag value (an argparse type): its non-empty items."""
    if not (items := [x.strip() for x in text.split(",") if x.strip()]):
        raise argparse.ArgumentTypeError(f"empty list {text!r}")
    return items
