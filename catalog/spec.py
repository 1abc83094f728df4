"""What a build indexes (`BuildSpec`, `--shard i/n`) and the fingerprints that name its work.

A fingerprint covers everything that changes the vectors (model, texts, chunking, shard), so
checkpoints and shard outputs of one input are never mistaken for another's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from catalog.sources import GROCERY_SOURCE, Product
from inference.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class BuildSpec:
    """What to index: a source (`grocery` or a .jsonl/.csv/.parquet path) and how to read it."""

    source: str = GROCERY_SOURCE
    id_field: str = "id"
    text_fields: tuple[str, ...] = ("title",)
    limit: int | None = None
    delimiter: str | None = None  # a CSV's field separator; None = sniffed (catalog/sources.py)
    index_type: str | None = None  # None = settings.catalog.index_type
    shard: tuple[int, int] = (0, 1)  # (i, n): this worker embeds rows whose id hashes to i mod n


def check_shard(i: int, n: int) -> None:
    if n < 1 or not 0 <= i < n:
        raise InvalidInput(f"bad shard {i}/{n}: need 0 <= i < n")


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError as exc:
        raise InvalidInput(f"--shard wants i/n (e.g. 0/4), got {text!r}") from exc
    check_shard(i, n)
    return i, n


def content_hash(products: Sequence[Product], texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p, t in zip(products, texts, strict=True):
        h.update(p.id.encode())
        h.update(b"\0")
        h.update(t.encode())
        h.update(b"\n")
    return h.hexdigest()


def fingerprint(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()
