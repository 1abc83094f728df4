"""The embedding path of one request, stage by stage (`EmbedPipeline.run` reads as the list):

    validate -> normalise -> cache / single-flight -> encode -> bucket/split -> admit -> schedule
    (micro-batcher or Triton, fallback while it is down) -> backend -> assemble

Each stage is a small method with its own timing (sidecar.timings.Timings). Auth, rate limits and
the index live in sidecar.service; the gRPC and HTTP layers only convert types.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from inference.backends.base import Embeddings
from inference.buckets import plan_calls
from inference.errors import DeadlineExceeded, EmbedcarError, InvalidInput, Overloaded, Unavailable
from inference.text import NFKC_MAX_GROWTH, check_texts, normalize, normalize_texts
from inference.tokenizer import Encoded, QueryTokenizer
from sidecar.admission import Admission, Ticket
from sidecar.cache import EmbeddingCache, Entry
from sidecar.metrics import ModelMetrics
from sidecar.scheduler import Computed, Scheduler
from sidecar.timings import Timings

# Tokenizing one short query takes ~16 µs, less than a thread hop: only big batches leave the loop,
# or long texts (~0.2-0.8 µs a character: 4k characters, up to ~3 ms).
TOKENIZE_ON_LOOP_MAX = 16
TOKENIZE_ON_LOOP_CHARS = 4096
# Characters normalisation may write on the loop (~0.1 µs each: ~1.5 ms at most): past it, a request's
# texts are normalised on a worker thread. NFKC may write 18 for one read, so a request is weighed
# by what it may write; one short query, the usual request, is weighed by one multiplication.
NORMALIZE_ON_LOOP_CHARS = 16_384
# Most characters one request's texts may hold after NFKC (one character may become 18: U+FDFA), counted
# as they are normalised so the work stops there; more is INVALID_ARGUMENT (docs/reliability.md: a
# 3.9 MB request of U+FDFA took 14.8 s of the loop uncapped, 0.08 s capped).
MAX_REQUEST_CHARS = 250_000


@dataclass(slots=True)
class Embedded:
    """What the pipeline hands back: one row per input text, in input order."""

    embeddings: Embeddings  # [n, dim] float32
    cache_hits: list[bool]
    truncated: list[bool]
    tokens: list[int]
    backend: str = ""  # which backend computed the misses ("" = all from the cache)


@dataclass(slots=True)
class Lookup:
    """The cache stage's verdict per distinct normalised text."""

    hits: dict[int, Entry] = field(default_factory=dict)  # input index -> cached entry
    rows: dict[bytes, list[int]] = field(default_factory=dict)  # miss key -> input indices
    texts: dict[bytes, str] = field(default_factory=dict)  # miss key -> normalised text
    joined: dict[bytes, asyncio.Future[Entry]] = field(default_factory=dict)  # computed by another request
    led: dict[bytes, asyncio.Future[Entry]] = field(default_factory=dict)  # computed by this request
    entries: dict[bytes, Entry] = field(default_factory=dict)  # miss key -> its entry, once computed or joined


