"""The sidecar's two RPCs, independent of gRPC and HTTP: Embed and Search.

    auth + rate limit -> the embedding pipeline (sidecar.pipeline) -> [Search: FAISS | tantivy | both fused]
    -> outcome

Everything between the texts and their embeddings is the pipeline's; this module adds who may
call, the default deadline, and the product index. A LEXICAL search embeds nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from catalog.fusion import SearchMode, parse_mode
from inference.backends.base import Embeddings
from inference.errors import FailedPrecondition, InvalidInput, Overloaded, Unauthenticated
from sidecar.auth import KeyRing
from sidecar.metrics import Metrics
from sidecar.pipeline import EmbedPipeline
from sidecar.ratelimit import RateLimiter
from sidecar.timings import Timings

if TYPE_CHECKING:
    from catalog.index import Hit
    from sidecar.search_index import IndexHolder


@dataclass(slots=True)
class EmbedOutcome:
    embeddings: Embeddings  # [n, dim] float32
    cache_hits: list[bool]
    truncated: list[bool]
    tokens: list[int]
    timings_ns: dict[str, int]
    backend: str = ""  # which backend computed the misses ("" = all from the cache)


@dataclass(slots=True)
class SearchOutcome:
    hits: list[list[Hit]]
    index_version: str
    cache_hits: list[bool]
    timings_ns: dict[str, int]
    backend: str = ""


class EmbedService:
    def __init__(self, pipeline: EmbedPipeline, *, model: str, keys: KeyRing, limiter: RateLimiter, metrics: Metrics,
                 default_deadline_s: float, max_k: int, index: IndexHolder | None = None) -> None:
        self.pipeline = pipeline
        self.model = model
        self.dim = pipeline.dim
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics
        self.index = index
        self.default_deadline_s = default_deadline_s
        self.max_k = max_k

    def authenticate(self, api_key: str | None) -> str:
        """Auth then rate limit; the tenant name."""
        try:
            tenant = self.keys.tenant_for(api_key)
        except Unauthenticated:
            self.metrics.rejections.labels("unauthenticated").inc()
            raise
        try:
            self.limiter.take(tenant)
        except Overloaded:
            self.metrics.rejections.labels("rate_limit").inc()
            raise
        return tenant

    def _deadline(self, deadline: float | None) -> float:
        return time.monotonic() + self.default_deadline_s if deadline is None else deadline

    async def embed(self, texts: Sequence[object], *, api_key: str | None = None, deadline: float | None = None,
                    authenticated: bool = False) -> EmbedOutcome:
        """`deadline` is on the time.monotonic() clock; None = the default deadline from settings."""
        t0 = time.perf_counter_ns()
        tm = Timings()
        if not authenticated:
            self.authenticate(api_key)
        tm.auth = time.perf_counter_ns() - t0
        out = await self.pipeline.run(texts, self._deadline(deadline), tm)
        tm.total = time.perf_counter_ns() - t0
        return EmbedOutcome(out.embeddings, out.cache_hits, out.truncated, out.tokens, tm.as_dict(), out.backend)

    async def search(self, texts: Sequence[object], *, k: int = 10, department: str | None = None,
                     aisle: str | None = None, mode: SearchMode | str = SearchMode.SEMANTIC,
                     api_key: str | None = None, deadline: float | None = None) -> SearchOutcome:
        t0 = time.perf_counter_ns()
        tm = Timings()
        self.authenticate(api_key)
        tm.auth = time.perf_counter_ns() - t0
        mode = parse_mode(mode)
        k = k or 10
        if not 1 <= k <= self.max_k:
            raise InvalidInput(f"k must be between 1 and {self.max_k}, got {k}")
        holder = self.index
        index = holder.current() if holder is not None else None
        if holder is None or index is None:
            # A configuration error is FAILED_PRECONDITION (retrying cannot help), UNAVAILABLE only
            # while the configured index may still appear (see IndexHolder.missing).
            raise (holder.missing() if holder is not None
                   else FailedPrecondition("no product index loaded: this sidecar has no index_dir"))
        if mode == SearchMode.LEXICAL:
            t1 = time.perf_counter_ns()
            clean = self.pipeline.validate(texts)  # the same texts are refused as by the other modes
            tm.cache = time.perf_counter_ns() - t1
            vectors, cache_hits, backend = None, [False] * len(clean), ""
        else:
            emb = await self.pipeline.run(texts, self._deadline(deadline), tm)
            clean = cast(list[str], list(texts))  # the pipeline has checked they are strings
            vectors, cache_hits, backend = emb.embeddings, emb.cache_hits, emb.backend
        t2 = time.perf_counter_ns()
        hits, ranking = await holder.query(index, clean, vectors, k, mode=mode, department=department or None,
                                           aisle=aisle or None)
        t3 = time.perf_counter_ns()
        tm.lexical = ranking.lexical_ns
        tm.search = t3 - t2 - ranking.lexical_ns  # the FAISS leg, fusion, the hits' fields and the thread hop
        tm.total = t3 - t0
        return SearchOutcome(hits, str(index.version), cache_hits, tm.as_dict(), backend)
