"""`embedcar demo`: set up what is missing, start the whole stack, stop it cleanly.

Two phases. The setup phase is plain blocking code in the main thread (model, catalog index,
Triton), so Ctrl-C interrupts it at once and the atomic writes of those steps leave nothing
half-built. The serving phase runs the sidecar and the demo web server in one event loop that
owns SIGINT/SIGTERM; teardown goes in reverse order. Everything binds to loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from demo_ui.settings import Settings
from inference import heap
from inference.backends.factory import check_kind
from inference.errors import Unavailable
from inference.lifecycle import sigterm_as_interrupt

if TYPE_CHECKING:
    from inference.triton.launcher import TritonServer

Say = Callable[[str], None]


def choose_backend(requested: str, say: Say) -> str:
    """auto -> triton where the bundled tritonserver can run, else embedded (saying why)."""
    if requested != "auto" and check_kind(requested) == "embedded":
        return "embedded"
    from inference.triton.launcher import triton_unavailable_reason

    reason = triton_unavailable_reason()
    if reason is None:
        return "triton"
    if requested == "triton":
        raise Unavailable(f"Triton cannot run here: {reason}")
    say(f"Triton cannot run here ({reason}): using the embedded ONNX Runtime backend instead")
    return "embedded"


@dataclass(frozen=True, slots=True)
class Prepared:
    """What the setup phase produced: settings for the serving phase and what to show on the page."""

    settings: Settings
    backend: str
    model_id: str
    index_dir: Path


def prepare(settings: Settings, backend: str, say: Say) -> Prepared:
    """Model, then catalog index: each step does nothing when its artefact is complete already."""
    from catalog.job import ensure_index
    from catalog.sources import GROCERY_SOURCE
    from catalog.spec import BuildSpec
    from inference.prepare import prepare_model

    manifest = prepare_model(settings.model.models_dir, settings.model.name, say=say)
    kind = choose_backend(backend, say)
    # The demo's catalog is the grocery sample: any complete version of the current model will do.
    spec = BuildSpec(source=GROCERY_SOURCE, text_fields=settings.catalog.text_fields)
    version_dir = ensure_index(settings, spec, progress=True)
    say(f"catalog index {version_dir.name} ready in {settings.catalog.index_root}")
    model_id = manifest.variant_id(settings.model.variant)
    return Prepared(settings=settings, backend=kind, model_id=model_id, index_dir=settings.catalog.index_root)


def start_triton(settings: Settings, say: Say) -> tuple[Settings, TritonServer]:
    """Start local Triton on free ports; the sidecar is pointed at it."""
    from inference.triton.launcher import TritonServer

    say("starting local Triton (CPU model repository)…")
    triton = TritonServer(settings, models=settings.sidecar.models)  # every model the sidecar serves
    try:
        triton.start()
    except BaseException:
        triton.stop()
        raise
    say(f"Triton ready on {triton.grpc_url}")
    s = settings.with_section("sidecar", backend="triton").with_section("triton", urls=(triton.grpc_url,))
    return s, triton


def sidecar_settings(settings: Settings, index_dir: Path) -> Settings:
    """The demo's private sidecar: loopback, free gRPC port, no HTTP facade, no keys (same host)."""
    return settings.with_section("sidecar", host="127.0.0.1", grpc_port=0, http_port=-1,
                                 index_dir=index_dir, api_keys="", api_keys_file=None)


async def serve(prepared: Prepared, say: Say, *, stop: asyncio.Event | None = None,
                on_ready: Callable[[str], None] | None = None, settle_heap: bool = False) -> None:
    """Sidecar + demo web server until `stop` is set (or SIGINT/SIGTERM). `settle_heap`: this
    process is the demo's own (see Sidecar)."""
    from demo_ui.search import ServiceSearch
    from demo_ui.server import build_server, create_app
    from sidecar.app import Sidecar
    from sidecar.auth import KeyRing

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    settings = sidecar_settings(prepared.settings, prepared.index_dir)
    demo = settings.demo
    async with contextlib.AsyncExitStack() as stack:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
                stack.callback(loop.remove_signal_handler, sig)
        car = Sidecar(settings, settle_heap=settle_heap)
        await car.start()
        stack.push_async_callback(car.stop, settings.sidecar.grace_s)
        info = {"backend": prepared.backend, "model": prepared.model_id, "index": prepared.index_dir.name}
        # The private sidecar has no keys (loopback only); the page's websocket takes the configured ones.
        keys = KeyRing.from_settings(prepared.settings.sidecar)
        server = build_server(create_app(demo, ServiceSearch(car.service), info=info, keys=keys), demo)
        task = asyncio.create_task(server.serve())
        stack.push_async_callback(_stop_server, server, task)
        while not server.started:
            if task.done():  # e.g. the port is taken: uvicorn logged why
                raise Unavailable(f"demo web server could not start on {demo.host}:{demo.port}")
            await asyncio.sleep(0.02)
        if settle_heap:  # the web server's objects too, created after the sidecar settled
            heap.settle()
        url = f"{'https' if server.config.is_ssl else 'http'}://{demo.host}:{server.port}/"
        say(f"demo ready: {url}  (backend {prepared.backend}; Ctrl-C to stop)")
        if on_ready:
            on_ready(url)
        await stop.wait()
        say("stopping…")


async def _stop_server(server: Any, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    with contextlib.suppress(Exception):
        await task


def run_demo(settings: Settings, *, backend: str = "auto", say: Say = print) -> int:
    triton: TritonServer | None = None
    try:
        with sigterm_as_interrupt():
            prepared = prepare(settings, backend, say)
            if prepared.backend == "triton":
                s, triton = start_triton(prepared.settings, say)
                prepared = Prepared(s, prepared.backend, prepared.model_id, prepared.index_dir)
        asyncio.run(serve(prepared, say, settle_heap=True))
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        if triton is not None:
            triton.stop()
            say("Triton stopped")
    say("stopped")
    return 0
