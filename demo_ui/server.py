"""The demo web server: the typeahead page and its websocket.

Protocol (JSON text frames):
  page -> server  {"seq": int >= 0, "text": str, "k"?: int, "mode"?: "semantic" | "lexical" | "hybrid"}
  server -> page  {"seq", "text", "mode", "results": [{"title","aisle","department","score","legs"}],
                   "timings_ns": {sidecar stages}, "server_ms": float, "cache_hit": bool}
A keystroke without a mode is searched in demo.search_mode (hybrid), with k = DemoLimits.results;
`legs` says which search leg(s) found each product (["semantic"], ["lexical"] or both).
                  {"seq", "dropped": "superseded" | "stale"}      (never computed)
                  {"seq": int | null, "error": {"code", "message"}}
With a second model (`embedcar demo --compare NAME`) each keystroke is searched with both at once
and the answer adds "model" and "columns": [{"model", "results", "timings_ns", "cache_hit",
"server_ms", "aisles": {"aisle", "count", "of"} | null}, ...], the demo's model first; the
top-level results/timings_ns/cache_hit are its column's, server_ms the whole keystroke's, and a
column's server_ms runs until its own search returned (search.aisle_agreement: `aisles`).
Each connection has one search worker fed through a latest-wins slot: a keystroke that arrives
while an older one is still waiting replaces it. Bad frames get an error reply; oversized frames
and floods close the connection (1009 / 1008). Nothing a client sends can stop the server.

With API keys (the sidecar's, `create_app(keys=...)`), /ws needs one at the handshake: header
`x-api-key` or `Authorization: Bearer`, or `?api_key=` (browsers cannot set websocket headers; the
page passes on its own `?api_key=`). Without it the socket gets an `unauthenticated` error and
closes with 1008. The page, its static files, its icon, /config and /health stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from catalog.fusion import SearchMode, parse_mode
from demo_ui import favicon
from demo_ui.limits import LIMITS, DemoLimits
from demo_ui.ratecap import RateCap
from demo_ui.search import SearchFn, aisle_agreement, hit_json
from demo_ui.slot import LatestSlot
from embedcar_settings import DemoSettings
from inference.errors import EmbedcarError, Internal, InvalidInput, Overloaded, Unauthenticated
from inference.text import check_unicode
from sidecar.auth import WEBSOCKET_KEY, KeyRing
from sidecar.tls import server_tls

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
MAX_K = 50
CLOSE_TOO_BIG = 1009
CLOSE_POLICY = 1008
_ICON_CACHE = {"Cache-Control": "public, max-age=86400"}
CLOSED = "closed"  # the error code of the notice sent before the server closes a socket (not an error class)



@dataclass(frozen=True, slots=True)
class Keystroke:
    seq: int
    text: str
    k: int
    received_ns: int
    mode: SearchMode = SearchMode.HYBRID


def parse_message(raw: str, *, max_query_chars: int, default_k: int,
                  default_mode: SearchMode | str = SearchMode.HYBRID) -> Keystroke:
    """One websocket frame -> Keystroke, or InvalidInput saying what is wrong with it."""
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError: also integers over 4300 digits
        raise InvalidInput("message is not JSON (or nested too deeply, or a number too long)") from exc
    if not isinstance(msg, dict):
        raise InvalidInput("message must be a JSON object")
    seq, text, k = msg.get("seq"), msg.get("text"), msg.get("k", default_k)
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise InvalidInput("seq must be a non-negative integer")
    if not isinstance(text, str):
        raise InvalidInput("text must be a string")
    if len(text) > max_query_chars:
        raise InvalidInput(f"text longer than {max_query_chars} characters")
    check_unicode(text, "text")  # a "\ud800" escape cannot go on to the sidecar
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise InvalidInput(f"k must be an integer in 1..{MAX_K}")
    mode = msg.get("mode", default_mode)
    if not isinstance(mode, str):
        raise InvalidInput("mode must be \"semantic\", \"lexical\" or \"hybrid\"")
    return Keystroke(seq=seq, text=text.strip(), k=k, received_ns=time.perf_counter_ns(), mode=parse_mode(mode))


def _error(seq: int | None, exc: EmbedcarError) -> dict[str, Any]:
    return {"seq": seq, "error": {"code": exc.code, "message": exc.message}}


class Connection:
    """One browser tab: a reader (validation, rate cap, slot) and a single search worker."""

    def __init__(self, ws: WebSocket, settings: DemoSettings, search: SearchFn,
                 compare: SearchFn | None = None, limits: DemoLimits = LIMITS) -> None:
        self.ws = ws
        self.settings = settings
        self.limits = limits
        self.search = search
        self.compare = compare
        self.slot: LatestSlot[Keystroke] = LatestSlot()
        self.cap = RateCap(limits.max_messages_per_s)
        self.last_seq = -1
        self._send_lock = asyncio.Lock()

    async def send(self, payload: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps(payload, separators=(",", ":")))

    async def run(self) -> None:
        worker = asyncio.create_task(self._work())
        try:
            await self._read()
        except WebSocketDisconnect:
            pass
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await worker

    async def _read(self) -> None:
        s = self.limits
        while True:
            frame = await self.ws.receive()
            if frame["type"] == "websocket.disconnect":
                return
            raw: str | None = frame.get("text")
            if raw is None:
                data: bytes = frame.get("bytes") or b""
                if len(data) > s.max_message_bytes:
                    await self._close(CLOSE_TOO_BIG, f"message over {s.max_message_bytes} bytes")
                    return
                try:
                    raw = data.decode("utf-8")
                except UnicodeDecodeError:
                    await self.send(_error(None, InvalidInput("binary frame is not UTF-8 text")))
                    continue
            if len(raw.encode("utf-8", "surrogatepass")) > s.max_message_bytes:
                await self._close(CLOSE_TOO_BIG, f"message over {s.max_message_bytes} bytes")
                return
            if not self.cap.allow():
                # Answer the first refusals so a client can back off; a client that keeps
                # flooding after a second's worth of refusals is cut off.
                if self.cap.refused_in_a_row > max(10.0, s.max_messages_per_s):
                    await self._close(CLOSE_POLICY, "message rate cap exceeded")
                    return
                await self.send(_error(None, Overloaded(
                    f"more than {s.max_messages_per_s:g} messages/s on this connection")))
                continue
            try:
                key = parse_message(raw, max_query_chars=s.max_query_chars, default_k=s.results,
                                    default_mode=self.settings.search_mode)
            except InvalidInput as exc:
                await self.send(_error(_seq_of(raw), exc))
                continue
            if key.seq <= self.last_seq:
                await self.send({"seq": key.seq, "dropped": "stale"})
                continue
            self.last_seq = key.seq
            dropped = self.slot.put(key)
            if dropped is not None:
                await self.send({"seq": dropped.seq, "dropped": "superseded"})

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            await self.send({"seq": None, "error": {"code": CLOSED, "message": reason}})
        with contextlib.suppress(Exception):
            await self.ws.close(code=code, reason=reason)

    async def _work(self) -> None:
        while True:
            key = await self.slot.take()
            try:
                await self.send(await self._answer(key))
            except WebSocketDisconnect:
                return
            except EmbedcarError as exc:
                await self.send(_error(key.seq, exc))
            except Exception as exc:  # a bug must cost one keystroke, not the connection
                log.exception("search failed for seq %d", key.seq)
                await self.send(_error(key.seq, Internal(type(exc).__name__)))

    async def _answer(self, key: Keystroke) -> dict[str, Any]:
        head = {"seq": key.seq, "text": key.text, "mode": key.mode.value}
        if self.compare is None:
            column = await self._column(self.search, key)
            del column["model"], column["aisles"]  # the one-model reply stays as it always was
            return head | column
        # Both models at once: the keystroke waits for the slower, not for the sum. Every search
        # is awaited before an error is raised, so none is left running unobserved.
        both = await asyncio.gather(self._column(self.search, key), self._column(self.compare, key),
                                    return_exceptions=True)
        for item in both:
            if isinstance(item, BaseException):
                raise item
        columns = [c for c in both if isinstance(c, dict)]
        first = columns[0]
        return head | {"model": first["model"], "results": first["results"], "timings_ns": first["timings_ns"],
                       "server_ms": (time.perf_counter_ns() - key.received_ns) / 1e6,
                       "cache_hit": first["cache_hit"], "columns": columns}

    async def _column(self, search: SearchFn, key: Keystroke) -> dict[str, Any]:
        """One model's answer to `key` (nothing searched for an empty box)."""
        if not key.text:
            return {"model": "", "results": [], "timings_ns": {}, "cache_hit": False,
                    "server_ms": (time.perf_counter_ns() - key.received_ns) / 1e6, "aisles": None}
        out = await search(key.text, k=key.k, timeout_s=self.limits.search_timeout_s, mode=key.mode)
        hits = out.hits[0] if out.hits else []  # one text searched
        return {"model": out.model, "results": [hit_json(h) for h in hits], "timings_ns": out.timings_ns,
                "cache_hit": bool(out.cache_hits and out.cache_hits[0]),
                "server_ms": (time.perf_counter_ns() - key.received_ns) / 1e6, "aisles": aisle_agreement(hits)}


