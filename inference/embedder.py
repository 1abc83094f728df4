"""Texts -> embeddings over any backend: validate, tokenize, group by bucket, one call per bucket."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inference.backends.base import Backend, Embeddings
from inference.buckets import plan_calls
from inference.manifest import Manifest
from inference.text import check_texts
from inference.tokenizer import QueryTokenizer


def load_tokenizer(model_dir: Path, manifest: Manifest, *, max_text_chars: int = 20_000,
                   role: str = "query") -> QueryTokenizer:
    """The tokenizer for texts of `role`: "query" (the sidecar, `embedcar embed`) or "document"
    (the catalog job): each gets the model's own prompt for that role, if it has one."""
    return QueryTokenizer(
        model_dir / "tokenizer.json",
        max_length=manifest.max_length,
        buckets=manifest.buckets,
        pad_id=manifest.pad_id,
        with_token_type_ids=manifest.has_token_type_ids,
        max_text_chars=max_text_chars,
        prompt=manifest.prompt(role),
        pool_skip=manifest.pool_skip(role),
    )


@dataclass(slots=True)
class EmbedderOutput:
    """`Embedder.embed`'s answer, computed in this process (the sidecar's reply is
    embedcar_client.results.EmbedResult)."""

    embeddings: Embeddings
    truncated: list[bool]
    token_counts: list[int]
    timings_ns: dict[str, int] = field(default_factory=dict)


class Embedder:
    def __init__(self, tokenizer: QueryTokenizer, backend: Backend, *, max_batch: int = 256) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self.max_batch = max_batch

    async def embed(self, texts: Sequence[object], *, check: bool = True,
                    backend_batch: int | None = None) -> EmbedderOutput:
        """Embed `texts` in input order. `check=False` skips the per-call batch cap (batch jobs)."""
        t0 = time.perf_counter_ns()
        clean = check_texts(texts, max_batch=self.max_batch if check else max(len(texts), 1))
        enc = self.tokenizer.encode(clean)
        t1 = time.perf_counter_ns()
        out = np.empty((len(clean), self.backend.dim), dtype=np.float32)
        per_call = backend_batch or self.backend.max_batch
        calls = [(chunk, self.tokenizer.batch([enc.ids[i] for i in chunk], length=bucket))
                 for bucket, chunk in plan_calls(enc.lengths, self.tokenizer.buckets, per_call)]
        results = await asyncio.gather(*(self.backend.embed(b) for _, b in calls))
        for (chunk, _b), emb in zip(calls, results, strict=True):
            out[chunk] = emb
        t2 = time.perf_counter_ns()
        return EmbedderOutput(out, enc.truncated, enc.lengths,
                           {"tokenize": t1 - t0, "inference": t2 - t1, "total": t2 - t0})
