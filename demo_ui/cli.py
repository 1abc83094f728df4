"""`embedcar demo` (set up and start the whole typeahead stack) and `embedcar demo bench`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from inference.settings import Settings


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="set up and start the typeahead demo (model, index, Triton, sidecar, page)")
    p.add_argument("--host", default=None, help="demo web server address (EMBEDCAR_DEMO_HOST, loopback)")
    p.add_argument("--port", type=int, default=None, help="demo web server port, 0 = free (EMBEDCAR_DEMO_PORT)")
    p.add_argument("--backend", choices=("auto", "triton", "embedded"), default="auto",
                   help="auto: local Triton where it can run, else embedded ONNX Runtime")
    p.add_argument("--no-triton", action="store_true", help="same as --backend embedded")
    p.add_argument("--budget-ms", type=float, default=None, help="per-keystroke budget line (EMBEDCAR_DEMO_BUDGET_MS)")
    p.set_defaults(func=_run)

    dsub = p.add_subparsers(dest="demo_command", metavar="SUBCOMMAND")
    b = dsub.add_parser("bench", help="scripted typist on a running demo: per-keystroke P50/P95 by stage")
    b.add_argument("--url", default=None, help="websocket URL (default ws://HOST:PORT/ws from the demo settings)")
    b.add_argument("--queries", type=int, default=200, help="queries to type (default 200)")
    b.add_argument("--key-interval-ms", type=float, default=60.0, help="time between keystrokes (default 60)")
    b.add_argument("--seed", type=int, default=7, help="query sampling seed")
    b.add_argument("--budget-ms", type=float, default=None, help="budget to judge P95 against")
    b.add_argument("--out", type=Path, default=None, help="also write the summary as JSON here")
    b.set_defaults(func=_bench)


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.load(overrides={"demo": {
        "host": getattr(args, "host", None),
        "port": getattr(args, "port", None),
        "budget_ms": args.budget_ms,
    }})


def _run(args: argparse.Namespace) -> int:
    from demo_ui.stack import run_demo

    backend = "embedded" if args.no_triton else args.backend
    return run_demo(_settings(args), backend=backend)


def _bench(args: argparse.Namespace) -> int:
    from demo_ui.bench import bench

    s = _settings(args).demo
    url = args.url or f"ws://{s.host}:{s.port}/ws"
    bench(url, n_queries=args.queries, key_interval_ms=args.key_interval_ms, seed=args.seed,
          budget_ms=s.budget_ms, out=args.out)
    return 0