def _seq_of(raw: str) -> int | None:
    """Best-effort seq of a rejected frame, so the page can tie the error to a keystroke."""
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    seq = msg.get("seq") if isinstance(msg, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def _ws_key(ws: WebSocket) -> str | None:
    key = ws.headers.get("x-api-key") or ws.query_params.get("api_key")
    if key:
        return key
    auth = ws.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


def create_app(settings: DemoSettings, search: SearchFn, *, info: dict[str, str] | None = None,
               keys: KeyRing | None = None, compare: SearchFn | None = None, limits: DemoLimits = LIMITS) -> FastAPI:
    """The page, its static files, its icon (demo_ui.favicon), `/config` for the page's defaults, `/health`,
    and `/ws` (which needs one of `keys` when that ring is not empty). `compare`: a second model searched with
    every keystroke, side by side (its id in `info["compare"]` heads its column before the first answer)."""
    parse_mode(settings.search_mode)  # a mistyped EMBEDCAR_DEMO_SEARCH_MODE fails here, not on every keystroke
    app = FastAPI(title="embedcar typeahead demo", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    page_config = {"budget_ms": settings.budget_ms, "results": limits.results, "mode": settings.search_mode,
                   **(info or {})}

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/favicon.svg", include_in_schema=False)
    async def favicon_svg() -> Response:
        return Response(favicon.SVG, media_type=favicon.SVG_TYPE, headers=_ICON_CACHE)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon_ico() -> Response:
        return Response(favicon.ico(), media_type=favicon.ICO_TYPE, headers=_ICON_CACHE)

    @app.get("/config")
    async def config() -> JSONResponse:
        return JSONResponse(page_config)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.websocket("/ws")
    async def ws_endpoint(ws: WebSocket) -> None:
        await ws.accept()
        if keys is not None and keys.enabled:
            try:
                keys.tenant_for(_ws_key(ws), how=WEBSOCKET_KEY)
            except Unauthenticated as exc:
                # Accept first so the page can show why, then close: 1008 = policy violation.
                with contextlib.suppress(Exception):
                    await ws.send_text(json.dumps(_error(None, exc)))
                    await ws.close(code=CLOSE_POLICY, reason="unauthenticated")
                return
        await Connection(ws, settings, search, compare, limits).run()

    return app


class DemoServer(uvicorn.Server):
    """uvicorn without its own signal handling: the stack owns Ctrl-C/SIGTERM for every part."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    @property
    def port(self) -> int:
        """The bound port (useful with port 0); valid once `started` is True."""
        sock = self.servers[0].sockets[0]
        return int(sock.getsockname()[1])


def build_server(app: FastAPI, settings: DemoSettings, *, port: int | None = None,
                 limits: DemoLimits = LIMITS) -> DemoServer:
    """HTTPS where settings name a certificate, required beyond loopback (sidecar/tls.py). `limits`: the
    app's (create_app), for the protocol layer's bound on a frame."""
    tls = server_tls("demo", settings.host, settings.tls_cert_file, settings.tls_key_file,
                     plaintext_beyond_loopback=settings.plaintext_beyond_loopback)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port if port is None else port,
        # Frames far beyond our own cap are refused by the protocol layer before they are read.
        ws_max_size=16 * limits.max_message_bytes,
        log_level="warning",
        access_log=False,
        lifespan="off",
        **(tls.uvicorn_options() if tls is not None else {}),
    )
    return DemoServer(config)
