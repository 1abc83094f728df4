"""The request pipeline, independent of gRPC and HTTP.

auth -> rate limit -> validate/normalise -> cache -> single-flight -> tokenize -> bucket ->
admission -> backend (micro-batcher or Triton) -> fill cache; every stage timed in ns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from inference.backends.base import Backend, Embeddings
from inference.buckets import group_by_bucket, split_batches
from inference.errors import (
    DeadlineExceeded,
    EmbedcarError,
    FailedPrecondition,
    InvalidInput,
    Overloaded,
    Unauthenticated,
    Unavailable,
)
from inference.settings import Settings
from inference.text import check_texts, normalize
from inference.tokenizer import QueryTokenizer
from sidecar.admission import Admission
from sidecar.auth import KeyRing
from sidecar.cache import EmbeddingCache, Entry
from sidecar.metrics import Metrics
from sidecar.ratelimit import RateLimiter

if TYPE_CHECKING:
    from catalog.index import Hit
    from sidecar.search_index import IndexHolder

# bucket, token ids, deadline -> (embeddings, queue ns, inference ns, backend that answered)
Runner = Callable[[int, list[list[int]], float | None], Awaitable[tuple[Embeddings, int, int, str]]]

# Tokenizing one short query takes ~16 µs, less than a thread hop: only big batches leave the loop.
TOKENIZE_ON_LOOP_MAX = 16


def _timings() -> dict[str, int]:
    return {"auth": 0, "cache": 0, "tokenize": 0, "queue": 0, "inference": 0, "search": 0, "total": 0}


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
    def __init__(self, settings: Settings, *, tokenizer: QueryTokenizer, backend: Backend, lowercase: bool,
                 keys: KeyRing, limiter: RateLimiter, cache: EmbeddingCache, admission: Admission,
                 metrics: Metrics, runner: Runner, index: IndexHolder | None = None,
                 fallback: Runner | None = None) -> None:
        s = settings.sidecar
        self.tokenizer = tokenizer
        self.backend = backend
        self.model = backend.version_id
        self.dim = backend.dim
        self.lowercase = lowercase
        self.keys = keys
        self.limiter = limiter
        self.cache = cache
        self.admission = admission
        self.metrics = metrics
        self.index = index
        self._run = runner
        self._fallback = fallback  # the embedded model, used while the backend is down
        self.max_batch = min(settings.model.max_batch, backend.max_batch if backend.max_batch > 0 else 256)
        self.max_chars = s.max_text_chars
        self.chunk = max(1, s.batch_max_items)
        self.default_deadline_s = s.default_deadline_ms / 1e3
        self.max_k = s.max_k
        self.backend_up = True  # cleared by an Unavailable backend error; restored by the health probe
        self.on_backend_down: Callable[[], None] | None = None

    # --- stages ----------------------------------------------------------------------------
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

    def _validate(self, texts: Sequence[object]) -> list[str]:
        clean = check_texts(texts, max_batch=self.max_batch)
        for i, t in enumerate(clean):
            if len(t) > self.max_chars:
                raise InvalidInput(f"text {i} has {len(t)} characters, over the maximum of {self.max_chars}")
        return clean

    def mark_backend(self, up: bool) -> None:
        was = self.backend_up
        self.backend_up = up
        self.metrics.backend_up.set(1 if up else 0)
        if was and not up and self.on_backend_down is not None:
            self.on_backend_down()

    # --- public ----------------------------------------------------------------------------
    async def embed(self, texts: Sequence[object], *, api_key: str | None = None, deadline: float | None = None,
                    authenticated: bool = False) -> EmbedOutcome:
        """`deadline` is on the time.monotonic() clock; None = the default deadline from settings."""
        t0 = time.perf_counter_ns()
        tm = _timings()
        if not authenticated:
            self.authenticate(api_key)
        t1 = time.perf_counter_ns()
        tm["auth"] = t1 - t0
        out = await self._embed(self._validate(texts), deadline, tm, t1)
        tm["total"] = time.perf_counter_ns() - t0
        return out

    async def search(self, texts: Sequence[object], *, k: int = 10, department: str | None = None,
                     aisle: str | None = None, api_key: str | None = None,
                     deadline: float | None = None) -> SearchOutcome:
        t0 = time.perf_counter_ns()
        tm = _timings()
        self.authenticate(api_key)
        t1 = time.perf_counter_ns()
        tm["auth"] = t1 - t0
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
        emb = await self._embed(self._validate(texts), deadline, tm, t1)
        t2 = time.perf_counter_ns()
        hits = await holder.search(index, emb.embeddings, k, department=department or None, aisle=aisle or None)
        t3 = time.perf_counter_ns()
        tm["search"] = t3 - t2
        tm["total"] = t3 - t0
        return SearchOutcome(hits, str(index.version), emb.cache_hits, tm, emb.backend)

    # --- the embedding path ------------------------------------------------------------------
    async def _embed(self, texts: list[str], deadline: float | None, tm: dict[str, int], t_start: int) -> EmbedOutcome:
        if deadline is None:
            deadline = time.monotonic() + self.default_deadline_s
        n = len(texts)
        out = np.empty((n, self.dim), dtype=np.float32)
        hits = [False] * n
        truncated = [False] * n
        tokens = [0] * n
        backend = ""
        cache = self.cache
        misses: dict[str, tuple[str, list[int]]] = {}
        for i, text in enumerate(texts):
            norm = normalize(text, lowercase=self.lowercase)
            key = cache.key(norm)
            e = cache.get(key)
            if e is not None:
                out[i] = e.vector
                hits[i] = True
                truncated[i] = e.truncated
                tokens[i] = e.tokens
            elif key in misses:
                misses[key][1].append(i)
            else:
                misses[key] = (norm, [i])
        n_hits = n - sum(len(v[1]) for v in misses.values())
        if n_hits:
            self.metrics.cache_hits.inc(n_hits)
        t_cache = time.perf_counter_ns()
        tm["cache"] = t_cache - t_start
        if misses:
            self.metrics.cache_misses.inc(n - n_hits)
            joined: list[tuple[str, asyncio.Future[Entry]]] = []
            led: list[tuple[str, str, asyncio.Future[Entry]]] = []
            for key, (norm, _idx) in misses.items():
                fut = cache.joinable(key)
                if fut is not None:
                    joined.append((key, fut))
                else:
                    led.append((key, norm, cache.lead(key)))
            if joined:
                self.metrics.singleflight_joins.inc(len(joined))
            if led:
                backend = await self._compute(led, deadline, tm)
            for _key, fut in joined:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded("deadline expired waiting for a shared inference")
                try:
                    await asyncio.wait_for(asyncio.shield(fut), left)
                except TimeoutError as exc:
                    raise DeadlineExceeded("deadline expired waiting for a shared inference") from exc
            for key, (_norm, idx) in misses.items():
                fut_result = cache.get(key)
                entry = fut_result if fut_result is not None else self._settled(key, joined, led)
                for i in idx:
                    out[i] = entry.vector
                    truncated[i] = entry.truncated
                    tokens[i] = entry.tokens
        return EmbedOutcome(out, hits, truncated, tokens, tm, backend)

    @staticmethod
    def _settled(key: str, joined: list[tuple[str, asyncio.Future[Entry]]],
                 led: list[tuple[str, str, asyncio.Future[Entry]]]) -> Entry:
        # The cache may be off (0 entries) or have evicted it already: read the future itself.
        for k, fut in joined:
            if k == key:
                return fut.result()
        for k, _n, fut in led:
            if k == key:
                return fut.result()
        raise KeyError(key)

    async def _compute(self, led: list[tuple[str, str, asyncio.Future[Entry]]], deadline: float,
                       tm: dict[str, int]) -> str:
        """Tokenize, bucket, admit and run the misses this request leads; settle their futures.

        Returns the name of the backend that answered."""
        try:
            if not self.backend_up and self._fallback is None:
                raise Unavailable(f"backend {self.backend.name} is down; waiting for it to come back")
            t0 = time.perf_counter_ns()
            texts = [norm for _k, norm, _f in led]
            if len(texts) <= TOKENIZE_ON_LOOP_MAX:
                enc = self.tokenizer.encode(texts)
            else:
                enc = await asyncio.to_thread(self.tokenizer.encode, texts)
            calls = [(bucket, chunk)
                     for bucket, idx in sorted(group_by_bucket(enc.lengths, self.tokenizer.buckets).items())
                     for chunk in split_batches(idx, self.chunk)]
            t1 = time.perf_counter_ns()
            tm["tokenize"] = t1 - t0
            ticket = self.admission.admit(len(texts), sum(b * len(c) for b, c in calls), deadline)
            try:
                if len(calls) == 1:  # the usual case: no task per call
                    ((bucket, chunk),) = calls
                    results = [await self._call(bucket, [enc.ids[i] for i in chunk], deadline)]
                else:
                    results = await asyncio.gather(
                        *(self._call(bucket, [enc.ids[i] for i in chunk], deadline) for bucket, chunk in calls))
            finally:
                self.admission.release(ticket)
        except BaseException as exc:
            self._record_error(exc)
            # Joiners get the leader's error; a cancelled leader (caller gone) must not cancel them.
            shared = exc if isinstance(exc, EmbedcarError) else Unavailable(
                "the request computing this text was cancelled; retry")
            for key, _n, fut in led:
                self.cache.finish(key, fut, None, shared)
            raise
        queue_ns = infer_ns = 0
        for (_bucket, chunk), (emb, q_ns, i_ns, _name) in zip(calls, results, strict=True):
            queue_ns = max(queue_ns, q_ns)
            infer_ns = max(infer_ns, i_ns)
            for row, i in enumerate(chunk):
                key, _n, fut = led[i]
                self.cache.finish(key, fut, Entry(emb[row], enc.truncated[i], len(enc.ids[i])))
        self.metrics.cache_entries.set(len(self.cache))
        tm["queue"] = queue_ns
        tm["inference"] = infer_ns
        answered = {r[3] for r in results}
        for name in answered:
            self.metrics.backend_answers.labels(name).inc()
        return ",".join(sorted(answered))

    async def _call(self, bucket: int, ids: list[list[int]], deadline: float) -> tuple[Embeddings, int, int, str]:
        """One bucket chunk on the backend, or on the embedded fallback while the backend is down."""
        if self.backend_up or self._fallback is None:
            try:
                return await self._run(bucket, ids, deadline)
            except Unavailable as exc:
                if self._fallback is None:
                    raise
                self._record_error(exc)  # marks the backend down: later calls go straight to the fallback
        return await self._fallback(bucket, ids, deadline)

    def _record_error(self, exc: BaseException) -> None:
        if not isinstance(exc, EmbedcarError):
            return
        if isinstance(exc, Overloaded):
            self.metrics.rejections.labels("admission").inc()
            return
        if isinstance(exc, DeadlineExceeded):
            self.metrics.rejections.labels("deadline").inc()
            return
        self.metrics.backend_errors.labels(exc.code).inc()
        if isinstance(exc, Unavailable) and self.backend_up:
            self.mark_backend(False)


def direct_runner(backend: Backend, tokenizer: QueryTokenizer, admission: Admission, metrics: Metrics) -> Runner:
    """For backends that batch themselves (Triton): one call per bucket chunk, deadline as timeout."""

    async def run(bucket: int, ids: list[list[int]], deadline: float | None) -> tuple[Embeddings, int, int, str]:
        timeout = None
        if deadline is not None:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceeded("deadline expired before inference")
        batch = tokenizer.batch(ids, length=bucket)
        t0 = time.perf_counter_ns()
        emb = await backend.embed(batch, timeout_s=timeout)
        dt = time.perf_counter_ns() - t0
        admission.observe(bucket * len(ids), dt * 1e-9)
        metrics.batch_size.observe(len(ids))
        return emb, 0, dt, backend.name

    return run
