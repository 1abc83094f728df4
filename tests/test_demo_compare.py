"""`embedcar demo --compare NAME`: the demo's model and NAME side by side, through a real stack.

Two tiny random models (differently seeded, so their vectors and rankings differ) are prepared as a
user's own models, each gets a small real catalog index, and the demo's setup and serving phases
run as `embedcar demo` runs them (embedded backend, free ports).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from catalog.fusion import SearchMode
from demo_ui.search import aisle_agreement
from demo_ui.server import build_server, create_app
from demo_ui.stack import Prepared, prepare, serve
from embedcar_client.results import SearchHit, SearchResult
from embedcar_settings import DemoSettings, Settings
from inference.errors import FailedPrecondition, ModelError, Unavailable
from inference.prepare import prepare_model
from tests.fixtures_demo import build_small_index, grocery_sample
from tests.fixtures_models import tiny_st_folder

BASE, TUNED = "tiny-base", "tiny-tuned"
ONE_MODEL_KEYS = {"seq", "text", "mode", "results", "timings_ns", "server_ms", "cache_hit"}  # as before --compare


@pytest.fixture(scope="module")
def two_models(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings whose model is BASE, with TUNED prepared next to it and an index of each in the index root."""
    root = tmp_path_factory.mktemp("compare")
    for name, seed in ((BASE, 0), (TUNED, 1)):
        src = tiny_st_folder(root / "src" / name, "bert", seed=seed)
        prepare_model(root / "models", name, from_dir=src, say=lambda _m: None)
    s = settings.with_section("catalog", index_root=root / "indexes").with_section("demo", port=0)
    s = s.with_section("model", models_dir=root / "models", intra_op_threads=1)
    products = grocery_sample()
    for name in (TUNED, BASE):
        build_small_index(named(s, name), products)
    return named(s, BASE)


def named(settings: Settings, model: str) -> Settings:
    return dataclasses.replace(settings, model=dataclasses.replace(settings.model, name=model))


@contextlib.asynccontextmanager
async def demo_stack(prepared: Prepared) -> AsyncIterator[str]:
    """`embedcar demo`'s serving phase on free ports; yields the page's URL."""
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(prepared, lambda _m: None, stop=stop, on_ready=ready.set_result))
    try:
        yield await asyncio.wait_for(ready, 120)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def ask(ws: Any, seq: int, text: str, mode: str = "hybrid") -> dict[str, Any]:
    await ws.send(json.dumps({"seq": seq, "text": text, "mode": mode}))
    return dict(json.loads(await asyncio.wait_for(ws.recv(), 30)))


async def test_one_keystroke_two_columns_with_each_models_results(two_models: Settings) -> None:
    said: list[str] = []
    prepared = await asyncio.to_thread(prepare, two_models, "embedded", said.append, compare=TUNED)
    assert prepared.settings.sidecar.models == (BASE, TUNED)
    assert prepared.model_id.startswith(f"{BASE}@") and prepared.compare_id.startswith(f"{TUNED}@")
    assert sum("catalog index" in line for line in said) == 2  # both found in place: nothing built
    async with demo_stack(prepared) as url, connect(url.replace("http://", "ws://") + "ws") as ws, \
            httpx.AsyncClient(base_url=url) as http:
        config = (await http.get("/config")).json()
        assert (config["model"], config["compare"]) == (prepared.model_id, prepared.compare_id)

        reply = await ask(ws, 1, "greek yogurt", "semantic")  # the embeddings alone: where the models differ
        base, tuned = reply["columns"]
        assert [base["model"], tuned["model"]] == [prepared.model_id, prepared.compare_id]
        assert len(base["results"]) == len(tuned["results"]) == 10
        assert [r["title"] for r in base["results"]] != [r["title"] for r in tuned["results"]]
        # The top level is the demo's model's column, so a one-column client reads what it always did.
        assert reply["model"] == base["model"] and reply["results"] == base["results"]
        assert reply["timings_ns"] == base["timings_ns"] and reply["cache_hit"] is base["cache_hit"]
        for col in (base, tuned):
            assert col["timings_ns"]["inference"] > 0 and col["timings_ns"]["search"] > 0
            assert 0 < col["server_ms"] <= reply["server_ms"]
            assert col["server_ms"] * 1e6 >= col["timings_ns"]["total"]
            agree = col["aisles"]
            assert agree["of"] == 10 and 1 <= agree["count"] <= 10
            assert agree["aisle"] in [r["aisle"] for r in col["results"][:3]]

        hybrid = await ask(ws, 2, "greek yogurt")  # each model's own cache and index, both legs
        assert [c["model"] for c in hybrid["columns"]] == [base["model"], tuned["model"]]
        assert all(len(c["results"]) == 10 and c["timings_ns"]["lexical"] > 0 for c in hybrid["columns"])
        again = await ask(ws, 3, "Greek  Yogurt", "semantic")
        assert [c["cache_hit"] for c in again["columns"]] == [True, True]
        assert [c["results"] for c in again["columns"]] == [base["results"], tuned["results"]]
        empty = await ask(ws, 4, "  ")
        assert [c["results"] for c in empty["columns"]] == [[], []] and empty["results"] == []


