"""Hot-query cache (LRU + TTL, keyed by a digest of model version + normalised text) and single-flight.

Typeahead traffic repeats the same prefixes from many shoppers at once: a hit never touches the
tokenizer or the backend, and concurrent misses for one key share one inference.

Entries are stored as plain tuples of untracked values (an array, a bool, ints, a float) in an
LRU cache whose order lives in a C `OrderedDict`: the garbage collector then has nothing to
traverse per entry. Stored as objects in cachetools' TTLCache (a tracked link per key), a full
cache of 100k entries made every full collection pause the whole sidecar for ~40-50 ms
(docs/benchmarks.md, GC pauses). The TTL is checked on read instead.

A key is a 16-byte BLAKE2b digest, never the text: a text may normalise to ~20k characters, and
the cache is capped in bytes (each entry's vector, key and bookkeeping), besides its entry count.
A key may name a partition (a tenant, sidecar.service): texts embedded in one are hits, and
single-flight joins, only within it, so neither a reply's cache flag nor its latency tells one
tenant what another asked.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt


class Entry(NamedTuple):  # a tuple: made on every hit, in half a frozen dataclass's time
    vector: npt.NDArray[np.float32]  # [dim], read-only
    truncated: bool
    tokens: int


# What the cache holds per key: (expires at, vector, truncated, tokens). An exact tuple of
# untracked values, which the collector stops tracking after its first look.
_Stored = tuple[float, npt.NDArray[np.float32], bool, int]

KEY_BYTES = 16
# What one entry costs besides its vector's data and its key's 16 bytes: the stored tuple and its float,
# the array's header, the key object and its slots in the LRU's dict and order (~410 bytes measured
# with tracemalloc over 10k entries; rounded up for the dict's growth steps).
ENTRY_OVERHEAD = 500


def _field(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return len(raw).to_bytes(4, "little") + raw


def _size(stored: _Stored) -> int:
    return stored[1].nbytes + KEY_BYTES + ENTRY_OVERHEAD


class EmbeddingCache:
    """LRU in a C OrderedDict (a hit: one lookup and a move to the end), capped by entries and bytes."""

    def __init__(self, version_id: str, entries: int, ttl_s: float, max_bytes: int = 1 << 62,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.version_id = version_id
        self.enabled = entries > 0 and max_bytes > 0
        self.ttl_s = ttl_s
        self.max_entries = entries
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the entries count against max_bytes
        self._clock = clock
        self._lru: OrderedDict[bytes, _Stored] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future[Entry]] = {}
        self._bases: dict[str | None, hashlib.blake2b] = {}

    def key(self, normalised: str, partition: str | None = None) -> bytes:
        """The digest of (model version, partition, normalised text); partition None = shared."""
        base = self._bases.get(partition)
        if base is None:
            base = self._bases[partition] = hashlib.blake2b(
                _field(self.version_id) + (b"\0" if partition is None else b"\1" + _field(partition)),
                digest_size=KEY_BYTES)
        h = base.copy()
        h.update(normalised.encode())
        return h.digest()

    def get(self, key: bytes) -> Entry | None:
        stored = self._lru.get(key)  # a disabled cache is empty
        if stored is None:
            return None
        expires, vector, truncated, tokens = stored
        if expires <= self._clock():
            del self._lru[key]
            self.nbytes -= _size(stored)
            return None
        self._lru.move_to_end(key)
        return Entry(vector, truncated, tokens)

    def put(self, key: bytes, entry: Entry) -> None:
        if not self.enabled:
            return
        vector = entry.vector
        if vector.base is not None:  # a row of its batch: the cache must not keep the whole batch alive
            vector = vector.copy()
        vector.flags.writeable = False
        stored = (self._clock() + self.ttl_s, vector, bool(entry.truncated), int(entry.tokens))
        size = _size(stored)
        lru = self._lru
        old = lru.pop(key, None)
        if old is not None:
            self.nbytes -= _size(old)
        if size > self.max_bytes:
            return
        while lru and (len(lru) >= self.max_entries or self.nbytes + size > self.max_bytes):
            self.nbytes -= _size(lru.popitem(last=False)[1])
        lru[key] = stored
        self.nbytes += size

    def __len__(self) -> int:
        return len(self._lru)

    # --- single-flight ---------------------------------------------------------------------
    def joinable(self, key: bytes) -> asyncio.Future[Entry] | None:
        """The in-flight computation of `key`, if another request started one."""
        return self._inflight.get(key)

    def lead(self, key: bytes) -> asyncio.Future[Entry]:
        """Register this request as the one computing `key`; others join its future."""
        fut: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        return fut

    def finish(self, key: bytes, fut: asyncio.Future[Entry], entry: Entry | None,
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