class EmbedPipeline:
    def __init__(self, *, tokenizer: QueryTokenizer, lowercase: bool, cache: EmbeddingCache, admission: Admission,
                 scheduler: Scheduler, metrics: ModelMetrics, dim: int, max_batch: int, max_chars: int,
                 max_items_per_call: int, max_request_chars: int = MAX_REQUEST_CHARS) -> None:
        self.tokenizer = tokenizer
        self.lowercase = lowercase
        self.cache = cache
        self.admission = admission
        self.scheduler = scheduler
        self.metrics = metrics
        self.dim = dim
        self.max_batch = max_batch
        self.max_chars = max_chars
        self.max_items_per_call = max(1, max_items_per_call)
        self.max_request_chars = max_request_chars
        self.read_chars = tokenizer.max_text_chars  # what the tokenizer reads of a normalised text
        self.one_text_on_loop = NORMALIZE_ON_LOOP_CHARS // NFKC_MAX_GROWTH  # characters, whatever they are

    async def run(self, texts: Sequence[object], deadline: float, tm: Timings,
                  partition: str | None = None) -> Embedded:
        """`deadline` is on the time.monotonic() clock. `partition`: the cache's (EmbeddingCache.key):
        the tenant where tenants must not see each other's hits, None = shared."""
        t0 = time.perf_counter_ns()
        clean = self.validate(texts)
        if len(clean) == 1 and len(clean[0]) <= self.one_text_on_loop:  # the usual request
            normalised = self.normalise(clean)
        else:
            normalised = await self.normalise_big(clean)
        found = self.find(normalised, partition)
        self.claim(found, len(normalised))
        tm.cache = time.perf_counter_ns() - t0
        backend = ""
        if found.led:
            backend = await self.compute(found, deadline, tm)
        if found.joined:
            await self.join(found, deadline)
        out = self.assemble(found, len(clean))
        out.backend = backend
        return out

    # --- stages ------------------------------------------------------------------------------
    def validate(self, texts: Sequence[object]) -> list[str]:
        clean = check_texts(texts, max_batch=self.max_batch)
        for i, t in enumerate(clean):
            if len(t) > self.max_chars:
                raise InvalidInput(f"text {i} has {len(t)} characters, over the maximum of {self.max_chars}")
        return clean

    def normalise(self, clean: list[str]) -> list[str]:
        """Cache keys and tokenizer input: NFKC'd only as far as the tokenizer reads, the request's
        total capped (inference.text.normalize_texts)."""
        if len(clean) == 1:  # the usual request: one query, without normalize_texts' loop
            norm = normalize(clean[0], lowercase=self.lowercase, limit=self.read_chars)
            if len(norm) <= self.max_request_chars:
                return [norm]
        return normalize_texts(clean, lowercase=self.lowercase, limit=self.read_chars,
                               max_total=self.max_request_chars)

    async def normalise_big(self, clean: list[str]) -> list[str]:
        """`normalise` on a worker thread where it may write more than NORMALIZE_ON_LOOP_CHARS."""
        weight = 0
        for t in clean:
            weight += len(t) if t.isascii() else len(t) * NFKC_MAX_GROWTH
        if weight <= NORMALIZE_ON_LOOP_CHARS:
            return self.normalise(clean)
        return await asyncio.to_thread(self.normalise, clean)

    def find(self, normalised: list[str], partition: str | None = None) -> Lookup:
        """Cache hits, and each distinct miss's rows. A partition's lookup also finds the shared entries
        (the operator's warm queries): only requests of no partition write those."""
        out = Lookup()
        cache = self.cache
        for i, norm in enumerate(normalised):
            key = cache.key(norm, partition)
            e = cache.get(key)
            if e is None and partition is not None:
                e = cache.get(cache.key(norm))
            if e is not None:
                out.hits[i] = e
            elif key in out.rows:
                out.rows[key].append(i)
            else:
                out.rows[key] = [i]
                out.texts[key] = norm
        return out

    def claim(self, found: Lookup, n: int) -> None:
        """Single-flight: each distinct miss joined to another request's computation or led by this one."""
        cache = self.cache
        for key in found.rows:
            fut = cache.joinable(key)
            if fut is not None:
                found.joined[key] = fut
            else:
                found.led[key] = cache.lead(key)
        self.count(found, n)

    def count(self, found: Lookup, n: int) -> None:
        """The cache's metrics for a request of `n` texts."""
        if found.hits:
            self.metrics.cache_hits.inc(len(found.hits))
        if found.rows:
            self.metrics.cache_misses.inc(n - len(found.hits))
        if found.joined:
            self.metrics.singleflight_joins.inc(len(found.joined))

    async def compute(self, found: Lookup, deadline: float, tm: Timings) -> str:
        """Encode, bucket/split, admit and schedule the misses this request leads; settle their futures.
        Returns the name(s) of the backend that answered."""
        led = list(found.led.items())
        try:
            t0 = time.perf_counter_ns()
            enc = await self.encode([found.texts[k] for k, _f in led])
            calls, ticket = self.plan(enc, deadline)
            tm.tokenize = time.perf_counter_ns() - t0
            try:
                results = await self.schedule(calls, enc, deadline)
            finally:
                self.admission.release(ticket)
        except BaseException as exc:
            self._record_error(exc)
            # Joiners get the leader's error; a cancelled leader (caller gone) must not cancel them.
            shared = exc if isinstance(exc, EmbedcarError) else Unavailable(
                "the request computing this text was cancelled; retry")
            for key, fut in led:
                self.cache.finish(key, fut, None, shared)
            raise
        for key, entry in self.entries(list(found.led), calls, results, enc):
            found.entries[key] = entry
            self.cache.finish(key, found.led[key], entry)
        return self.answered(results, tm)

    def plan(self, enc: Encoded, deadline: float) -> tuple[list[tuple[int, list[int]]], Ticket]:
        """Bucket/split the encoded texts into backend calls, and admit them (release the ticket after)."""
        calls = plan_calls(enc.lengths, self.tokenizer.buckets, self.max_items_per_call)
        return calls, self.admission.admit(len(enc.ids), sum(b * len(c) for b, c in calls), deadline)

    @staticmethod
    def entries(keys: list[bytes], calls: list[tuple[int, list[int]]], results: list[Computed],
                enc: Encoded) -> Iterator[tuple[bytes, Entry]]:
        """Each computed text's cache entry, by its key (`keys[i]`: the i-th encoded text's)."""
        for (_bucket, chunk), r in zip(calls, results, strict=True):
            for row, i in enumerate(chunk):
                yield keys[i], Entry(r.embeddings[row], enc.truncated[i], len(enc.ids[i]))

    def answered(self, results: list[Computed], tm: Timings) -> str:
        """The computed misses' timings and metrics; the name(s) of the backend that answered."""
        self.metrics.cache_entries.set(len(self.cache))
        tm.queue = max(r.queue_ns for r in results)
        tm.inference = max(r.inference_ns for r in results)
        answered = sorted({r.backend for r in results})
        for name in answered:
            self.metrics.answered(name)
        return ",".join(answered)

    async def encode(self, texts: list[str]) -> Encoded:
        if len(texts) <= TOKENIZE_ON_LOOP_MAX and sum(map(len, texts)) <= TOKENIZE_ON_LOOP_CHARS:
            return self.tokenizer.encode(texts)
        return await asyncio.to_thread(self.tokenizer.encode, texts)

    async def schedule(self, calls: list[tuple[int, list[int]]], enc: Encoded, deadline: float) -> list[Computed]:
        run = self.scheduler.run
        if len(calls) == 1:  # the usual case: no task per call
            ((bucket, chunk),) = calls
            return [await run(bucket, [enc.ids[i] for i in chunk], deadline)]
        return list(await asyncio.gather(*(run(bucket, [enc.ids[i] for i in chunk], deadline)
                                           for bucket, chunk in calls)))

    async def join(self, found: Lookup, deadline: float) -> None:
        """Wait for the computations this request joined, within its own deadline."""
        for key, fut in found.joined.items():
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                found.entries[key] = await asyncio.wait_for(asyncio.shield(fut), left)
            except TimeoutError as exc:
                raise DeadlineExceeded("deadline expired waiting for a shared inference") from exc

    def assemble(self, found: Lookup, n: int) -> Embedded:
        out = np.empty((n, self.dim), dtype=np.float32)
        hits, truncated, tokens = [False] * n, [False] * n, [0] * n
        for i, e in found.hits.items():
            out[i], hits[i], truncated[i], tokens[i] = e.vector, True, e.truncated, e.tokens
        for key, idx in found.rows.items():
            # The request's own entry, not the cache's: the cache may be off or have evicted it already.
            e = found.entries[key]
            for i in idx:
                out[i], truncated[i], tokens[i] = e.vector, e.truncated, e.tokens
        return Embedded(out, hits, truncated, tokens)

    def _record_error(self, exc: BaseException) -> None:
        if not isinstance(exc, EmbedcarError):
            return
        if isinstance(exc, Overloaded):
            self.metrics.rejected_admission.inc()
        elif isinstance(exc, DeadlineExceeded):
            self.metrics.rejected_deadline.inc()
        else:
            self.metrics.backend_error(exc.code)
