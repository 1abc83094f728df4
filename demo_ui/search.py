"""What the demo server needs from search: one async call, text -> products + per-stage timings.

The websocket logic depends only on `SearchFn`, so it can be exercised against any real
implementation; `SidecarSearch` is the one the demo runs (the sidecar's `Search` over gRPC).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from catalog.fusion import SearchMode

if TYPE_CHECKING:
    from sidecar.client import AsyncClient

# Sidecar stages the page draws as bar segments (the sidecar's own `total` is kept separately).
STAGES: tuple[str, ...] = ("cache", "tokenize", "queue", "inference", "search", "lexical")


@dataclass(frozen=True, slots=True)
class Product:
    title: str
    aisle: str
    department: str
    score: float
    legs: tuple[str, ...] = ()  # which search leg(s) found it: "semantic", "lexical"

    def to_json(self) -> dict[str, str | float | list[str]]:
        return {"title": self.title, "aisle": self.aisle, "department": self.department,
                "score": round(self.score, 4), "legs": list(self.legs)}


@dataclass(frozen=True, slots=True)
class SearchOutcome:
    products: list[Product]
    timings_ns: dict[str, int] = field(default_factory=dict)
    cache_hit: bool = False
    model: str = ""
    index_version: str = ""


class SearchFn(Protocol):
    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchOutcome:
        """Best `k` products for one query. Raises inference.errors types only."""
        ...


class SidecarSearch:
    """`SearchFn` over the sidecar's gRPC `Search` (one shared client for all connections; the demo's
    sends them as messages on one open Stream call)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchOutcome:
        res = await self._client.search([text], k=k, mode=mode, timeout_s=timeout_s)
        hits = res.hits[0] if res.hits else []
        products = [
            Product(title=h.fields.get("title", h.id), aisle=h.fields.get("aisle", ""),
                    department=h.fields.get("department", ""), score=float(h.score), legs=h.legs)
            for h in hits
        ]
        return SearchOutcome(
            products=products,
            timings_ns={k_: int(v) for k_, v in res.timings_ns.items()},
            cache_hit=bool(res.cache_hits[0]) if res.cache_hits else False,
            model=res.model,
            index_version=res.index_version,
        )
