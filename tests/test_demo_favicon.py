"""The demo page's icon: linked from the page, and /favicon.ico (which browsers ask for unprompted) is an
image, not a 404. A real uvicorn demo server; no search is made."""

from __future__ import annotations

import io
import re
from typing import NoReturn
from xml.etree import ElementTree

import httpx

from catalog.fusion import SearchMode
from inference.errors import Unavailable
from tests.fixtures_demo import running_demo


class NoSearch:
    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> NoReturn:
        raise Unavailable("no search in this test")


async def test_the_page_links_its_icon_and_favicon_ico_is_an_image() -> None:
    from PIL import Image

    async with running_demo(NoSearch()) as addr, httpx.AsyncClient(base_url=f"http://{addr}") as http:
        page = (await http.get("/")).text
        links = dict(re.findall(r'<link rel="icon" href="(/[^"]+)"[^>]*?(?:type="([^"]+)")?>', page))
        assert set(links) == {"/favicon.ico", "/favicon.svg"}, page
        assert links["/favicon.svg"] == "image/svg+xml"

        ico = await http.get("/favicon.ico")
        assert ico.status_code == 200 and ico.headers["content-type"] == "image/x-icon"
        image = Image.open(io.BytesIO(ico.content))
        assert image.format == "ICO" and image.size == (32, 32)
        rgba = image.convert("RGBA")
        assert rgba.getpixel((0, 0)) == (0, 0, 0, 0)  # the rounded corner is clear
        assert rgba.getpixel((22, 9)) == (0x5E, 0x81, 0xAC, 255)  # the page's blue

        svg = await http.get("/favicon.svg")
        assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml"
        assert ElementTree.fromstring(svg.content).tag == "{http://www.w3.org/2000/svg}svg"
        assert "max-age" in svg.headers["cache-control"]
