"""`embedcar docs reference`: write the reference pages (settings, metrics, HTTP API, catalog files)
from the code.

It lives at the top level beside embedcar_settings.py, whose `Settings` holds every section; the pages
themselves are rendered where their data is (inference/settings_reference.py,
sidecar/metrics_reference.py, sidecar/http_reference.py, catalog/files_reference.py). `--check` writes
nothing and fails when a page is stale (CI).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from catalog.files_reference import catalog_files_page
from embedcar_settings import Settings
from inference.files import atomic_write_text
from inference.settings_reference import settings_page
from sidecar.http_reference import http_page
from sidecar.metrics_reference import metrics_page

DOCS = Path("docs")


def pages() -> dict[str, str]:
    """File name under docs/ -> its generated text."""
    return {"settings.md": settings_page(Settings), "metrics.md": metrics_page(), "http.md": http_page(),
            "catalog-files.md": catalog_files_page()}


def stale(docs: Path = DOCS) -> list[Path]:
    """The pages under `docs` that differ from what the code generates (or are missing)."""
    out = []
    for name, text in pages().items():
        path = docs / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(path)
    return out


def write(docs: Path = DOCS) -> list[Path]:
    """Every page rendered first (an error writes nothing), then each file replaced atomically."""
    rendered = pages()
    for name, text in rendered.items():
        atomic_write_text(docs / name, text)
    return [docs / name for name in rendered]


def register(sub: Any) -> None:
    p = sub.add_parser("docs", help="generate the reference pages from the code")
    what = p.add_subparsers(dest="docs_command", required=True, metavar="PAGE")
    ref = what.add_parser("reference", help="docs/settings.md (every setting), docs/metrics.md (every metric), "
                          "docs/http.md (the HTTP API) and docs/catalog-files.md (product files)")
    ref.add_argument("--out", type=Path, default=DOCS, help="folder to write into (default docs)")
    ref.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    ref.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.check:
        behind = stale(args.out)
        for path in behind:
            print(f"{path} is stale: run `embedcar docs reference`", file=sys.stderr)
        return 1 if behind else 0
    for path in write(args.out):
        print(f"wrote {path}")
    return 0
