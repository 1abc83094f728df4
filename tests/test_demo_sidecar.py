"""The demo through a real Sidecar (embedded ORT backend) serving a small real catalog index."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect

from catalog.fusion import SearchMode
from demo_ui.search import ServiceSearch, SidecarSearch
from demo_ui.stack import Prepared, choose_backend, prepare, serve
from embedcar_settings import Settings
from inference.errors import FailedPrecondition, Unavailable
from tests.fixtures_demo import _SHARED, running_demo, sidecar_search_fn, sidecar_search_target

__all__ = ["sidecar_search_target"]  # fixture imported for pytest


async def ask(ws: Any, seq: int, text: str) -> dict[str, Any]:
    await ws.send(json.dumps({"seq": seq, "text": text}))
    return dict(json.loads(await asyncio.wait_for(ws.recv(), 30)))


async def test_websocket_round_trip_through_the_sidecar(sidecar_search_target: str) -> None:
    async with running_demo(sidecar_search_fn(sidecar_search_target)) as addr, \
            connect(f"ws://{addr}/ws") as ws:
        first = await ask(ws, 1, "Greek Yogurt strawberry")
        assert first["seq"] == 1 and len(first["results"]) == 10
        top = first["results"][0]
        assert "yogurt" in top["title"].lower()
        assert top["aisle"] == "yogurt" and top["department"] == "dairy eggs"
        assert {"cache", "tokenize", "queue", "inference", "search", "lexical", "total"} <= set(first["timings_ns"])
        assert first["timings_ns"]["inference"] > 0 and first["timings_ns"]["search"] > 0
        assert first["mode"] == "hybrid" and first["timings_ns"]["lexical"] > 0  # the demo's default
        assert "lexical" in top["legs"] and all(set(r["legs"]) <= {"semantic", "lexical"} for r in first["results"])
        assert first["server_ms"] * 1e6 >= first["timings_ns"]["total"]  # the sidecar is inside our time
        # The same query again (different case and spacing) is a sidecar cache hit, same products.
        again = await ask(ws, 2, "  greek yogurt STRAWBERRY")
        assert again["cache_hit"] is True
        assert [r["title"] for r in again["results"]] == [r["title"] for r in first["results"]]
        await ws.send(json.dumps({"seq": 3, "text": "greek yog", "mode": "semantic"}))
        semantic = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert all(r["legs"] == ["semantic"] for r in semantic["results"]) and semantic["timings_ns"]["lexical"] == 0


async def test_in_process_search_equals_the_grpc_search(sidecar_search_target: str) -> None:
    """`embedcar demo` calls its own sidecar's service directly: the same products as over gRPC."""
    from embedcar_client.client import AsyncClient

    thread = _SHARED["thread"]
    direct = ServiceSearch(thread.sidecar.service)
    for mode in (SearchMode.HYBRID, SearchMode.SEMANTIC):
        here = thread.call(direct("greek yogurt honey", k=5, timeout_s=30, mode=mode))  # on the sidecar's loop
        async with AsyncClient(sidecar_search_target) as client:
            remote = await SidecarSearch(client)("greek yogurt honey", k=5, timeout_s=30, mode=mode)
        found = [[(h.id, h.fields, h.legs) for h in res.hits[0]] for res in (here, remote)]  # wire scores: float32
        assert found[0] == found[1] and len(found[0]) == 5
        assert here.model == remote.model and here.index_version == remote.index_version
        assert set(here.timings_ns) == set(remote.timings_ns)


async def test_sidecar_down_is_an_error_message_not_a_crash(unused_tcp_port: int) -> None:
    from embedcar_client.client import AsyncClient

    async with AsyncClient(f"127.0.0.1:{unused_tcp_port}") as client, \
            running_demo(SidecarSearch(client)) as addr, connect(f"ws://{addr}/ws") as ws:
        err = await ask(ws, 1, "milk")
        assert err["seq"] == 1 and err["error"]["code"] in ("unavailable", "deadline_exceeded")
        assert (await ask(ws, 2, "   "))["results"] == []  # the connection is still served


async def test_stack_serves_the_page_and_stops_cleanly(settings: Settings, sidecar_search_target: str) -> None:
    """The serving phase of `embedcar demo` (setup and Triton aside), on free ports."""
    index_root: Path = _SHARED["index_root"]
    s = settings.with_section("demo", port=0).with_section("model", intra_op_threads=1)
    prepared = Prepared(settings=s, backend="embedded", model_id="test", index_dir=index_root)
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    lines: list[str] = []
    task = asyncio.create_task(serve(prepared, lines.append, stop=stop, on_ready=ready.set_result))
    try:
        url = await asyncio.wait_for(ready, 120)
        assert url.startswith("http://127.0.0.1:")
        async with connect(url.replace("http://", "ws://") + "ws") as ws:
            assert (await ask(ws, 1, "bananas"))["results"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert any("demo ready" in line for line in lines)
    assert lines[-1] == "stopping…"


def test_choose_backend() -> None:
    from inference.triton.launcher import triton_unavailable_reason

    said: list[str] = []
    assert choose_backend("embedded", said.append) == "embedded"
    reason = triton_unavailable_reason()
    if reason is None:
        assert choose_backend("auto", said.append) == "triton"
        assert choose_backend("triton", said.append) == "triton"
        assert not said
    else:
        assert choose_backend("auto", said.append) == "embedded"
        assert reason in said[0] and "embedded" in said[0]
        with pytest.raises(Unavailable):
            choose_backend("triton", said.append)
    with pytest.raises(FailedPrecondition):  # a setting to fix, as everywhere an unknown backend is named
        choose_backend("gpu", said.append)


def test_second_start_reuses_model_and_index(settings: Settings, sidecar_search_target: str) -> None:
    """With a prepared model and a complete index for this model in place, setup builds nothing."""
    index_root: Path = _SHARED["index_root"]
    before = sorted(p.name for p in index_root.iterdir())
    said: list[str] = []
    prepared = prepare(settings.with_section("catalog", index_root=index_root), "embedded", said.append)
    assert prepared.backend == "embedded" and prepared.index_dir == index_root
    assert prepared.model_id.startswith(settings.model.name + "@")
    assert "nothing to do" in said[0]
    assert sorted(p.name for p in index_root.iterdir()) == before
