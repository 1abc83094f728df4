"""`embedcar sidecar serve` (run until Ctrl-C/SIGTERM, then stop gracefully) and `embedcar sidecar bench`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import Any

from inference.cli import add_model_flags
from inference.settings import Settings

log = logging.getLogger("sidecar")


def add_sidecar_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--host", default=None, help="bind address (EMBEDCAR_SIDECAR_HOST); non-loopback needs keys")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC port, 0 = free (EMBEDCAR_SIDECAR_GRPC_PORT)")
    p.add_argument("--uds-path", type=Path, default=None,
                   help="also serve gRPC on this Unix socket, mode 0660 (EMBEDCAR_SIDECAR_UDS_PATH)")
    p.add_argument("--http-port", type=int, default=None,
                   help="HTTP facade port, 0 = free, -1 = off (EMBEDCAR_SIDECAR_HTTP_PORT)")
    p.add_argument("--backend", choices=("embedded", "triton"), default=None, help="EMBEDCAR_SIDECAR_BACKEND")
    p.add_argument("--triton-url", action="append", default=None,
                   help="Triton gRPC address, repeatable (EMBEDCAR_TRITON_URLS)")
    p.add_argument("--index-dir", type=Path, default=None, help="catalog index root for Search")
    p.add_argument("--api-keys-file", type=Path, default=None, help="file of `tenant key` lines")
    p.add_argument("--warm-queries", type=Path, default=None, help="file of top queries to pre-load the cache")
    p.add_argument("--cache-entries", type=int, default=None, help="cache size in entries, 0 = off")


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings.load(overrides={
        "model": {"models_dir": Path(args.models_dir) if args.models_dir else None, "name": args.model_name,
                  "variant": args.variant, "intra_op_threads": args.threads},
        "triton": {"urls": tuple(args.triton_url) if args.triton_url else None},
        "sidecar": {"host": args.host, "grpc_port": args.grpc_port, "uds_path": args.uds_path,
                    "http_port": args.http_port,
                    "backend": args.backend, "index_dir": args.index_dir, "api_keys_file": args.api_keys_file,
                    "warm_queries_file": args.warm_queries, "cache_entries": args.cache_entries},
    })


def register(sub: Any) -> None:
    p = sub.add_parser("sidecar", help="the embedding sidecar (gRPC + HTTP)")
    ssub = p.add_subparsers(dest="sidecar_command", required=True)
    serve = ssub.add_parser("serve", help="serve until Ctrl-C / SIGTERM, then stop gracefully")
    add_sidecar_flags(serve)
    serve.set_defaults(func=_serve)
    bench = ssub.add_parser("bench", help="latency of Embed: cache hit, cache miss per backend, raw ORT")
    add_sidecar_flags(bench)
    bench.add_argument("-n", "--requests", type=int, default=300, help="requests per measured case")
    bench.add_argument("--start-triton", action="store_true", help="also start a local tritonserver and "
                       "measure the Triton backend (needs the nvidia-pytriton wheel)")
    bench.add_argument("--overload-qps", type=float, default=0.0,
                       help="also offer this many new queries/s open-loop (beyond capacity) to test backpressure")
    bench.add_argument("--overload-seconds", type=float, default=5.0, help="duration of the overload run")
    bench.add_argument("--overload-deadline-ms", type=float, default=50.0, help="client deadline in the overload run")
    bench.add_argument("--floor", action="store_true", help="also time cache hits against a do-nothing gRPC "
                       "server with the same reply (sidecar/floor.py): what any Python gRPC service pays here")
    bench.add_argument("--uds", action="store_true", help="the measured sidecars also listen on a Unix "
                       "socket in a temporary folder and the client calls them over it instead of loopback TCP")
    bench.add_argument("--out", type=Path, default=Path("reports/bench_sidecar.json"), help="JSON report path")
    bench.set_defaults(func=_bench)


def _serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    log.info("settings: %s", json.dumps(settings.describe()["sidecar"]))  # secrets redacted
    asyncio.run(_serve_async(settings))
    return 0


async def _serve_async(settings: Settings) -> None:
    from sidecar.app import Sidecar

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sidecar = Sidecar(settings)
    await sidecar.start()
    print(f"sidecar ready: grpc {settings.sidecar.host}:{sidecar.grpc_port}"
          f"{f', grpc {sidecar.uds_target}' if sidecar.uds_target is not None else ''}"
          f"{f', http {settings.sidecar.host}:{sidecar.http_port}' if sidecar.http_port is not None else ''}",
          flush=True)
    await stop.wait()
    log.info("stopping: finishing in-flight requests (grace %.1f s)", settings.sidecar.grace_s)
    await sidecar.stop()


def _bench(args: argparse.Namespace) -> int:
    from sidecar.bench import run_bench

    report = run_bench(settings_from_args(args), requests=args.requests, start_triton=args.start_triton,
                       overload_qps=args.overload_qps, overload_s=args.overload_seconds,
                       overload_deadline_ms=args.overload_deadline_ms, uds=args.uds, floor=args.floor,
                       out=args.out)
    print(json.dumps(report["summary"], indent=2))
    return 0
