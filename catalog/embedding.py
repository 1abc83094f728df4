"""Throughput-mode embedding of a fixed list of texts, chunk by chunk, resumable.

Texts are sorted by token length so each backend call pads little, cut into fixed chunks (fixed
by the input, so a restarted job computes exactly the batches an uninterrupted run would have),
and each chunk is split into same-bucket calls by `inference.buckets.plan_calls` (the sidecar's
own bucket/split plan) with several calls in flight. Every finished chunk is checkpointed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
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
        n = len(texts)
        enc = self.tokenizer.encode(list(texts)) if n else None
        lengths = np.asarray(enc.lengths if enc else [], dtype=np.int64)
        # Sort by length (stable): neighbours share a bucket, so batches pad little.
        order = np.argsort(lengths, kind="stable")
        chunks = [order[s : s + self.chunk_items] for s in range(0, n, self.chunk_items)]
        done = checkpoints.resume(len(chunks))
        self.resumed_chunks = len(done)
        out = np.empty((n, self.backend.dim), dtype=np.float32)
        for k in done:
            out[chunks[k]] = checkpoints.read(k, (len(chunks[k]), self.backend.dim))
        bar = tqdm(total=n, initial=sum(len(chunks[k]) for k in done), unit="item", smoothing=0.1,
                   disable=not self.progress, desc="embedding", dynamic_ncols=True)
        t0 = time.perf_counter()
        try:
            for k, idx in enumerate(chunks):
                if k in done:
                    continue
                assert enc is not None
                emb = await self._embed_chunk([enc.ids[i] for i in idx], bar)
                self.embedded_items += len(idx)
                done.add(k)
                checkpoints.write(k, emb, done)
                out[idx] = emb
                if self.on_chunk is not None:
                    self.on_chunk(k)
        finally:
            bar.close()
            self.embed_seconds = time.perf_counter() - t0
        return out

    async def _embed_chunk(self, ids: list[list[int]], bar: tqdm[Any]) -> F32:
        out = np.empty((len(ids), self.backend.dim), dtype=np.float32)
        calls = plan_calls([len(x) for x in ids], self.tokenizer.buckets, self.batch_size)
        sem = asyncio.Semaphore(self.in_flight)

        async def one(bucket: int, pos: list[int]) -> None:
            async with sem:
                batch = self.tokenizer.batch([ids[i] for i in pos], length=bucket)
                emb = await self.backend.embed(batch)
            out[pos] = emb
            bar.update(len(pos))

        await asyncio.gather(*(one(b, p) for b, p in calls))
        return out
