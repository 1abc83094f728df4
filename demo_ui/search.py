"""What the demo server needs from search: one async call, text -> the client's SearchResult.

The websocket logic depends only on `SearchFn`, so it can be exercised against any real
implementation. `ServiceSearch` is the one `embedcar demo` runs: its sidecar lives in the demo
server's process, so a keystroke calls the sidecar's service directly (its auth, rate limit,
pipeline and index, no gRPC round trip). `SidecarSearch` calls a sidecar elsewhere over gRPC.
Either way the page sees what a gRPC caller would (embedcar_client/results.py): the page is a client.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from catalog.fusion import SearchMode
from embedcar_client.results import SearchHit, SearchResult

if TYPE_CHECKING:
    from embedcar_client.client import AsyncClient
    from sidecar.service import EmbedService

# Sidecar stages the page draws as bar segments (the sidecar's own `total` is kept separately).
STAGES: tuple[str, ...] = ("cache", "tokenize", "queue", "inference", "search", "lexical")


def hit_json(hit: SearchHit) -> dict[str, str | float | list[str]]:
    """One result row as the page draws it (a product without a title shows its id); `matched`: the
    typed attributes it carries, shown beside its legs."""
    return {"title": hit.fields.get("title", hit.id), "aisle": hit.fields.get("aisle", ""),
            "department": hit.fields.get("department", ""), "score": round(hit.score, 4), "legs": list(hit.legs),
            "matched": list(hit.matched)}


def aisle_agreement(hits: Sequence[SearchHit], top: int = 3) -> dict[str, str | int] | None:
    """Compare mode's per-column badge: how many of the results lie in the aisle most common among
    the column's own first `top` (ties go to the higher-ranked result). It measures how coherent a
    column is, not whether it is relevant (no query has a labelled answer offline): a column whose
    results all share one wrong aisle scores full marks. None where the results carry no aisle."""
    aisles = [h.fields.get("aisle", "") for h in hits]
    head = [a for a in aisles[:top] if a]
    if not head:
        return None
    aisle = max(head, key=lambda a: (head.count(a), -head.index(a)))
    return {"aisle": aisle, "count": aisles.count(aisle), "of": len(aisles)}


class SearchFn(Protocol):
    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchResult:
        """Best `k` products for one query (`hits[0]`). Raises inference.errors types only."""
        ...


class SidecarSearch:
    """`SearchFn` over a sidecar's gRPC `Search` (one shared client for all connections)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchResult:
        return await self._client.search([text], k=k, mode=mode, timeout_s=timeout_s)


class ServiceSearch:
    """`SearchFn` straight into the sidecar's service in this process (what `embedcar demo` runs).
    `model`: one of the served models by name (`--compare`); None = the sidecar's default."""

    def __init__(self, service: EmbedService, model: str | None = None) -> None:
        self._service = service
        self._model = model

    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchResult:
        service = self._service
        call = service.call(service.caller(None), model=self._model, deadline=time.monotonic() + timeout_s)
        res = await service.search(call, [text], k=k, mode=mode)
        hits = [[SearchHit(h.id, float(h.score), h.fields, h.legs, h.matched) for h in hl] for hl in res.hits]
        # The reply's own id: the version that answered, also after a rollout swapped the model.
        return SearchResult(hits, res.model or self._service.model, res.index_version, list(res.cache_hits),
                            {k: int(v) for k, v in res.timings_ns.items()}, res.backend)
