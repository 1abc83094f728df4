"""`embedcar demo`: set up what is missing, start the whole stack, stop it cleanly.

Two phases. The setup phase is plain blocking code in the main thread (model, catalog index,
Triton), so Ctrl-C interrupts it at once and the atomic writes of those steps leave nothing
half-built. The serving phase runs the sidecar and the demo web server in one event loop that
owns SIGINT/SIGTERM; teardown goes in reverse order. Everything binds to loopback.

`--compare NAME`: the sidecar serves the demo's model and NAME (already prepared, e.g. by
`embedcar model tune`), each with its own catalog index, and the page shows both side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedcar_settings import Settings
from inference import heap
from inference.backends.factory import check_kind
from inference.errors import FailedPrecondition, ModelError, Unavailable
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
    compare: str = ""  # `--compare`: the second model's name ("" = one model, as without the flag)
    compare_id: str = ""  # its variant's version id


def compare_model(settings: Settings, name: str) -> str:
    """The served variant's id of the prepared model `--compare NAME` names; a one-line error saying
    what to do where there is none.
    Checked before anything is built, and never prepared here: NAME is the user's own (tuned) model."""
    from inference.manifest import MANIFEST_FILE, load_manifest, verify_files

    if name == settings.model.name:
        raise FailedPrecondition(f"--compare {name} is the demo's own model (model.name): compare it with another, "
                                 "e.g. one `embedcar model tune --as NAME` published")
    if not name or name != Path(name).name or name.startswith("."):
        raise FailedPrecondition(f"--compare takes a model's folder name under {settings.model.models_dir}, "
                                 f"not {name!r}")
    model_dir = settings.model.models_dir / name
    if not (model_dir / MANIFEST_FILE).is_file():
        raise ModelError(f"--compare {name}: no prepared model in {model_dir}: tune it (`embedcar model tune "
                         f"--as {name}`) or prepare it (`embedcar model prepare --from DIR --model {name}`) first")
    manifest = load_manifest(model_dir)
    problems = verify_files(model_dir, manifest)
    if problems:
        raise ModelError(f"--compare {name}: the model in {model_dir} is damaged ({'; '.join(problems)}): "
                         "tune or prepare it again")
    manifest.variant(settings.model.variant)  # both columns serve model.variant: one it lacks fails here
    return manifest.variant_id(settings.model.variant)


def prepare(settings: Settings, backend: str, say: Say, *, compare: str | None = None) -> Prepared:
    """Model, then catalog index: each step does nothing when its artefact is complete already.
    `compare`: a second prepared model, served next to the demo's with a catalog index of its own."""
    from catalog.job import ensure_index
    from catalog.sources import GROCERY_SOURCE
    from catalog.spec import BuildSpec
    from inference.prepare import prepare_model
    from sidecar.models import model_settings

    compare_id = compare_model(settings, compare) if compare is not None else ""  # fails before any build
    manifest = prepare_model(settings.model.models_dir, settings.model.name, say=say)
    kind = choose_backend(backend, say)
    # The demo's catalog is the grocery sample: any complete version of the current model will do.
    spec = BuildSpec(source=GROCERY_SOURCE, text_fields=settings.catalog.text_fields)
    model_id = manifest.variant_id(settings.model.variant)
    if compare is None:
        version_dir = ensure_index(settings, spec, progress=True)
        say(f"catalog index {version_dir.name} ready in {settings.catalog.index_root}")
        return Prepared(settings=settings, backend=kind, model_id=model_id, index_dir=settings.catalog.index_root)
    # The index root holds one index per model version (ensure_index and the sidecar find each by
    # its id); the sidecar serves both models, the demo's first (the default a request gets).
    for name in (settings.model.name, compare):
        version_dir = ensure_index(model_settings(settings, name), spec, progress=True)
        say(f"catalog index {version_dir.name} ({name}) ready in {settings.catalog.index_root}")
    both = settings.with_section("sidecar", models=(settings.model.name, compare))
    return Prepared(settings=both, backend=kind, model_id=model_id, index_dir=settings.catalog.index_root,
                    compare=compare, compare_id=compare_id)


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
        compare = None
        if prepared.compare:  # by name: a rollout of that folder (a new tune) keeps its column
            compare = ServiceSearch(car.service, model=prepared.compare)
            info["compare"] = prepared.compare_id
        # The private sidecar has no keys (loopback only); the page's websocket takes the configured ones.
        keys = KeyRing.from_settings(prepared.settings.sidecar)
        app = create_app(demo, ServiceSearch(car.service), info=info, keys=keys, compare=compare)
        server = build_server(app, demo)
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


def run_demo(settings: Settings, *, backend: str = "auto", say: Say = print, compare: str | None = None) -> int:
    triton: TritonServer | None = None
    try:
        with sigterm_as_interrupt():
            prepared = prepare(settings, backend, say, compare=compare)
            if prepared.backend == "triton":
                s, triton = start_triton(prepared.settings, say)
                prepared = dataclasses.replace(prepared, settings=s)
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
