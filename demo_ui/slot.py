"""A latest-wins slot: holds at most one waiting item; putting a new one evicts the old.

Typing fast must never queue work: each connection has one of these between its reader and its
single search worker, so at most one search runs and at most one waits, and the waiting one is
always the newest keystroke.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class LatestSlot(Generic[T]):
    def __init__(self) -> None:
        self._item: T | None = None
        self._ready = asyncio.Event()

    def put(self, item: T) -> T | None:
        """Store `item`; return the item it replaced (now dropped), if any."""
        dropped, self._item = self._item, item
        self._ready.set()
        return dropped

    async def take(self) -> T:
        """Wait for an item and remove it from the slot."""
        while self._item is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        return item

    def __len__(self) -> int:
        return 0 if self._item is None else 1
