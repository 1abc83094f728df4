"""Query-like texts from a catalog: fragments of product titles, embedded like real queries.

Used to tune approximate indexes at build time and as weak-label known-item queries. Synthetic
vectors (noisy copies or midpoints of stored vectors) measured easier for IVF than embedded text
queries on the grocery catalog, so they picked an nprobe that real queries miss with.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from inference.backends.base import Backend
from inference.embedder import Embedder
from inference.tokenizer import QueryTokenizer

CALIBRATION_QUERIES = 512


def fragment(title: str, rng: random.Random) -> str | None:
    """A contiguous ~60% of the title's words (at least 2, never all); None for short titles."""
    words = title.split()
    if len(words) < 3:
        return None
    span = min(len(words) - 1, max(2, math.ceil(0.6 * len(words))))
    start = rng.randrange(0, len(words) - span + 1)
    return " ".join(words[start : start + span])


async def calibration_queries(texts: Sequence[str], tokenizer: QueryTokenizer, backend: Backend,
                              batch_size: int, *, n: int = CALIBRATION_QUERIES,
                              seed: int = 0) -> npt.NDArray[np.float32]:
    """Embedded fragments of `n` random texts (whole text where too short to cut)."""
    rng = random.Random(seed)
    pick = rng.sample(range(len(texts)), min(n, len(texts)))
    queries = [fragment(texts[i], rng) or texts[i] for i in pick]
    embedder = Embedder(tokenizer, backend, max_batch=len(queries))
    return (await embedder.embed(queries, check=False, backend_batch=batch_size)).embeddings
