"""The demo server's websocket: round trip, superseded keystrokes, bad input, floods.

Runs a real uvicorn server on 127.0.0.1:<free port> with a real in-process search (ORT + exact
search over ~330 grocery titles); the sidecar-backed round trip is in test_demo_sidecar.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from catalog.fusion import SearchMode
from demo_ui.limits import LIMITS, DemoLimits
from demo_ui.server import parse_message
from embedcar_client.results import SearchResult
from embedcar_settings import DemoSettings
from inference.errors import InvalidInput, Unavailable
from tests.fixtures_demo import GatedSearch, InProcessSearch, inprocess_search, running_demo

__all__ = ["inprocess_search"]  # fixture imported for pytest


async def recv(ws: ClientConnection, wait_s: float = 20.0) -> dict[str, Any]:
    return dict(json.loads(await asyncio.wait_for(ws.recv(), wait_s)))


async def ask(ws: ClientConnection, seq: int, text: str) -> dict[str, Any]:
    await ws.send(json.dumps({"seq": seq, "text": text}))
    return await recv(ws)


async def test_round_trip_returns_products_and_timings(inprocess_search: InProcessSearch) -> None:
    async with running_demo(inprocess_search) as addr, connect(f"ws://{addr}/ws") as ws:
        reply = await ask(ws, 1, "  greek yogurt ")
        assert reply["seq"] == 1
        assert reply["text"] == "greek yogurt"
        assert len(reply["results"]) == LIMITS.results
        top = reply["results"][0]
        assert set(top) == {"title", "aisle", "department", "score", "legs", "matched"} and top["legs"] == ["semantic"]
        assert reply["mode"] == "hybrid"  # the page's default mode
        assert "yogurt" in top["title"].lower()
        assert top["aisle"] and top["department"]
        scores = [r["score"] for r in reply["results"]]
        assert scores == sorted(scores, reverse=True)
        assert {"tokenize", "inference", "search"} <= set(reply["timings_ns"])
        assert reply["server_ms"] > 0
        assert reply["cache_hit"] is False
        k3 = json.loads(json.dumps({"seq": 2, "text": "bananas", "k": 3}))
        await ws.send(json.dumps(k3))
        assert len((await recv(ws))["results"]) == 3


async def test_each_keystroke_is_searched_in_its_mode(inprocess_search: InProcessSearch) -> None:
    async with running_demo(inprocess_search) as addr, connect(f"ws://{addr}/ws") as ws:
        assert (await ask(ws, 1, "milk"))["mode"] == "hybrid"
        await ws.send(json.dumps({"seq": 2, "text": "milk", "mode": "lexical"}))
        assert (await recv(ws))["mode"] == "lexical"
    assert inprocess_search.modes[-2:] == [SearchMode.HYBRID, SearchMode.LEXICAL]


async def test_empty_text_answers_without_searching(inprocess_search: InProcessSearch) -> None:
    before = inprocess_search.calls
    async with running_demo(inprocess_search) as addr, connect(f"ws://{addr}/ws") as ws:
        reply = await ask(ws, 1, "   ")
    assert reply["results"] == [] and reply["seq"] == 1
    assert inprocess_search.calls == before


async def test_superseded_keystrokes_are_dropped_not_computed(inprocess_search: InProcessSearch) -> None:
    gated = GatedSearch(inprocess_search, asyncio.Event(), asyncio.Event(), [])
    async with running_demo(gated) as addr, connect(f"ws://{addr}/ws") as ws:
        await ws.send(json.dumps({"seq": 1, "text": "o"}))
        await asyncio.wait_for(gated.entered.wait(), 10)  # seq 1 is being computed
        for seq, text in ((2, "or"), (3, "ora"), (4, "oran"), (5, "orange")):
            await ws.send(json.dumps({"seq": seq, "text": text}))
        dropped = [await recv(ws) for _ in range(3)]
        assert dropped == [{"seq": s, "dropped": "superseded"} for s in (2, 3, 4)]
        gated.gate.set()
        answers = [await recv(ws), await recv(ws)]
    assert [a["seq"] for a in answers] == [1, 5]
    assert answers[1]["text"] == "orange"
    assert gated.texts == ["o", "orange"]  # the superseded prefixes never reached search


async def test_older_sequence_numbers_are_ignored(inprocess_search: InProcessSearch) -> None:
    async with running_demo(inprocess_search) as addr, connect(f"ws://{addr}/ws") as ws:
        assert (await ask(ws, 7, "milk"))["seq"] == 7
        assert await ask(ws, 3, "mil") == {"seq": 3, "dropped": "stale"}
        assert await ask(ws, 7, "milk") == {"seq": 7, "dropped": "stale"}


@pytest.mark.parametrize(
    ("frame", "seq", "needle"),
    [
        ("not json {", None, "not JSON"),
        ("[1, 2, 3]", None, "JSON object"),
        ('{"seq": "1", "text": "milk"}', None, "seq"),
        ('{"seq": -1, "text": "milk"}', -1, "seq"),
        ('{"seq": true, "text": "milk"}', None, "seq"),
        ('{"seq": 1, "text": 42}', 1, "text"),
        ('{"seq": 1}', 1, "text"),
        ('{"seq": 1, "text": "milk", "k": 0}', 1, "k must"),
        ('{"seq": 1, "text": "milk", "k": 1000}', 1, "k must"),
        ('{"seq": 1, "text": "milk", "mode": "fuzzy"}', 1, "search mode"),
        ('{"seq": 1, "text": "milk", "mode": 2}', 1, "mode must"),
        ('{"seq": 1, "text": "' + "x" * 300 + '"}', 1, "longer than"),
        ("[" * 1500 + "]" * 1500, None, "JSON"),
    ],
)
async def test_bad_frames_get_an_error_and_the_connection_survives(
    inprocess_search: InProcessSearch, frame: str, seq: int | None, needle: str
) -> None:
    async with running_demo(inprocess_search) as addr, connect(f"ws://{addr}/ws") as ws:
        await ws.send(frame)
        err = await recv(ws)
        assert err["seq"] == seq
        assert err["error"]["code"] == "invalid_argument"
        assert needle in err["error"]["message"]
        assert (await ask(ws, 10, "apples"))["results"]  # still serving this connection


async def test_binary_frames(inprocess_search: InProcessSearch) -> None:
    async with running_demo(inprocess_search) as addr, connect(f"ws://{addr}/ws") as ws:
        await ws.send(b"\xff\xfe\x00")
        assert (await recv(ws))["error"]["code"] == "invalid_argument"
        await ws.send(json.dumps({"seq": 1, "text": "eggs"}).encode())
        assert (await recv(ws))["results"]


async def test_oversized_frames_close_the_connection(inprocess_search: InProcessSearch) -> None:
    async with running_demo(inprocess_search, limits=DemoLimits(max_message_bytes=1024)) as addr:
        async with connect(f"ws://{addr}/ws") as ws:
            await ws.send(json.dumps({"seq": 1, "text": "a" * 2000}))
            assert (await recv(ws))["error"]["code"] == "closed"
            with pytest.raises(ConnectionClosed) as info:
                await recv(ws)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1009
        # Far over the cap: refused by the protocol layer before the frame is read.
        async with connect(f"ws://{addr}/ws", max_size=None) as ws:
            await ws.send("x" * (1 << 20))
            with pytest.raises(ConnectionClosed) as info:
                await recv(ws)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1009
        async with connect(f"ws://{addr}/ws") as ws:  # the server is fine
            assert (await ask(ws, 1, "bread"))["results"]


async def test_flood_is_capped_then_cut_off(inprocess_search: InProcessSearch) -> None:
    async with running_demo(inprocess_search, limits=DemoLimits(max_messages_per_s=5.0)) as addr:
        async with connect(f"ws://{addr}/ws") as ws:
            for seq in range(1, 200):
                try:
                    await ws.send(json.dumps({"seq": seq, "text": "flood"}))
                except ConnectionClosed:
                    break
            replies: list[dict[str, Any]] = []
            with pytest.raises(ConnectionClosed) as info:
                while True:
                    replies.append(await recv(ws))
            assert info.value.rcvd is not None and info.value.rcvd.code == 1008
        codes = [r["error"]["code"] for r in replies if "error" in r]
        assert "resource_exhausted" in codes
        assert codes[-1] == "closed"
        async with connect(f"ws://{addr}/ws") as ws:  # other connections are unaffected
            assert (await ask(ws, 1, "cheese"))["results"]


async def test_search_errors_become_error_messages(inprocess_search: InProcessSearch) -> None:
    class DownSearch:
        """The sidecar being unreachable, as SidecarSearch reports it."""

        async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchResult:
            if text == "down":
                raise Unavailable("sidecar unreachable")
            if text == "bug":
                raise ZeroDivisionError
            return await inprocess_search(text, k=k, timeout_s=timeout_s, mode=mode)

    async with running_demo(DownSearch()) as addr, connect(f"ws://{addr}/ws") as ws:
        err = await ask(ws, 1, "down")
        assert err == {"seq": 1, "error": {"code": "unavailable", "message": "sidecar unreachable"}}
        assert (await ask(ws, 2, "bug"))["error"]["code"] == "internal"
        assert (await ask(ws, 3, "tea"))["results"]


async def test_page_config_and_health(inprocess_search: InProcessSearch) -> None:
    demo = DemoSettings(budget_ms=12.5)
    async with running_demo(inprocess_search, demo, info={"backend": "embedded"}) as addr, \
            httpx.AsyncClient(base_url=f"http://{addr}") as http:
        page = await http.get("/")
        assert page.status_code == 200 and 'id="q"' in page.text
        assert "http" not in page.text.replace("http-equiv", "")  # no CDN assets
        for asset in ("/static/app.js", "/static/style.css"):
            assert (await http.get(asset)).status_code == 200
        assert (await http.get("/config")).json() == {"budget_ms": 12.5, "results": 10, "mode": "hybrid",
                                                      "backend": "embedded"}
        assert (await http.get("/health")).json() == {"status": "ok"}


def test_parse_message_strips_and_defaults() -> None:
    key = parse_message('{"seq": 3, "text": " Milk ", "extra": 1}', max_query_chars=10, default_k=7)
    assert (key.seq, key.text, key.k, key.mode) == (3, "Milk", 7, SearchMode.HYBRID)
    assert parse_message('{"seq": 1, "text": "x"}', max_query_chars=10, default_k=7,
                         default_mode="semantic").mode == SearchMode.SEMANTIC
    assert parse_message('{"seq": 1, "text": "x", "mode": "LEXICAL"}', max_query_chars=10,
                         default_k=7).mode == SearchMode.LEXICAL
    with pytest.raises(InvalidInput):
        parse_message('{"seq": 1.5, "text": "x"}', max_query_chars=10, default_k=7)
