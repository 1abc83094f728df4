"""Hot-query cache (LRU + TTL, keyed by model version + normalised text) and single-flight.

Typeahead traffic repeats the same prefixes from many shoppers at once: a hit never touches the
tokenizer or the backend, and concurrent misses for one key share one inference.

Entries are stored as plain tuples of untracked values (an array, a bool, ints, a float) in an
LRU cache whose order lives in a C `OrderedDict`: the garbage collector then has nothing to
traverse per entry. Stored as objects in cachetools' TTLCache (a tracked link per key), a full
cache of 100k entries made every full collection pause the whole sidecar for ~40-50 ms
(docs/benchmarks.md, GC pauses). The TTL is checked on read instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from cachetools import LRUCache


@dataclass(frozen=True, slots=True)
class Entry:
    vector: npt.NDArray[np.float32]  # [dim], read-only
    truncated: bool
    tokens: int


# What the cache holds per key: (expires at, vector, truncated, tokens). An exact tuple of
# untracked values, which the collector stops tracking after its first look.
_Stored = tuple[float, npt.NDArray[np.float32], bool, int]


class EmbeddingCache:
    def __init__(self, version_id: str, entries: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.version_id = version_id
        self.enabled = entries > 0
        self.ttl_s = ttl_s
        self._clock = clock
        self._cache: LRUCache[str, _Stored] = LRUCache(maxsize=max(entries, 1))
        self._inflight: dict[str, asyncio.Future[Entry]] = {}

    def key(self, normalised: str) -> str:
        return f"{self.version_id}\0{normalised}"

    def get(self, key: str) -> Entry | None:
        if not self.enabled:
            return None
        stored = self._cache.get(key)
        if stored is None:
            return None
        expires, vector, truncated, tokens = stored
        if expires <= self._clock():
            del self._cache[key]
            return None
        return Entry(vector, truncated, tokens)

    def put(self, key: str, entry: Entry) -> None:
        if self.enabled:
            entry.vector.flags.writeable = False
            self._cache[key] = (self._clock() + self.ttl_s, entry.vector, bool(entry.truncated), int(entry.tokens))

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
