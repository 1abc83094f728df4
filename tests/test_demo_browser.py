"""The typeahead page in a real headless Chromium (Debian's), driven by Playwright.

Types a query letter by letter and checks what a person would look at: results for the final
query, a stacked budget bar with its budget line (the lexical leg a segment of its own), the
session's P95, and on each result which search leg(s) found it; then switches the mode. Saves a
screenshot to test-artifacts/demo.png.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from demo_ui.search import SearchFn
from tests.components import require_package
from tests.fixtures_demo import running_demo, sidecar_search_fn

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
QUERY = "greek yogurt"


def _browser_missing() -> str | None:
    if not CHROMIUM.exists() and shutil.which("chromium") is None:
        return "Debian chromium is not installed (apt-get install chromium chromium-driver; `make browser`)"
    require_package("playwright")  # a [dev] dependency: missing is a failure where make built the venv
    return None


@pytest.fixture
def page_search(request: pytest.FixtureRequest) -> tuple[SearchFn, str]:
    """The page talks to a real sidecar (no fallback); where none can run, its fixture skips and says why."""
    reason = _browser_missing()  # checked first: no sidecar started for a test that cannot run
    if reason:
        pytest.skip(reason)
    target: str = request.getfixturevalue("sidecar_search_target")
    return sidecar_search_fn(target), "sidecar"


@pytest.mark.browser
async def test_typing_shows_results_budget_bar_and_p95(page_search: tuple[SearchFn, str]) -> None:
    from playwright.async_api import async_playwright

    search, kind = page_search
    async with running_demo(search, info={"backend": kind}) as addr, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1000, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.goto(f"http://{addr}/")
            await page.wait_for_selector("#status.ok", timeout=15_000)
            await page.click("#q")
            await page.keyboard.type(QUERY, delay=40)  # one input event per letter
            await page.wait_for_function(
                f"document.getElementById('results').dataset.query === {QUERY!r}", timeout=20_000)

            titles = await page.locator("#results li .title").all_inner_texts()
            assert len(titles) == 10
            assert "yogurt" in titles[0].lower()
            assert await page.locator("#segments .seg").count() >= 2
            assert await page.locator("#budget-line").is_visible()
            assert re.search(r"\b(within|over)\b", await page.locator("#bar").get_attribute("class") or "")
            p95 = await page.locator("#p95").inner_text()
            assert re.fullmatch(r"\d+(\.\d)? ms", p95), p95
            answered = int(await page.locator("#count").inner_text())
            assert 1 <= answered <= len(QUERY)  # superseded keystrokes are never answered
            assert await page.locator("#total").inner_text() != "–"
            # Hybrid by default: every result names the leg(s) that found it, and the lexical leg has its segment.
            assert await page.locator("#mode").input_value() == "hybrid"
            legs = await page.locator("#results li").evaluate_all(
                "lis => lis.map(li => [...li.querySelectorAll('.legs .leg')].map(b => b.textContent))")
            assert len(legs) == 10 and all(legs) and {leg for ls in legs for leg in ls} <= {"semantic", "lexical"}
            assert "lexical" in legs[0]  # "greek yogurt" is in the top titles: the lexical leg found them
            assert await page.locator('#segments .seg[data-stage="lexical"]').count() == 1
            assert "lexical (tantivy)" in await page.locator("#legend").inner_text()
            assert not errors, errors

            await page.select_option("#mode", "semantic")  # re-searches the same text semantically
            await page.wait_for_function(
                "[...document.querySelectorAll('#results li .leg')].every(b => b.textContent === 'semantic')"
                " && document.querySelectorAll('#segments .seg[data-stage=\"lexical\"]').length === 0",
                timeout=20_000)
            await page.select_option("#mode", "hybrid")
            await page.wait_for_function(
                "[...document.querySelectorAll('#results li .leg')].some(b => b.textContent === 'lexical')",
                timeout=20_000)

            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)
        finally:
            await browser.close()
