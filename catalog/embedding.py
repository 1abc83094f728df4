"""Throughput-mode embedding of a fixed list of texts, chunk by chunk, resumable.

Texts are sorted by token length so each backend call pads little, cut into fixed chunks (fixed
by the input, so a restarted job computes exactly the batches an uninterrupted run would have),
and each chunk is split into same-bucket calls by `inference.buckets.plan_calls` (the sidecar's
own bucket/split plan) with several calls in flight. Every finished chunk is checkpointed.

`plan_chunks` and `embed_chunk` are the whole numeric recipe: the Ray engine (catalog/ray_engine.py)
runs the same two on its actors, so both engines send the backend identical padded batches and
write identical chunk files.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from catalog.checkpoints import Checkpoints
from inference.backends.base import Backend
from inference.buckets import plan_calls
from inference.errors import InvalidInput
from inference.tokenizer import QueryTokenizer

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Each text's token ids and the fixed chunks they are embedded in (item indices per chunk)."""

    ids: list[list[int]]
    chunks: list[I64]

    def chunk_ids(self, k: int) -> list[list[int]]:
        return [self.ids[i] for i in self.chunks[k]]


def plan_chunks(tokenizer: QueryTokenizer, texts: Sequence[str], chunk_items: int) -> ChunkPlan:
    """Tokenize `texts` and cut them, sorted by token length, into chunks of `chunk_items`."""
    if chunk_items < 1:
        raise InvalidInput("chunk_items must be positive")
    n = len(texts)
    ids = tokenizer.encode(list(texts)).ids if n else []
    # Sort by length (stable): neighbours share a bucket, so batches pad little.
    order = np.argsort(np.asarray([len(x) for x in ids], dtype=np.int64), kind="stable")
    return ChunkPlan(ids, [order[s : s + chunk_items] for s in range(0, n, chunk_items)])


# Above this size the job's output array is a memory-mapped scratch file beside the checkpoints
# instead of memory (10M x 384 fp32 is 15 GB): publishing copies and indexes it in slices.
IN_MEMORY_MAX_BYTES = 1 << 30


def resume_into(plan: ChunkPlan, checkpoints: Checkpoints, dim: int) -> tuple[F32, set[int]]:
    """The output array with the chunks `checkpoints` already hold filled in, and those chunks."""
    done = checkpoints.resume(len(plan.chunks))
    shape = (len(plan.ids), dim)
    out = (np.empty(shape, dtype=np.float32) if shape[0] * dim * 4 <= IN_MEMORY_MAX_BYTES
           else checkpoints.scratch(shape))
    for k in done:
        out[plan.chunks[k]] = checkpoints.read(k, (len(plan.chunks[k]), dim))
    return out, done


def progress_bar(plan: ChunkPlan, done: set[int], *, enabled: bool, desc: str) -> tqdm[Any]:
    """The job's item-counting bar, starting at the items of the chunks already done."""
    return tqdm(total=len(plan.ids), initial=sum(len(plan.chunks[k]) for k in done), unit="item", smoothing=0.1,
                disable=not enabled, desc=desc, dynamic_ncols=True)


def keep_chunk(plan: ChunkPlan, k: int, emb: F32, out: F32, done: set[int], checkpoints: Checkpoints) -> int:
    """A finished chunk into its checkpoint file and the output array (one way for every engine, so
    either resumes the other's checkpoints); returns its item count."""
    idx = plan.chunks[k]
    done.add(k)
    checkpoints.write(k, emb, done)
    out[idx] = emb
    return len(idx)


async def embed_chunk(tokenizer: QueryTokenizer, backend: Backend, ids: Sequence[Sequence[int]], *,
                      batch_size: int, in_flight: int, on_call: Callable[[int], object] | None = None) -> F32:
    """One chunk's vectors: `plan_calls` over its lengths, each call padded to its bucket, `in_flight`
    calls at a time; `on_call(n)` after each call of n texts."""
    out = np.empty((len(ids), backend.dim), dtype=np.float32)
    calls = plan_calls([len(x) for x in ids], tokenizer.buckets, batch_size)
    sem = asyncio.Semaphore(in_flight)

    async def one(bucket: int, pos: list[int]) -> None:
        async with sem:
            batch = tokenizer.batch([ids[i] for i in pos], length=bucket)
            emb = await backend.embed(batch)
        out[pos] = emb
        if on_call is not None:
            on_call(len(pos))

    await asyncio.gather(*(one(b, p) for b, p in calls))
    return out


class ChunkedEmbedder:
    """Embeds texts chunk by chunk into `Checkpoints`, skipping the chunks they already hold."""

    def __init__(self, tokenizer: QueryTokenizer, backend: Backend, *, batch_size: int, in_flight: int,
                 chunk_items: int, progress: bool = True, on_chunk: Callable[[int], None] | None = None) -> None:
        if batch_size < 1 or in_flight < 1 or chunk_items < 1:
            raise InvalidInput("batch_size, in_flight and chunk_items must be positive")
        self.tokenizer = tokenizer
        self.backend = backend
        self.batch_size = min(batch_size, backend.max_batch)
        self.in_flight = in_flight
        self.chunk_items = chunk_items
        self.progress = progress
        self.on_chunk = on_chunk
        self.resumed_chunks = 0
        self.embedded_items = 0  # this run only: resumed chunks cost no time, so they don't count
        self.embed_seconds = 0.0

    async def run(self, texts: Sequence[str], checkpoints: Checkpoints) -> F32:
        plan = plan_chunks(self.tokenizer, texts, self.chunk_items)
        out, done = resume_into(plan, checkpoints, self.backend.dim)
        self.resumed_chunks = len(done)
        bar = progress_bar(plan, done, enabled=self.progress, desc="embedding")
        t0 = time.perf_counter()
        try:
            for k in range(len(plan.chunks)):
                if k in done:
                    continue
                emb = await embed_chunk(self.tokenizer, self.backend, plan.chunk_ids(k), batch_size=self.batch_size,
                                        in_flight=self.in_flight, on_call=bar.update)
                self.embedded_items += keep_chunk(plan, k, emb, out, done, checkpoints)
                if self.on_chunk is not None:
                    self.on_chunk(k)
        finally:
            bar.close()
            self.embed_seconds = time.perf_counter() - t0
        return out
