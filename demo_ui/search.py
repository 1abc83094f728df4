"""What the demo server needs from search: one async call, text -> products + per-stage timings.

The websocket logic depends only on `SearchFn`, so it can be exercised against any real
implementation. `ServiceSearch` is the one `embedcar demo` runs: its sidecar lives in the demo
server's process, so a keystroke calls the sidecar's service directly (its auth, rate limit,
pipeline and index, no gRPC round trip). `SidecarSearch` calls a sidecar elsewhere over gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from catalog.fusion import SearchMode

if TYPE_CHECKING:
    from catalog.index import Hit
    from sidecar.client import AsyncClient
    from sidecar.service import EmbedService

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


def aisle_agreement(products: Sequence[Product], top: int = 3) -> dict[str, str | int] | None:
    """Compare mode's per-column badge: how many of the results lie in the aisle most common among
    the column's own first `top` (ties go to the higher-ranked result). It measures how coherent a
    column is, not whether it is relevant (no query has a labelled answer offline): a column whose
    results all share one wrong aisle scores full marks. None where the results carry no aisle."""
    head = [p.aisle for p in products[:top] if p.aisle]
    if not head:
        return None
    aisle = max(head, key=lambda a: (head.count(a), -head.index(a)))
    return {"aisle": aisle, "count": sum(p.aisle == aisle for p in products), "of": len(products)}


class SearchFn(Protocol):
    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchOutcome:
        """Best `k` products for one query. Raises inference.errors types only."""
        ...


def _outcome(hits: list[list[Hit]], timings_ns: dict[str, int], cache_hits: list[bool], model: str,
             index_version: str) -> SearchOutcome:
    products = [Product(title=h.fields.get("title", h.id), aisle=h.fields.get("aisle", ""),
                        department=h.fields.get("department", ""), score=float(h.score), legs=h.legs)
                for h in (hits[0] if hits else [])]
    return SearchOutcome(products=products, timings_ns={k: int(v) for k, v in timings_ns.items()},
                         cache_hit=bool(cache_hits[0]) if cache_hits else False, model=model,
                         index_version=index_version)


class SidecarSearch:
    """`SearchFn` over a sidecar's gRPC `Search` (one shared client for all connections)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchOutcome:
        res = await self._client.search([text], k=k, mode=mode, timeout_s=timeout_s)
        return _outcome(res.hits, res.timings_ns, res.cache_hits, res.model, res.index_version)


class ServiceSearch:
    """`SearchFn` straight into the sidecar's service in this process (what `embedcar demo` runs).
    `model`: one of the served models by name (`--compare`); None = the sidecar's default."""

    def __init__(self, service: EmbedService, model: str | None = None) -> None:
        self._service = service
        self._model = model

    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchOutcome:
        res = await self._service.search([text], k=k, mode=mode, model=self._model,
                                         deadline=time.monotonic() + timeout_s)
        # The reply's own id: the version that answered, also after a rollout swapped the model.
        return _outcome(res.hits, res.timings_ns, res.cache_hits, res.model or self._service.model,
                        res.index_version)
