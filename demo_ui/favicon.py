"""The demo page's icon, made here rather than committed as a binary: a magnifier on the page's blue.

`SVG` is what the page links (`<link rel="icon" href="/favicon.svg">`); `ico()` the same drawing as a
32x32 PNG inside an ICO, for `/favicon.ico`, which browsers ask for on their own (Safari, and any
browser on a page without the link: /config, /health).
"""

from __future__ import annotations

import functools
import math
import struct
import zlib

SIZE = 32  # the drawing's units, and the ICO's pixels
BLUE = (0x5E, 0x81, 0xAC)  # the page's focus blue (static/style.css)
WHITE = (0xFF, 0xFF, 0xFF)
CORNER = 7.0
LENS = (14.0, 14.0, 7.0, 3.0)  # centre x, y, radius, stroke width
HANDLE = ((19.0, 19.0), (26.0, 26.0), 3.5)  # from, to, stroke width (round caps)

SVG = (
    f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {SIZE} {SIZE}">'
    f'<rect width="{SIZE}" height="{SIZE}" rx="{CORNER:g}" fill="#{"".join(f"{c:02x}" for c in BLUE)}"/>'
    f'<circle cx="{LENS[0]:g}" cy="{LENS[1]:g}" r="{LENS[2]:g}" fill="none" stroke="#fff" '
    f'stroke-width="{LENS[3]:g}"/>'
    f'<path d="M{HANDLE[0][0]:g} {HANDLE[0][1]:g}L{HANDLE[1][0]:g} {HANDLE[1][1]:g}" stroke="#fff" '
    f'stroke-width="{HANDLE[2]:g}" stroke-linecap="round"/></svg>'
).encode()
SVG_TYPE = "image/svg+xml"
ICO_TYPE = "image/x-icon"


def _inside_card(x: float, y: float) -> bool:
    """Within the rounded square."""
    cx = min(max(x, CORNER), SIZE - CORNER)
    cy = min(max(y, CORNER), SIZE - CORNER)
    return math.hypot(x - cx, y - cy) <= CORNER


def _on_magnifier(x: float, y: float) -> bool:
    lx, ly, r, w = LENS
    if abs(math.hypot(x - lx, y - ly) - r) <= w / 2:
        return True
    (ax, ay), (bx, by), hw = HANDLE
    dx, dy = bx - ax, by - ay
    t = min(1.0, max(0.0, ((x - ax) * dx + (y - ay) * dy) / (dx * dx + dy * dy)))
    return math.hypot(x - (ax + t * dx), y - (ay + t * dy)) <= hw / 2


def _pixel(px: int, py: int, samples: int = 4) -> bytes:
    """One RGBA pixel, `samples`² points averaged (antialiased edges)."""
    card = white = 0
    for i in range(samples):
        for j in range(samples):
            x, y = px + (i + 0.5) / samples, py + (j + 0.5) / samples
            if _inside_card(x, y):
                card += 1
                white += _on_magnifier(x, y)
    if not card:
        return b"\0\0\0\0"
    rgb = bytes(round((BLUE[k] * (card - white) + WHITE[k] * white) / card) for k in range(3))
    return rgb + bytes([round(255 * card / samples**2)])


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png() -> bytes:
    """The icon as a SIZE x SIZE RGBA PNG."""
    rows = b"".join(b"\0" + b"".join(_pixel(x, y) for x in range(SIZE)) for y in range(SIZE))  # filter 0 per row
    header = struct.pack(">IIBBBBB", SIZE, SIZE, 8, 6, 0, 0, 0)  # 8-bit RGBA
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows, 9))
            + _chunk(b"IEND", b""))


@functools.cache
def ico() -> bytes:
    """An ICO holding the PNG (every browser reads PNG inside ICO)."""
    image = png()
    directory = struct.pack("<HHH", 0, 1, 1)  # reserved, type 1 = icon, one image
    entry = struct.pack("<BBBBHHII", SIZE, SIZE, 0, 0, 1, 32, len(image), 6 + 16)
    return directory + entry + image
