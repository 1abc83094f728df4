"""Every relative link and anchor in the README and docs/ resolves: the file exists, and a `#fragment`
names a heading of that file (GitHub's anchor rule) or an explicit `id`/`name` anchor in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"[*_~]", lambda m: m.group(0) if m.group(0) == "_" else "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _prose(page):
        if (m := _HEADING.match(line)) is not None:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
        found.update(_HTML_ANCHOR.findall(line))
    return found


def links(page: Path) -> list[str]:
    out = []
    for line in _prose(page):
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        for m in _LINK.finditer(line):
            out.append(m.group(1) or m.group(2))
    return out


def broken(page: Path) -> list[str]:
    wrong = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            wrong.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            wrong.append(f"{target}: no heading or anchor #{fragment} in {dest.relative_to(ROOT)}")
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_and_anchor_resolves(page: Path) -> None:
    assert broken(page) == []


def test_the_anchor_rule_is_githubs() -> None:
    assert slug("3. Hostile clients") == "3-hostile-clients"
    assert slug("The variant served (int8, bf16, fp32, fp16)") == "the-variant-served-int8-bf16-fp32-fp16"
    assert slug("`sidecar.grpc_server`: the compiled front") == "sidecargrpc_server-the-compiled-front"
    assert slug("Heavy overload: where a refusal is paid") == "heavy-overload-where-a-refusal-is-paid"
