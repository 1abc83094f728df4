"""The Sidecar: objects built in __init__ (no I/O), servers started in `start()`, graceful `stop()`.

    async with Sidecar(settings) as sc:      # gRPC on sc.grpc_target, HTTP on sc.http_port, gRPC
        ...                                  # also on sc.uds_target if sidecar.uds_path is set

`SidecarThread` runs one on its own event loop in a background thread (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from grpc_health.v1._async import HealthServicer

from catalog.store import MANIFEST_FILE
from embedcar_client.wire import SERVICE
from inference import heap
from inference.backends.base import Backend
from inference.errors import EmbedcarError, InvalidInput, Unavailable
from inference.manifest import Manifest
from inference.ports import check_listenable, listen_error, listen_tcp
from inference.tokenizer import QueryTokenizer
from sidecar import models
from sidecar.admission import Admission
from sidecar.auth import KeyRing, check_bind
from sidecar.cache import EmbeddingCache
from sidecar.calls import Requests
from sidecar.grpc_server import EmbedderServicer, create_server, health_status
from sidecar.listeners import ConnectionCaps, Listener, ListenerCheck, connection_caps, raise_open_files_limit
from sidecar.metrics import Metrics
from sidecar.models import FALLBACK, ModelSet, ServedModel, build_model, served_names
from sidecar.pipeline import EmbedPipeline
from sidecar.ratelimit import RateLimiter
from sidecar.rollout import Rollout
from sidecar.scheduler import BackendHealth, FallbackScheduler
from sidecar.search_index import IndexHolder
from sidecar.service import EmbedService
from sidecar.settings import Settings
from sidecar.shedding import FRONT_SHARE, Gate
from sidecar.tls import server_tls
from sidecar.unix_socket import UnixSocket

if TYPE_CHECKING:
    import grpc
    import uvicorn

    from catalog.index import ProductIndex

log = logging.getLogger(__name__)
# While a backend is down it is probed this often: a restarted Triton is back in service within it.
HEALTH_POLL_S = 0.5


class Sidecar:
    def __init__(self, settings: Settings, *, backend: Backend | None = None,
                 index: ProductIndex | None = None, settle_heap: bool = False) -> None:
        """`backend` / `index`: given objects for the default model (tests, benchmarks).

        `settle_heap`: this sidecar owns its process (`sidecar serve`, the demo): once started, and
        after each index load, it freezes the heap out of the garbage collector's full collections
        (inference.heap). Off for a sidecar embedded in another program, whose heap is not its own."""
        s = settings.sidecar
        check_index_dir(s.index_dir)  # before the models load: a typo'd path is refused at once
        self._settle_heap = settle_heap
        self._unwatch_gc: Callable[[], None] | None = None
        self._settled = False
        self.settings = settings
        self.keys = KeyRing.from_settings(s)
        check_bind(s.host, self.keys)
        self.tls = server_tls("sidecar", s.host, s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file,
                              plaintext_beyond_loopback=s.plaintext_beyond_loopback)
        self.metrics = Metrics()
        on_load = self._index_loaded if settle_heap else None
        names = served_names(settings)
        self.models = ModelSet([
            build_model(settings, name, self.metrics, backend=backend if i == 0 else None,
                        index=index if i == 0 else None, on_index_load=on_load)
            for i, name in enumerate(names)])
        self.service = EmbedService(self.models, keys=self.keys, limiter=RateLimiter(s.rate_per_s, s.burst),
                                    metrics=self.metrics, default_deadline_s=s.default_deadline_ms / 1e3,
                                    max_k=s.max_k)
        in_flight = s.max_in_flight or (models.MAX_PENDING_BATCHES + 1) * s.max_rows_per_pass
        # One in-flight cap, each front at most FRONT_SHARE of it (sidecar.shedding): gRPC's and HTTP's.
        self.gate = Gate(lambda: self.models.default.admission, self.metrics, in_flight, share=FRONT_SHARE)
        self.http_gate = self.gate.front(FRONT_SHARE)
        self.grpc_port = 0
        self.uds: UnixSocket | None = None
        self.http_port: int | None = None
        self.serving = False
        self._health: HealthServicer | None = None
        self._grpc: grpc.aio.Server | None = None
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._listener_task: asyncio.Task[None] | None = None
        self.listener_check: ListenerCheck | None = None
        self.failed = asyncio.Event()  # a listener died (sidecar.listener_dead_s): `failure` says which
        self.failure = ""
        self._backend_serving = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self.rollout = Rollout(settings, self.models, self.metrics, on_switch=self._switched, on_index_load=on_load)
        self._rollout: asyncio.Task[None] | None = None

    # The default (first) model's parts, for callers that serve one model.
    @property
    def model(self) -> ServedModel:
        return self.models.default

    @property
    def manifest(self) -> Manifest:
        return self.model.manifest

    @property
    def backend(self) -> Backend:
        return self.model.backend

    @property
    def tokenizer(self) -> QueryTokenizer:
        return self.model.tokenizer

    @property
    def cache(self) -> EmbeddingCache:
        return self.model.cache

    @property
    def admission(self) -> Admission:
        return self.model.admission

    @property
    def health(self) -> BackendHealth:
        return self.model.health

    @property
    def scheduler(self) -> FallbackScheduler:
        return self.model.scheduler

    @property
    def index(self) -> IndexHolder:
        return self.model.index

    @property
    def pipeline(self) -> EmbedPipeline:
        return self.model.pipeline

    @property
    def fallback(self) -> Backend | None:
        return self.model.fallback

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def uds_target(self) -> str | None:
        """`unix:/abs/path` of the Unix socket gRPC also listens on, or None (sidecar.uds_path unset)."""
        return self.uds.target if self.uds is not None else None

    @property
    def can_answer(self) -> bool:
        """Every served model's backend is up, or its embedded fallback stands in for it."""
        return all(m.can_answer for m in self.models)

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop(grace_s=0)  # no half-started server left holding its ports
            raise

    async def _start(self) -> None:
        s = self.settings.sidecar
        # Every port before any server starts: a port in use is one line naming its flag, not a
        # gRPC core log line and a half-started server (a same-host race is still caught at bind).
        for flag, port in (("--grpc-port", s.grpc_port), ("--http-port", s.http_port)):
            if port >= 0:
                await asyncio.to_thread(check_listenable, s.host, port, flag=flag)
        self._health = HealthServicer()
        await self._set_health(False)  # NOT_SERVING until the backend is warm
        if self._settle_heap:  # the process's collector is ours to report
            self._unwatch_gc = heap.watch_pauses(self.metrics.observe_gc_pause)
        caps = self._connection_caps()
        servicer = EmbedderServicer(self.service, self.metrics, self.gate)
        try:
            self._grpc, self.grpc_port, self.uds = create_server(s, servicer, self._health, self.tls,
                                                                 max_connections=caps.grpc)
        except RuntimeError as exc:  # grpc.aio's "Failed to bind to address": it gives no reason
            raise listen_error("--grpc-port", s.host, s.grpc_port, "gRPC could not bind it (in use, or not an "
                               "address of this host)") from exc
        await self._grpc.start()
        if s.http_port >= 0:
            await self._start_http(s.host, s.http_port, s.max_message_bytes, caps.http)
        for m in self.models:
            await m.start()
            self._switched(m)
            if s.index_dir is not None and m.index.current() is None:
                # Started anyway: a sidecar may come up before the catalog job's first publish (it
                # polls and loads it); only Search waits, and this says why at once.
                log.warning("%s: Search answers UNAVAILABLE until an index loads: %s", m.name, m.index.reason())
        loop = asyncio.get_running_loop()
        if s.warm_queries_file is not None:
            await self.warm_cache(s.warm_queries_file)
        if self._settle_heap:
            self._settle()
        for m in self.models:
            m.health.mark(True)
        self._backend_serving = True
        self.listener_check = ListenerCheck(self._listeners(), dead_after_s=s.listener_dead_s,
                                            on_change=lambda _up: self._spawn(self._publish_health()),
                                            on_dead=self._listener_dead, on_state=self.metrics.observe_listener)
        await self._set_health(True)
        self._monitor = loop.create_task(self._watch_backend(), name="backend-health")
        self._listener_task = loop.create_task(self.listener_check.run(), name="listener-check")
        if s.poll_s > 0:
            self._rollout = loop.create_task(self.rollout.run(), name="model-rollout")
        log.info("sidecar serving %s on grpc %s:%d%s, http %s", ", ".join(m.version_id for m in self.models),
                 s.host, self.grpc_port,
                 f" and {self.uds.path}" if self.uds is not None else "",
                 self.http_port if self.http_port is not None else "off")

    def _switched(self, m: ServedModel) -> None:
        """A model version went into service (at start, or by a rollout)."""
        m.health.on_down = lambda: self._spawn(self._set_health(self.can_answer))
        self.metrics.model_info.clear()
        for served in self.models:
            self.metrics.model_info.labels(served.name, served.version_id).set(1)

    def _settle(self) -> None:
        frozen = heap.settle()
        self._settled = True
        log.info("heap settled: %d objects frozen out of full collections", frozen)

    def _index_loaded(self) -> None:
        if self._settled:  # an index opened during start() is settled with everything else at its end
            self._settle()

    async def stop(self, grace_s: float | None = None) -> None:
        grace = self.settings.sidecar.grace_s if grace_s is None else grace_s
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
            self.serving = False
        for task in (self._monitor, self._rollout, self._listener_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._monitor = self._rollout = self._listener_task = None
        if self._grpc is not None:
            await self._grpc.stop(grace)  # refuses new calls, lets in-flight ones finish within `grace`
            self._grpc = None
        if self.uds is not None:
            self.uds.remove()
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._http_task, grace + 1)
            self._http = self._http_task = None
        await self.rollout.close()
        for m in self.models:
            await m.close()
        if self._unwatch_gc is not None:
            self._unwatch_gc()
            self._unwatch_gc = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    # --- pieces ------------------------------------------------------------------------------
    def _connection_caps(self) -> ConnectionCaps:
        s = self.settings.sidecar
        open_files = raise_open_files_limit()
        return connection_caps(open_files, s.grpc_max_connections, s.http_max_connections, http_on=s.http_port >= 0)

    def _listeners(self) -> list[Listener]:
        """Every address this sidecar was asked to serve, as its own check reaches it."""
        s, tls = self.settings.sidecar, self.tls is not None
        found = [Listener("grpc", s.host, self.grpc_port, "h2", tls)]
        if self.uds is not None:
            found.append(Listener("uds", str(self.uds.path), 0, "h2"))
        if self.http_port is not None:
            found.append(Listener("http", s.host, self.http_port, "http1", tls))
        return found

    def _listener_dead(self, message: str) -> None:
        log.critical("%s", message)
        self.failure = message
        self.failed.set()

    async def _start_http(self, host: str, port: int, max_bytes: int, max_connections: int) -> None:
        import uvicorn

        from sidecar.http_api import create_app
        from sidecar.http_protocol import HttpLimits, UpgradeTolerantHttp

        s = self.settings.sidecar
        app = create_app(Requests(self.service, self.metrics, self.http_gate), max_body_bytes=max_bytes,
                         serving=lambda: self.serving, body_timeout_s=s.http_body_timeout_s)
        sock = listen_tcp(host, port, flag="--http-port")
        self.http_port = int(sock.getsockname()[1])
        limits = HttpLimits(header_timeout_s=s.http_header_timeout_s, max_connections=max_connections,
                            write_timeout_s=s.http_write_timeout_s, max_pipelined=s.http_max_pipelined,
                            max_read_ahead_bytes=max_bytes)
        # Connections are limited (and refused past it) by the protocol, not uvicorn's limit_concurrency,
        # which would accept them all and answer 503 only once a request came.
        config = uvicorn.Config(app, http=UpgradeTolerantHttp.guarded(limits), log_level="warning", access_log=False,
                                lifespan="off", limit_concurrency=None, timeout_keep_alive=5,
                                h11_max_incomplete_event_size=limits.max_head_bytes,
                                timeout_graceful_shutdown=int(s.grace_s),
                                **(self.tls.uvicorn_options() if self.tls is not None else {}))
        self._http = uvicorn.Server(config)
        self._http_task = asyncio.get_running_loop().create_task(self._http.serve(sockets=[sock]), name="http")
        # uvicorn offers no "started" event to await.
        while not self._http.started and not self._http_task.done():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self._http_task.done():
            self._http_task.result()

    async def warm_cache(self, path: Path) -> int:
        """Pre-load the cache with the queries in `path` (one per line); returns how many."""
        try:
            text = await asyncio.to_thread(path.read_text)
            queries = [q.strip() for q in text.splitlines() if q.strip()]
        except OSError as exc:
            raise InvalidInput(f"cannot read warm queries file {path}: {exc.strerror}") from exc
        step = self.settings.sidecar.max_rows_per_pass
        for i in range(0, len(queries), step):
            for m in self.models:
                # The operator's own: no key, no rate limit, the shared cache partition.
                call = self.service.call(None, model=m.name, deadline=time.monotonic() + 60)
                await self.service.embed(call, queries[i:i + step])
        log.info("cache warmed with %d queries", len(queries))
        return len(queries)

    async def _set_health(self, backend_serving: bool) -> None:
        self._backend_serving = backend_serving
        await self._publish_health()

    async def _publish_health(self) -> None:
        """One truth for HTTP /health, gRPC health and the metrics: the backends can answer and every
        listener answers the sidecar's own check."""
        serving = self._backend_serving and (self.listener_check is None or self.listener_check.up)
        self.serving = serving
        self.metrics.serving.set(1 if serving else 0)
        if self._health is not None:
            status = health_status(serving)
            await self._health.set("", status)
            await self._health.set(SERVICE, status)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_backend(self) -> None:
        """While up: trust each backend's ready(). While down: probe it until it answers again."""
        poll = HEALTH_POLL_S
        while True:
            await asyncio.sleep(poll)
            for m in self.models:
                if m.health.up:
                    if not m.backend.ready():
                        m.health.mark(False)
                    continue
                try:
                    await m.backend.embed(m.probe_batch(), timeout_s=max(poll * 2, 0.5))
                except EmbedcarError:
                    pass
                else:
                    m.health.mark(True)
                    log.info("backend %s of %s is back", m.backend.name, m.name)
            if self.can_answer != self._backend_serving:
                await self._set_health(self.can_answer)


