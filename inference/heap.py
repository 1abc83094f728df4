"""Keep Python's garbage collector out of request latency.

A full collection traverses every tracked object and holds the GIL throughout: in a sidecar that
has loaded gRPC, FastAPI, FAISS and its index (~150k objects) each one paused every request for
33-101 ms on this project's 2-core machines, a few times a minute under load (docs/benchmarks.md, GC pauses).

- A long-running server calls `settle()` once it has loaded what it keeps for good (and again
  after swapping in a new index): what exists then moves to the permanent generation, which no
  collection scans, so later full collections see only what was created since.
- A bounded measurement (the load generator's run) wraps itself in `no_full_collections()`, so
  the tool that measures others' pauses adds none of its own; young collections still run.
- `watch_pauses()` reports each collection's pause (the sidecar's `embedcar_gc_pause_seconds`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Full collections happen after this many young-generation-1 collections (and CPython's own 25 %
# growth rule): large enough never to be reached within a run.
_NEVER = 2**30


def settle() -> int:
    """Collect what is garbage now, then freeze the rest out of future collections.

    Objects frozen and freed later by reference counting are released as usual; only reference
    cycles among them would stay (the index a reload replaces has none: see tests/test_heap.py).
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def no_full_collections() -> Iterator[None]:
    """Within: the heap as it was is frozen and no full collection runs; afterwards both undone."""
    young, middle, old = gc.get_threshold()
    settle()
    gc.set_threshold(young, middle, _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, old)
        gc.unfreeze()


def watch_pauses(observe: Callable[[int, float], None]) -> Callable[[], None]:
    """Call `observe(generation, seconds)` after every collection; returns what stops it."""
    started = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            observe(int(info["generation"]), time.perf_counter() - started[0])

    gc.callbacks.append(callback)
    return lambda: gc.callbacks.remove(callback)
