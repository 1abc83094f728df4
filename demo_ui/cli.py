"""`embedcar demo`: set up and start the whole typeahead stack (its benchmark: `embedcar bench demo`)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from embedcar_settings import DemoSettings, Settings
from inference.flags import add_flags, flag_overrides


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="set up and start the typeahead demo (model, index, Triton, sidecar, page)")
    add_flags(p, "demo", DemoSettings, "host", "port", "budget_ms", "search_mode", "tls_cert_file", "tls_key_file")
    p.add_argument("--backend", choices=("auto", "triton", "embedded"), default="auto",
                   help="auto: local Triton where it can run, else embedded ONNX Runtime")
    p.add_argument("--no-triton", action="store_true", help="same as --backend embedded")
    p.add_argument("--compare", metavar="NAME",
                   help="also search with the prepared model NAME (e.g. one `embedcar model tune` published) "
                        "and show both models' results side by side")
    p.set_defaults(func=_run)


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.load(overrides=flag_overrides(args))


def _run(args: argparse.Namespace) -> int:
    from demo_ui.stack import run_demo
    from sidecar.allocator import use

    settings = _settings(args)
    # The sidecar runs in this process: its malloc, as `sidecar serve`'s (may start this program again).
    logging.getLogger("demo_ui").info("allocator: %s", use(settings.sidecar.allocator))
    backend = "embedded" if args.no_triton else args.backend
    return run_demo(settings, backend=backend, compare=args.compare)
