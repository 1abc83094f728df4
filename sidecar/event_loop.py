"""The sidecar's event loop: asyncio's selector loop, and a lock held whenever it is not asleep.

The compiled gRPC front (sidecar/native_front.py) answers a call on the gRPC thread that took it
when it can do so at once; that thread may touch the pipeline's state (cache, micro-batcher,
admission) only while the loop does not, i.e. while the loop waits in its selector. `idle_lock` is
held by the loop's thread from the moment its selector returns until it next waits in it, so
`idle_lock.acquire(blocking=False)` succeeds exactly while the loop is asleep, and the loop, woken
meanwhile, waits for the front's thread to finish before it runs anything.
"""

from __future__ import annotations

import asyncio
import selectors
import threading
from typing import Any


class _LockingSelector(selectors.DefaultSelector):
    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self._lock = lock
        self._held = False  # only the loop's thread calls select()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self._held:
            self._held = False
            self._lock.release()
        try:
            return super().select(timeout)
        finally:
            self._lock.acquire()
            self._held = True

    def close(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()
        super().close()


class SidecarLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.idle_lock = threading.Lock()
        super().__init__(_LockingSelector(self.idle_lock))


def new_event_loop() -> SidecarLoop:
    return SidecarLoop()


def idle_lock(loop: Any) -> threading.Lock | None:
    """The loop's idle lock, or None for a loop that is not a SidecarLoop (then nothing runs beside it)."""
    return loop.idle_lock if isinstance(loop, SidecarLoop) else None
