"""What a caller of the sidecar gets back: the client's result types, and the demo page's.

Only numpy here: embedcar_client/client.py (and so every search node) imports this, never the
server's modules. The server builds its own replies (sidecar/service.py, catalog/index.py Hit) and turns
them into protobuf; the client turns the protobuf into these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Embeddings = npt.NDArray[np.float32]  # [n, dim], as inference.backends.base.Embeddings


@dataclass(frozen=True, slots=True)
class EmbedResult:
    embeddings: Embeddings  # [n, dim] float32
    model: str
    cache_hits: list[bool]
    truncated: list[bool]
    timings_ns: dict[str, int]
    backend: str = ""  # which backend computed the misses ("" = all from the cache)


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One product found: its id, score, the fields the index stores (title, aisle, department…)."""

    id: str
    score: float
    fields: dict[str, str]
    legs: tuple[str, ...] = ()  # the search leg(s) that found it: "semantic", "lexical"
    matched: tuple[str, ...] = ()  # the attributes typed in the query that it carries ("dairy free")


@dataclass(frozen=True, slots=True)
class SearchResult:
    hits: list[list[SearchHit]]  # one list per query text, best first
    model: str
    index_version: str
    cache_hits: list[bool]
    timings_ns: dict[str, int]
    backend: str = ""
