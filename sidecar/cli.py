"""`embedcar sidecar serve`: run until Ctrl-C/SIGTERM, then stop gracefully."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from inference.cli import add_model_flags
from inference.flags import add_flags, flag_overrides
from inference.settings import TritonSettings
from sidecar.settings import Settings, SidecarSettings

if TYPE_CHECKING:
    from sidecar.app import Sidecar

log = logging.getLogger("sidecar")
LISTENER_DEAD_EXIT = 70  # EX_SOFTWARE: a listener stopped answering (sidecar.listener_dead_s); restart me


def add_sidecar_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_flags(p, "triton", TritonSettings, "urls")
    add_flags(p, "sidecar", SidecarSettings, "models", "host", "grpc_port",
              "uds_path", "http_port", "backend", "index_dir", "api_keys_file", "warm_queries_file", "cache_entries",
              "tls_cert_file", "tls_key_file", "tls_client_ca_file")


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings.load(overrides=flag_overrides(args))


def register(sub: Any) -> None:
    p = sub.add_parser("sidecar", help="the embedding sidecar (gRPC + HTTP)")
    ssub = p.add_subparsers(dest="sidecar_command", required=True)
    serve = ssub.add_parser("serve", help="serve until Ctrl-C / SIGTERM, then stop gracefully")
    add_sidecar_flags(serve)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from sidecar.allocator import use

    allocator = use(settings.sidecar.allocator)  # first: it may start this program again
    described = settings.describe()  # secrets redacted
    log.info("settings: %s", json.dumps({k: described[k] for k in ("model", "sidecar")}))
    log.info("allocator: %s, event loop: %s", allocator, settings.sidecar.event_loop)
    from sidecar.cpu_slice import SIDECAR_SLICE_US, set_slice

    # Before the model's and gRPC's threads start: they inherit it.
    log.info("CPU slice: %s", set_slice(SIDECAR_SLICE_US))
    with asyncio.Runner(loop_factory=_loop_factory(settings.sidecar.event_loop)) as runner:
        failure = runner.run(_serve_async(settings))
    return 0 if failure is None else LISTENER_DEAD_EXIT


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def _search_state(sidecar: Sidecar) -> str:
    index = sidecar.index.current()
    return f", search {index.version}" if index is not None else ", search: no index yet (UNAVAILABLE until one loads)"


async def _serve_async(settings: Settings) -> str | None:
    """Serve until a signal (None) or until a listener dies (its message: the process exits non-zero)."""
    from sidecar.app import Sidecar

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sidecar = Sidecar(settings, settle_heap=True)
    await sidecar.start()
    print(f"sidecar ready: grpc {settings.sidecar.host}:{sidecar.grpc_port}"
          f"{f', grpc {sidecar.uds_target}' if sidecar.uds_target is not None else ''}"
          f"{f', http {settings.sidecar.host}:{sidecar.http_port}' if sidecar.http_port is not None else ''}"
          f"{_search_state(sidecar) if settings.sidecar.index_dir is not None else ''}", flush=True)
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(sidecar.failed.wait())
    await asyncio.wait((stopped, failed), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    failed.cancel()
    if sidecar.failed.is_set():  # whatever hangs the listener may hang a graceful stop: keep it short
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sidecar.stop(grace_s=0), 10)
        return sidecar.failure
    log.info("stopping: finishing in-flight requests (grace %.1f s)", settings.sidecar.grace_s)
    await sidecar.stop()
    return None
