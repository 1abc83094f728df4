"""`embedcar model report`: registered under `embedcar model` through the `embedcar.model_commands`
entry point group (inference/ cannot import this layer). Imports nothing heavy until it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from catalog.settings import CatalogSettings
from inference.flags import add_flags, flag_overrides
from inference.settings import ModelSettings


def register(msub: Any) -> None:
    p = msub.add_parser(
        "report", help="per model and variant on this host: latency, throughput, index size, quality, verdict",
        description="Per prepared model and variant, measured on this host: batch-1 latency (P50/P95) at 16 and 32 "
                    "tokens, batched throughput, index bytes per item, weak-label quality on the grocery catalog, "
                    "and whether RATE req/s at P95 <= SLA is within reach. One Markdown table, JSON and a PNG in "
                    "--out. Details: loadtest/bench/model_report.py.")
    p.add_argument("names", nargs="+", metavar="NAME", help="prepared models (under --models-dir)")
    add_flags(p, "model", ModelSettings, "models_dir", "intra_op_threads")
    add_flags(p, "catalog", CatalogSettings, "text_fields", "batch_size")
    p.add_argument("--variants", default="", help="comma-separated variants (default: every prepared one but fp16)")
    p.add_argument("--latency-samples", type=int, default=300, help="timed batch-1 calls per shape (default 300)")
    p.add_argument("--throughput-samples", type=int, default=30, help="timed batch-32 calls (default 30)")
    p.add_argument("--limit", type=int, default=5000,
                   help="grocery products embedded for the quality columns (default 5000; 0: no quality)")
    p.add_argument("--known-items", type=int, default=500, help="known-item queries (default 500)")
    p.add_argument("--rate", type=float, default=100.0, help="requests/s the verdict is about (default 100)")
    p.add_argument("--sla-ms", type=float, default=20.0, help="P95 budget the verdict is about (default 20)")
    p.add_argument("--out", type=Path, default=Path("reports/model_report"), help="report folder")
    p.add_argument("--set-default", action="store_true",
                   help="set each model's default variant from these measurements, as `embedcar model set-default` "
                        "does: the fastest within 0.01 nDCG@10 of fp32 (sidecars serving the default roll over to "
                        "it with its index)")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from catalog.settings import Settings
    from loadtest.bench.model_report import ReportConfig, run_report
    from loadtest.bench.model_verdict import Rule

    settings = Settings.load(overrides=flag_overrides(args))
    cfg = ReportConfig(variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
                       latency_samples=args.latency_samples, throughput_samples=args.throughput_samples,
                       quality_items=args.limit, known_items=args.known_items,
                       rule=Rule(rate=args.rate, sla_ms=args.sla_ms))
    _report_json, paths = run_report(settings, args.names, cfg, out_dir=args.out,
                                     command="embedcar " + " ".join(sys.argv[1:]), set_default=args.set_default,
                                     say=lambda m: print(m, file=sys.stderr))
    print(paths["md"].read_text())
    print(f"reports: {', '.join(str(p) for p in paths.values())}")
    return 0
