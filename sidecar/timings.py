"""Per-stage timings of one request, in ns: the one list of stages for the pipeline, the metrics,
the client and the proto's `Timings` message (a test holds them equal)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class Timings:
    auth: int = 0  # API key + rate limit
    cache: int = 0  # validate, normalise, cache lookup, single-flight
    tokenize: int = 0  # encode + bucket/split + admission
    queue: int = 0  # waiting for the scheduler (micro-batcher queue)
    inference: int = 0  # the backend call(s), padding and pooling included
    search: int = 0  # Search: the FAISS leg, fusion and fetching the hits' fields
    lexical: int = 0  # Search: the lexical (tantivy) leg
    total: int = 0

    def as_dict(self) -> dict[str, int]:
        return {s: getattr(self, s) for s in STAGES}


STAGES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Timings))
