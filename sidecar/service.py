"""The sidecar's two RPCs, independent of gRPC and HTTP: Embed and Search.

    auth + rate limit -> the model the request names (sidecar.models) -> its embedding pipeline
    (sidecar.pipeline) -> [Search: that model's index: FAISS | tantivy | both fused] -> outcome

Everything between the texts and their embeddings is the pipeline's; this module adds who may
call, which model answers, the default deadline, and the product index. Each request becomes one
`Call` as it is admitted (`open`: key + rate limit + model; `caller` then `call` where the key was
checked apart, for a Stream or by the HTTP gate), carried to whichever thread finishes it: the key is
checked, the token taken and the tenant found once, and the vector and the index of one Search reply
are always the same model version's.
A LEXICAL search embeds nothing.

Where the API keys name several tenants, each tenant's requests use their own cache partition
(sidecar.cache): a reply's cache flag and its latency say nothing about what another tenant asked.
With one tenant or no keys every request shares the cache, as the operator's warm queries do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from catalog.fusion import SearchMode, parse_mode
from inference.backends.base import Embeddings
from inference.errors import InvalidInput, Overloaded, Unauthenticated
from sidecar.auth import KeyRing
from sidecar.metrics import Metrics
from sidecar.models import ModelSet, ServedModel
from sidecar.pipeline import TOKENIZE_ON_LOOP_MAX, Embedded
from sidecar.ratelimit import RateLimiter
from sidecar.timings import Timings

if TYPE_CHECKING:
    from catalog.index import Hit


@dataclass(slots=True)
class EmbedOutcome:
    embeddings: Embeddings  # [n, dim] float32
    cache_hits: list[bool]
    truncated: list[bool]
    tokens: list[int]
    timings_ns: dict[str, int]
    backend: str = ""  # which backend computed the misses ("" = all from the cache)
    model: str = ""  # the version id of the model that answered


@dataclass(slots=True)
class SearchOutcome:
    hits: list[list[Hit]]
    index_version: str
    cache_hits: list[bool]
    timings_ns: dict[str, int]
    backend: str = ""
    model: str = ""  # the version id of the model whose vectors searched the index


@dataclass(slots=True)
class Call:
    """One request as the service admitted it, made once (`EmbedService.open` / `call`) and carried to
    whichever thread finishes it: the cache partition of its caller, the model version that answers
    (resolved once: a rollout meanwhile does not split a reply), its deadline and its timings so far."""

    served: ServedModel
    partition: str | None  # EmbeddingCache.key's: the tenant's where tenants are kept apart, else None
    deadline: float  # time.monotonic()
    t0: int  # time.perf_counter_ns() as the service took it
    timings: Timings


class EmbedService:
    def __init__(self, models: ModelSet, *, keys: KeyRing, limiter: RateLimiter, metrics: Metrics,
                 default_deadline_s: float, max_k: int) -> None:
        self.models = models
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics
        self.default_deadline_s = default_deadline_s
        self.max_k = max_k
        self.per_tenant_cache = len(keys.tenants) > 1  # the ring is fixed once built

    def partition(self, tenant: str | None) -> str | None:
        """The cache partition of a tenant's requests (EmbeddingCache.key): None = shared."""
        return tenant if self.per_tenant_cache else None

    @property
    def model(self) -> str:
        """The default model's version id (what a request naming no model gets)."""
        return self.models.default.version_id

    def caller(self, api_key: str | None) -> str:
        """The tenant owning `api_key`, or Unauthenticated (counted)."""
        try:
            return self.keys.tenant_for(api_key)
        except Unauthenticated:
            self.metrics.rejections.labels("unauthenticated").inc()
            raise

    def call(self, tenant: str | None, *, model: str | None = None, deadline: float | None = None,
             t0: int | None = None) -> Call:
        """A request of `tenant` (its key already checked: `caller`), after its rate-limit token; tenant
        None: the operator's own (warm queries): no limit, the shared cache partition. `deadline` is on
        the time.monotonic() clock, None = the default from settings; `model` a served model's name or
        version id, None = the default (first) one."""
        t0 = time.perf_counter_ns() if t0 is None else t0
        if tenant is not None:
            try:
                self.limiter.take(tenant)
            except Overloaded:
                self.metrics.rejections.labels("rate_limit").inc()
                raise
        served = self.models.get(model)
        deadline = time.monotonic() + self.default_deadline_s if deadline is None else deadline
        tm = Timings()
        tm.auth = time.perf_counter_ns() - t0
        return Call(served, self.partition(tenant), deadline, t0, tm)

    async def embed(self, call: Call, texts: Sequence[object]) -> EmbedOutcome:
        """Embed: the texts' vectors (the cache, the batcher, the backend) for an admitted `call`."""
        out = await call.served.pipeline.run(texts, call.deadline, call.timings, call.partition)
        return self._embedded(call, out)

    @staticmethod
    def _embedded(call: Call, out: Embedded) -> EmbedOutcome:
        tm = call.timings
        tm.total = time.perf_counter_ns() - call.t0
        timings = tm.as_dict()
        call.served.metrics.observe_timings("embed", timings)
        return EmbedOutcome(out.embeddings, out.cache_hits, out.truncated, out.tokens, timings, out.backend,
                            call.served.version_id)

    async def search(self, call: Call, texts: Sequence[object], *, k: int = 10,
                     filters: Mapping[str, str] | None = None,
                     mode: SearchMode | str = SearchMode.SEMANTIC) -> SearchOutcome:
        """Search for an admitted `call`; `filters`: field -> value (catalog/filters.py)."""
        tm, served = call.timings, call.served  # its pipeline and its index, whatever a rollout does meanwhile
        mode = parse_mode(mode)
        k = k or 10
        if not 1 <= k <= self.max_k:
            raise InvalidInput(f"k must be between 1 and {self.max_k}, got {k}")
        holder = served.index
        index = holder.current()
        if index is None:
            # A configuration error is FAILED_PRECONDITION (retrying cannot help), UNAVAILABLE only
            # while the configured index may still appear (see IndexHolder.missing).
            raise holder.missing()
        if mode == SearchMode.LEXICAL:
            t1 = time.perf_counter_ns()
            clean = served.pipeline.validate(texts)  # the same texts are refused as by the other modes
            tm.cache = time.perf_counter_ns() - t1
            vectors, cache_hits, backend = None, [False] * len(clean), ""
        else:
            clean = served.pipeline.validate(texts)  # strings: the index decides what is embedded of them
            # The typed texts, or with complete_last_word their completed last words: embedded, and
            # cached, as the text actually embedded; the lexical leg below keeps the typed ones.
            if len(clean) <= TOKENIZE_ON_LOOP_MAX:  # ~5-60 µs a text: a big batch leaves the loop, as tokenizing does
                embedded = index.embedding_texts(clean, max_chars=served.pipeline.max_chars)
            else:
                embedded = await asyncio.to_thread(index.embedding_texts, clean, max_chars=served.pipeline.max_chars)
            emb = await served.pipeline.run(embedded, call.deadline, tm, call.partition)
            vectors, cache_hits, backend = emb.embeddings, emb.cache_hits, emb.backend
        t2 = time.perf_counter_ns()
        hits, ranking = await holder.query(index, clean, vectors, k, mode=mode, filters=filters or {})
        t3 = time.perf_counter_ns()
        tm.lexical = ranking.lexical_ns
        tm.search = t3 - t2 - ranking.lexical_ns  # the FAISS leg, fusion, the hits' fields and the thread hop
        tm.total = t3 - call.t0
        timings = tm.as_dict()
        served.metrics.observe_timings("search", timings)
        return SearchOutcome(hits, str(index.version), cache_hits, timings, backend, served.version_id)
