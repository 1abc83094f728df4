"""`embedcar faults`: drive real processes through failures and report what callers saw.

Examples:
  embedcar faults                               # every scenario, full length (tens of minutes)
  embedcar faults --only overload,triton-kill   # some of them
  embedcar faults --quick                       # the short form the test suite runs
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from embedcar_settings import Settings
from inference.cli import add_model_flags
from inference.flags import flag_overrides
from loadtest.faults.runner import run_scenarios, scenarios, write_report


def register(sub: Any) -> None:
    p = sub.add_parser("faults", help="fault suite: Triton kills, index swaps, job kills, overload, fuzzing, auth",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help=f"comma-separated scenarios (default all: {', '.join(scenarios())})")
    p.add_argument("--quick", action="store_true", help="the short form of each scenario")
    p.add_argument("--out", type=Path, default=Path("reports/faults"), help="report folder (Markdown + JSON)")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    add_model_flags(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe request otherwise
    settings = Settings.load(overrides=flag_overrides(args))
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    command = "embedcar faults " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    with tempfile.TemporaryDirectory(prefix="embedcar-faults-") as tmp:
        work = args.work_dir or Path(tmp)
        results = run_scenarios(settings, names, work, quick=args.quick)
    paths = write_report(results, args.out, quick=args.quick, command=command.strip())
    print(paths["md"].read_text())
    print(f"reports: {paths['md']}, {paths['json']}")
    return 0 if all(r.passed for r in results) else 1
