"""The `embedcar` command: one tool, subcommands registered by each package.

Packages declare their subcommands as `embedcar.commands` entry points (pyproject.toml), so this
dispatcher at the bottom layer never imports the layers above it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points
from typing import Any

from inference.errors import EmbedcarError, ModelError
from inference.grpc_io import prefer_polling_io


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embedcar", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_entry_points(sub, "embedcar.commands")
    return parser


def register_entry_points(sub: Any, group: str) -> None:
    """Call each `group` entry point's register(sub), by name. Also used one level down (`embedcar
    model` iterates `embedcar.model_commands`), so a higher layer can add a subcommand there."""
    for ep in sorted(entry_points(group=group), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as exc:
            # One package failing to import (a missing optional dependency) must not take the
            # other commands down; the broken one explains itself when called.
            broken = sub.add_parser(ep.name, help=f"(unavailable: {exc})")
            broken.set_defaults(func=_unavailable(ep.name, exc))
            continue
        register(sub)


# Libraries only the load-test and benchmark tools import: pyproject's `tools` extra, not the service's
# dependencies (the image and a plain `pip install embedcar` leave them out).
TOOLS_EXTRA = ("matplotlib", "aiohttp", "httpx")


def missing_extra(exc: BaseException) -> str | None:
    """The one-line fix where `exc` is a tools-only library that is not installed, else None."""
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").partition(".")[0] in TOOLS_EXTRA:
        return (f"{exc.name} is not installed: the load-test and benchmark tools need the `tools` extra "
                "(pip install 'embedcar[tools]'; `make install` includes it)")
    return None


def _unavailable(name: str, exc: ImportError) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        raise ModelError(f"`embedcar {name}` cannot load: {missing_extra(exc) or exc}")

    return run


class OwnInfo(logging.Filter):
    """Our packages' records from INFO up, every other logger's from WARNING up.

    The libraries we call log at INFO for their own debugging (ONNX Runtime's quantizer a line per
    tensor, through the root logger): a newcomer's `make test` should show our progress, not theirs.
    """

    def __init__(self, packages: Iterable[str]) -> None:
        super().__init__()
        self.packages = frozenset(packages)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.partition(".")[0] in self.packages


def own_packages() -> set[str]:
    """The top-level packages that register `embedcar` subcommands: ours, whoever installed them."""
    return {ep.module.partition(".")[0] for ep in entry_points(group="embedcar.commands")}


def configure_logging(verbose: bool) -> None:
    """-v: every logger's DEBUG; else ours at INFO and the libraries' at WARNING. A filter on our
    handler rather than logger levels: a handler added later (a test's capture) still sees all."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if not verbose:
        handler.addFilter(OwnInfo(own_packages()))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])


def main(argv: list[str] | None = None) -> int:
    prefer_polling_io()  # before the subcommands import grpc (inference.grpc_io says why)
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every command's errors end here: one line, the traceback only with -v
        return report(exc, verbose=args.verbose)
    return int(rc or 0)


def _first_leaf(exc: BaseException) -> BaseException:
    """A task group's first error (asyncio wraps what a command's tasks raise)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _one_line(text: str) -> str:
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def report(exc: Exception, *, verbose: bool) -> int:
    """Print `exc` as one `embedcar: ...` line on stderr; the exit status. Our errors (2), the operating
    system's (a file, a socket: 1) and a value a library refused (1) are the user's to fix; anything else
    is a bug (70, EX_SOFTWARE), named as one. With -v the traceback is printed too."""
    leaf = _first_leaf(exc)
    if verbose:
        traceback.print_exception(exc)
    if isinstance(leaf, EmbedcarError):
        print(f"embedcar: {_one_line(leaf.message)}", file=sys.stderr)
        return 2
    if fix := missing_extra(leaf):
        print(f"embedcar: {fix}", file=sys.stderr)
        return 2
    if isinstance(leaf, OSError):
        where = f": {leaf.filename}" if leaf.filename else ""
        print(f"embedcar: {_one_line(leaf.strerror or str(leaf))}{where}", file=sys.stderr)
        return 1
    hint = "" if verbose else " (run `embedcar -v ...` for its traceback)"
    if isinstance(leaf, ValueError):  # mostly a value the user gave that a library refused
        print(f"embedcar: {_one_line(str(leaf))} ({type(leaf).__name__}){hint}", file=sys.stderr)
        return 1
    print(f"embedcar: internal error, a bug: {type(leaf).__name__}: {_one_line(str(leaf))}{hint}", file=sys.stderr)
    return 70


if __name__ == "__main__":
    sys.exit(main())
