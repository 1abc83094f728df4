"""Hot-query cache (LRU + TTL, keyed by model version + normalised text) and single-flight.

Typeahead traffic repeats the same prefixes from many shoppers at once: a hit never touches the
tokenizer or the backend, and concurrent misses for one key share one inference.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from cachetools import TTLCache


@dataclass(frozen=True, slots=True)
class Entry:
    vector: npt.NDArray[np.float32]  # [dim], read-only
    truncated: bool
    tokens: int


class EmbeddingCache:
    def __init__(self, version_id: str, entries: int, ttl_s: float) -> None:
        self.version_id = version_id
        self.enabled = entries > 0
        self._cache: TTLCache[str, Entry] = TTLCache(maxsize=max(entries, 1), ttl=ttl_s)
        self._inflight: dict[str, asyncio.Future[Entry]] = {}

    def key(self, normalised: str) -> str:
        return f"{self.version_id}\0{normalised}"

    def get(self, key: str) -> Entry | None:
        return self._cache.get(key) if self.enabled else None

    def put(self, key: str, entry: Entry) -> None:
        if self.enabled:
            entry.vector.flags.writeable = False
            self._cache[key] = entry

    def __len__(self) -> int:
        return len(self._cache)

    # --- single-flight ---------------------------------------------------------------------
    def joinable(self, key: str) -> asyncio.Future[Entry] | None:
        """The in-flight computation of `key`, if another request started one."""
        return self._inflight.get(key)

    def lead(self, key: str) -> asyncio.Future[Entry]:
        """Register this request as the one computing `key`; others join its future."""
        fut: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        return fut

    def finish(self, key: str, fut: asyncio.Future[Entry], entry: Entry | None,
               error: BaseException | None = None) -> None:
        if self._inflight.get(key) is fut:
            del self._inflight[key]
        if fut.done():
            return
        if entry is not None:
            self.put(key, entry)
            fut.set_result(entry)
        else:
            fut.set_exception(error or RuntimeError("single-flight leader gave no result"))
            fut.exception()  # mark retrieved: joiners may all have gone away
