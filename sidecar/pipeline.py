"""The embedding path of one request, stage by stage (`EmbedPipeline.run` reads as the list):

    validate -> normalise -> cache / single-flight -> encode -> bucket/split -> admit -> schedule
    (micro-batcher or Triton, fallback while it is down) -> backend -> assemble

Each stage is a small method with its own timing (sidecar.timings.Timings). Auth, rate limits and
the index live in sidecar.service; the gRPC and HTTP layers only convert types.

`EmbedPipeline.run_now` is the same stages for one text that needs no waiting, run on the calling
thread: the compiled gRPC front's, while the event loop sleeps (sidecar.native_front).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from inference.backends.base import Embeddings
from inference.buckets import plan_calls
from inference.errors import DeadlineExceeded, EmbedcarError, InvalidInput, Overloaded, Unavailable
from inference.text import NFKC_MAX_GROWTH, check_texts, normalize, normalize_texts
from inference.tokenizer import Encoded, QueryTokenizer
from sidecar.admission import Admission
from sidecar.cache import EmbeddingCache, Entry
from sidecar.metrics import ModelMetrics
from sidecar.scheduler import Computed, NotNow, Scheduler
from sidecar.timings import Timings

# Tokenizing one short query takes ~16 µs, less than a thread hop: only big batches leave the loop,
# or long texts (~0.2-0.8 µs a character: 4k characters, up to ~3 ms).
TOKENIZE_ON_LOOP_MAX = 16
TOKENIZE_ON_LOOP_CHARS = 4096
# Characters normalisation may write on the loop (~0.1 µs each: ~1.5 ms at most): past it, a request's
# texts are normalised on a worker thread. NFKC may write 18 for one read, so a request is weighed
# by what it may write; one short query, the usual request, is weighed by one multiplication.
NORMALIZE_ON_LOOP_CHARS = 16_384


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


class EmbedPipeline:
    def __init__(self, *, tokenizer: QueryTokenizer, lowercase: bool, cache: EmbeddingCache, admission: Admission,
                 scheduler: Scheduler, metrics: ModelMetrics, dim: int, max_batch: int, max_chars: int,
                 max_items_per_call: int, max_request_chars: int = 1 << 62) -> None:
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
        found = self.lookup(normalised, partition)
        tm.cache = time.perf_counter_ns() - t0
        backend = ""
        if found.led:
            backend = await self.compute(found, deadline, tm)
        if found.joined:
            await self.join(found, deadline)
        out = self.assemble(found, len(clean))
        out.backend = backend
        return out

    def run_now(self, texts: Sequence[object], deadline: float, tm: Timings,
                partition: str | None = None) -> Embedded | None:
        """`run` on the calling thread for one text that needs no waiting: a cache hit, or a miss no
        other request is computing while the scheduler can run it at once (Scheduler.can_run_now: the
        idle micro-batcher, or a Triton call this thread waits for while the loop runs meanwhile).
        None, with nothing counted, for anything else: the caller then awaits `run` on the loop.
        Only while the loop cannot run (sidecar.event_loop): the cache, batcher and admission are its."""
        if len(texts) != 1:
            return None
        t0 = time.perf_counter_ns()
        (text,) = self.validate(texts)
        if len(text) > self.one_text_on_loop:
            return None  # the loop is stopped while this runs: `run` normalises it on a worker thread
        norm = normalize(text, lowercase=self.lowercase, limit=self.read_chars)
        if len(norm) > self.max_request_chars:
            return None  # `run` refuses it
        key = self.cache.key(norm, partition)
        hit = self.cache.get(key)
        if hit is None and partition is not None:
            hit = self.cache.get(self.cache.key(norm))
        if hit is None and (self.cache.joinable(key) is not None or not self.scheduler.can_run_now()):
            return None
        out = np.empty((1, self.dim), dtype=np.float32)
        if hit is not None:
            self.metrics.cache_hits.inc()
            tm.cache = time.perf_counter_ns() - t0
            out[0] = hit.vector
            return Embedded(out, [True], [hit.truncated], [hit.tokens])
        t1 = time.perf_counter_ns()
        tm.cache = t1 - t0
        try:
            enc = self.tokenizer.encode([norm])
            ((bucket, _chunk),) = plan_calls(enc.lengths, self.tokenizer.buckets, self.max_items_per_call)
            ticket = self.admission.admit(1, bucket, deadline)
            tm.tokenize = time.perf_counter_ns() - t1
            try:
                computed = self.scheduler.run_now(bucket, [enc.ids[0]], deadline)
            finally:
                self.admission.release(ticket)
        except NotNow:
            return None  # counted by `run` on the loop
        except BaseException as exc:
            self.metrics.cache_misses.inc()
            self._record_error(exc)
            raise
        self.metrics.cache_misses.inc()
        entry = Entry(computed.embeddings[0], enc.truncated[0], len(enc.ids[0]))
        self.cache.put(key, entry)
        self.metrics.cache_entries.set(len(self.cache))
        tm.inference = computed.inference_ns
        self.metrics.answered(computed.backend)
        out[0] = entry.vector
        return Embedded(out, [False], [entry.truncated], [entry.tokens], computed.backend)

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

    def lookup(self, normalised: list[str], partition: str | None = None) -> Lookup:
        """Cache hits; each distinct miss is joined to another request's computation or led by this one.
        A partition's lookup also finds the shared entries (the operator's warm queries): only
        requests of no partition write those."""
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
        for key in out.rows:
            fut = cache.joinable(key)
            if fut is not None:
                out.joined[key] = fut
            else:
                out.led[key] = cache.lead(key)
        if out.hits:
            self.metrics.cache_hits.inc(len(out.hits))
        if out.rows:
            self.metrics.cache_misses.inc(len(normalised) - len(out.hits))
        if out.joined:
            self.metrics.singleflight_joins.inc(len(out.joined))
        return out

    async def compute(self, found: Lookup, deadline: float, tm: Timings) -> str:
        """Encode, bucket/split, admit and schedule the misses this request leads; settle their futures.
        Returns the name(s) of the backend that answered."""
        led = list(found.led.items())
        try:
            t0 = time.perf_counter_ns()
            enc = await self.encode([found.texts[k] for k, _f in led])
            calls = plan_calls(enc.lengths, self.tokenizer.buckets, self.max_items_per_call)
            ticket = self.admission.admit(len(led), sum(b * len(c) for b, c in calls), deadline)
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
        for (_bucket, chunk), r in zip(calls, results, strict=True):
            for row, i in enumerate(chunk):
                key, fut = led[i]
                self.cache.finish(key, fut, Entry(r.embeddings[row], enc.truncated[i], len(enc.ids[i])))
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
        for fut in found.joined.values():
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(asyncio.shield(fut), left)
            except TimeoutError as exc:
                raise DeadlineExceeded("deadline expired waiting for a shared inference") from exc

    def assemble(self, found: Lookup, n: int) -> Embedded:
        out = np.empty((n, self.dim), dtype=np.float32)
        hits, truncated, tokens = [False] * n, [False] * n, [0] * n
        for i, e in found.hits.items():
            out[i], hits[i], truncated[i], tokens[i] = e.vector, True, e.truncated, e.tokens
        for key, idx in found.rows.items():
            # The future itself, not the cache: the cache may be off or have evicted the entry already.
            fut = found.led.get(key) or found.joined[key]
            e = fut.result()
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
