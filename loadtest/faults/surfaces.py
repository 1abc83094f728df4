"""The sidecar's outside surfaces, started for real, for the fuzz and auth scenarios (and their tests).

`running_stack` builds a small real index (the catalog job over the first grocery products), starts
a sidecar (gRPC + HTTP, embedded model, optional API key) and the demo web server over it, each on
its own event loop in a background thread, on free 127.0.0.1 ports. `DemoThread` is the demo part
alone (tests point it at a sidecar fixture). `raw_http` sends exact bytes and reads the status, so
callers can send what no HTTP client library would; `LogCapture` keeps every log line of a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from demo_ui.limits import DemoLimits
from embedcar_settings import DemoSettings, Settings

if TYPE_CHECKING:
    from sidecar.app import Sidecar
    from sidecar.auth import KeyRing

TENANT = "faults"


def build_index(settings: Settings, root: Path, n: int) -> Path:
    """A real flat index of the first `n` grocery products under `root` (the catalog job)."""
    from catalog.job import build
    from catalog.sources import read_grocery
    from catalog.spec import BuildSpec
    from inference.aio import run_sync

    s = settings.with_section("catalog", index_root=root, index_type="flat", chunk_items=1024, use_gpu=False)
    summary = run_sync(build(s, BuildSpec(), loaded=read_grocery(limit=n), progress=False))
    assert summary.version_dir is not None
    return summary.version_dir


# The rate cap and the per-keystroke deadline are tested elsewhere; here they would only turn a fast
# fuzzer or a slow shared box into refusals.
FUZZ_LIMITS = DemoLimits(max_messages_per_s=1e9, search_timeout_s=30.0)


class DemoThread:
    """The demo web server on its own loop in a daemon thread, searching through `grpc_target`.

        with DemoThread(target, api_key=key, keys=ring) as ws_url: ...   # ws://127.0.0.1:<port>/ws
    """

    def __init__(self, grpc_target: str, *, api_key: str | None = None, keys: KeyRing | None = None,
                 settings: DemoSettings | None = None, limits: DemoLimits = FUZZ_LIMITS) -> None:
        self._target = grpc_target
        self._api_key = api_key
        self._keys = keys
        self.settings = settings or DemoSettings()
        self.limits = limits
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="demo", daemon=True)
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None

    def _call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> str:
        from demo_ui.search import SidecarSearch
        from demo_ui.server import build_server, create_app
        from embedcar_client.client import AsyncClient

        self._client = AsyncClient(self._target, api_key=self._api_key)  # its channel lives on this loop
        app = create_app(self.settings, SidecarSearch(self._client), keys=self._keys, limits=self.limits)
        self._server = build_server(app, self.settings, port=0, limits=self.limits)
        self._task = asyncio.get_running_loop().create_task(self._server.serve())
        while not self._server.started:  # uvicorn has no "started" event to await
            if self._task.done():
                self._task.result()
                raise RuntimeError("demo server stopped before it started")
            await asyncio.sleep(0.01)
        return f"ws://127.0.0.1:{self._server.port}/ws"

    async def _stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        if self._client is not None:
            await self._client.close()

    def __enter__(self) -> str:
        self._thread.start()
        try:
            url: str = self._call(self._start())
        except BaseException:
            self.__exit__()
            raise
        return url

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@dataclass(frozen=True, slots=True)
class Stack:
    sidecar: Sidecar
    grpc_target: str
    http_port: int
    ws_url: str
    api_key: str | None  # the one valid key, or None (auth off)


@contextlib.contextmanager
def running_stack(settings: Settings, work: Path, *, api_key: str | None, items: int = 300) -> Iterator[Stack]:
    """Index + sidecar (gRPC, HTTP, Search) + demo server; with `api_key`, the only valid key."""
    from sidecar.app import SidecarThread

    root = work / "index"
    build_index(settings, root, items)
    s = settings.with_section(
        "sidecar", host="127.0.0.1", grpc_port=0, http_port=0, uds_path=None, index_dir=root,
        api_keys=f"{TENANT}={api_key}" if api_key else "", api_keys_file=None, rate_per_s=1e6,
        burst=1_000_000, default_deadline_ms=60_000, warm_queries_file=None)
    s = s.with_section("catalog", use_gpu=False)
    with SidecarThread(s) as car:
        assert car.http_port is not None
        with DemoThread(car.grpc_target, api_key=api_key, keys=car.keys) as ws_url:
            yield Stack(car, car.grpc_target, car.http_port, ws_url, api_key)


# --- raw HTTP -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RawReply:
    status: int | None  # None: the server closed without an answer
    body: bytes
    timed_out: bool = False


def raw_http(port: int, request: bytes, *, timeout_s: float = 30.0, half_close: bool = False) -> RawReply:
    """Send `request` as is on a new connection to 127.0.0.1:port; the final (non-1xx) status.

    `half_close` shuts our sending side after the request: a server still waiting for body bytes
    that will never come then sees the end of the stream instead of waiting for its timeout.
    """
    data = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            with contextlib.suppress(ConnectionError):  # the server may answer and close mid-request
                sock.sendall(request)
            if half_close:
                with contextlib.suppress(OSError):  # ENOTCONN: it has closed already
                    sock.shutdown(socket.SHUT_WR)
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        return RawReply(_status(data), data, timed_out=True)
    except ConnectionError:  # reset: the server gave up on the request; what it sent still counts
        pass
    return RawReply(_status(data), data)


def _status(data: bytes) -> int | None:
    """The first final status in `data` (skipping `100 Continue` and other interim replies)."""
    rest = data
    while rest.startswith(b"HTTP/1."):
        line, _, rest = rest.partition(b"\r\n")
        parts = line.split(b" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            return None
        code = int(parts[1])
        if code >= 200:
            return code
        _, _, rest = rest.partition(b"\r\n\r\n")  # an interim reply's headers end here
    return None


def http_post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> RawReply:
    """A well-formed POST (Connection: close) through `raw_http`."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in (headers or {"Content-Type": "application/json"}).items())]
    return raw_http(port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)


# --- logs -------------------------------------------------------------------------------------------
class LogCapture(logging.Handler):
    """Every record emitted at `level` and up while active, formatted with its traceback: through the
    root logger and through every logger that does not propagate (uvicorn's own).

        with LogCapture() as logs: ...;  logs.lines

    Enter it after the servers are built: uvicorn re-applies its logging config per server.
    """

    def __init__(self, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        self.records: list[tuple[int, str, str]] = []  # (level, logger, formatted line)
        self._guard = threading.Lock()
        self._loggers: list[logging.Logger] = []
        self._root_level = logging.WARNING

    @property
    def lines(self) -> list[str]:
        with self._guard:
            return [line for _lvl, _name, line in self.records]

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # a bad format string must not hide what was logged
            line = f"{record.levelname} {record.name} {record.msg!r} {record.args!r}"
        with self._guard:
            self.records.append((record.levelno, record.name, line))

    def __enter__(self) -> LogCapture:
        root = logging.getLogger()
        own = [lg for lg in logging.Logger.manager.loggerDict.values()
               if isinstance(lg, logging.Logger) and not lg.propagate]
        self._loggers = [root, *own]
        for lg in self._loggers:
            lg.addHandler(self)
        self._root_level = root.level
        if root.level > self.level:
            root.setLevel(self.level)
        return self

    def __exit__(self, *exc: object) -> None:
        for lg in self._loggers:
            lg.removeHandler(self)
        logging.getLogger().setLevel(self._root_level)

    def containing(self, *needles: str) -> list[str]:
        return [line for line in self.lines if any(n in line for n in needles)]