async def test_without_compare_one_column_as_before(two_models: Settings) -> None:
    prepared = await asyncio.to_thread(prepare, two_models, "embedded", lambda _m: None)
    assert prepared.compare == "" and prepared.settings.sidecar.models == two_models.sidecar.models
    async with demo_stack(prepared) as url, connect(url.replace("http://", "ws://") + "ws") as ws, \
            httpx.AsyncClient(base_url=url) as http:
        assert "compare" not in (await http.get("/config")).json()
        reply = await ask(ws, 1, "greek yogurt")
        assert set(reply) == ONE_MODEL_KEYS and len(reply["results"]) == 10


def test_a_compare_model_that_is_not_prepared_is_a_one_line_error(two_models: Settings) -> None:
    with pytest.raises(ModelError) as err:
        prepare(two_models, "embedded", lambda _m: None, compare="shop-tuned")
    msg = err.value.message
    assert "shop-tuned" in msg and "embedcar model tune" in msg and "embedcar model prepare" in msg
    assert "\n" not in msg
    with pytest.raises(FailedPrecondition, match="the demo's own model"):
        prepare(two_models, "embedded", lambda _m: None, compare=BASE)
    with pytest.raises(FailedPrecondition, match="folder name"):
        prepare(two_models, "embedded", lambda _m: None, compare="../models/tiny-tuned")


def test_the_cli_says_so_in_one_line(tmp_path: Path) -> None:
    """What a user sees: `embedcar demo --compare NAME` with no NAME prepared stops before any setup."""
    env = {**os.environ, "EMBEDCAR_HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "inference.cli_main", "demo", "--no-triton", "--compare", "shop-tuned"],
                       capture_output=True, text=True, timeout=120, check=False, env=env)
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("embedcar: --compare shop-tuned: no prepared model in") and "model tune" in line
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())  # nothing fetched


async def test_one_columns_error_is_the_keystrokes_error() -> None:
    """A failing model costs the keystroke an error reply (after both searches ended), not the connection."""

    class Fixed:
        def __init__(self, model: str, aisle: str) -> None:
            self.model, self.aisle = model, aisle

        async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchResult:
            if text == "down" and self.model == "b":
                raise Unavailable("model b is down")
            found = [SearchHit(str(i), 1.0 - i / 10, {"title": f"{text} {i}", "aisle": self.aisle, "department": "d"})
                     for i in range(k)]
            return SearchResult([found], self.model, "", [False], {"inference": 1000})

    demo = DemoSettings()
    server = build_server(create_app(demo, Fixed("a", "tea"), compare=Fixed("b", "")), demo, port=0)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("demo server stopped before it started")
            await asyncio.sleep(0.01)
        async with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            err = await ask(ws, 1, "down")
            assert err == {"seq": 1, "error": {"code": "unavailable", "message": "model b is down"}}
            ok = await ask(ws, 2, "tea")
            assert [c["model"] for c in ok["columns"]] == ["a", "b"]
            assert ok["columns"][0]["aisles"] == {"aisle": "tea", "count": 10, "of": 10}
            assert ok["columns"][1]["aisles"] is None  # no aisle labels: no badge
    finally:
        server.should_exit = True
        await task


def test_aisle_agreement_counts_the_top_three_majority() -> None:
    def col(*aisles: str) -> list[SearchHit]:
        return [SearchHit(str(i), 0.0, {"title": str(i), "aisle": a}) for i, a in enumerate(aisles)]

    assert aisle_agreement(col("yogurt", "milk", "yogurt", "yogurt", "tea")) == {"aisle": "yogurt", "count": 3, "of": 5}
    # No majority among the top 3: the best-ranked result's aisle.
    assert aisle_agreement(col("tea", "milk", "yogurt", "milk", "milk")) == {"aisle": "tea", "count": 1, "of": 5}
    assert aisle_agreement(col("", "milk", "")) == {"aisle": "milk", "count": 1, "of": 3}
    assert aisle_agreement(col("", "", "", "milk")) is None and aisle_agreement([]) is None


@pytest.mark.browser
async def test_the_page_shows_both_columns(two_models: Settings) -> None:
    from tests.test_demo_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _browser_missing

    reason = _browser_missing()
    if reason:
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    prepared = await asyncio.to_thread(prepare, two_models, "embedded", lambda _m: None, compare=TUNED)
    query = "greek yogurt"
    async with demo_stack(prepared) as url, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1200, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.goto(url)
            await page.wait_for_selector("#status.ok", timeout=15_000)
            await page.click("#q")
            await page.keyboard.type(query, delay=30)
            await page.wait_for_function(
                f"[...document.querySelectorAll('.column .results')].every(ol => ol.dataset.query === {query!r})"
                " && document.querySelectorAll('.column').length === 2", timeout=20_000)
            columns = page.locator(".column")
            for i, (name, model_id) in enumerate(((BASE, prepared.model_id), (TUNED, prepared.compare_id))):
                column = columns.nth(i)
                assert await column.locator(".col-model").inner_text() == model_id
                assert await column.locator(".col-model").get_attribute("title") == model_id
                assert await column.locator(".results li").count() == 10
                assert await column.locator(".col-ms").inner_text() != ""
                assert await column.locator(".agree").is_visible()
                bar = page.locator(".lat-col").nth(i)
                assert (await bar.locator(".col-model").inner_text()).startswith(name + "@")
                assert await bar.locator(".segments .seg").count() >= 2
                assert await bar.locator(".budget-line").is_visible()
            assert await page.locator("#agree-note").is_visible()
            assert await page.locator("#compare-note").is_visible()
            assert not errors, errors
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "demo-compare.png"), full_page=True)
        finally:
            await browser.close()