class SidecarThread:
    """A Sidecar on its own event loop in a daemon thread: `with SidecarThread(settings) as sc:`."""

    def __init__(self, settings: Settings, *, backend: Backend | None = None,
                 index: ProductIndex | None = None) -> None:
        self._args = (settings, backend, index)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sidecar", daemon=True)
        self.sidecar: Sidecar | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def call(self, coro: Any, timeout: float = 120.0) -> Any:
        """Run `coro` on the sidecar's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> Sidecar:
        self._thread.start()
        settings, backend, index = self._args

        async def make() -> Sidecar:
            sc = Sidecar(settings, backend=backend, index=index)
            await sc.start()
            return sc

        try:
            self.sidecar = self.call(make())
        except BaseException:
            self._shutdown()
            raise
        assert self.sidecar is not None
        return self.sidecar

    def __exit__(self, *exc: object) -> None:
        if self.sidecar is not None:
            self.call(self.sidecar.stop(grace_s=1.0))
        self._shutdown()

    def _shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def check_index_dir(index_dir: Path | None) -> None:
    """Refuse a sidecar.index_dir that cannot be an index root: nothing there (a typo: the sidecar would
    serve, healthy, and fail every Search), a file, or one index version instead of the folder above it.
    An existing folder without an index yet is accepted: the catalog job may publish into it later."""
    if index_dir is None:
        return
    what = ("no such folder" if not index_dir.exists() else
            "a file, not a folder" if not index_dir.is_dir() else
            "one index version, not the index root above it" if (index_dir / MANIFEST_FILE).is_file() else None)
    if what is not None:
        raise InvalidInput(f"--index-dir {index_dir}: {what} (give the folder `embedcar catalog build` publishes "
                           f"versions into, its --index-root)")


@contextlib.contextmanager
def running(settings: Settings, **kw: Any) -> Iterator[Sidecar]:
    with SidecarThread(settings, **kw) as sc:
        yield sc


__all__ = ["FALLBACK", "Sidecar", "SidecarThread", "Unavailable", "running"]
