"""The product index behind Search: opened lazily, hot-reloaded by polling, searched off the loop.

catalog.index (the reader only: building is catalog/index_build.py) is imported lazily: a sidecar
that only embeds does not need FAISS. Both legs of a hybrid search run in one worker call, one
after the other: the lexical leg costs ~0.1 ms, less than a second thread hop would, and both read
the same loaded version.

A version the catalog job held back (it failed its publish checks, catalog/publish.py) is never
swapped in (catalog/store.py keeps it from `newest_version`); the watcher logs a WARNING once per such
version newer than the one it serves, so an operator sees why a fresh build did not go live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from catalog import store
from catalog.fusion import SearchMode
from catalog.settings import CatalogSettings
from inference.errors import EmbedcarError, FailedPrecondition, Internal, Unavailable

if TYPE_CHECKING:
    from catalog.index import Hit, ProductIndex, Ranking

log = logging.getLogger(__name__)


class IndexHolder:
    def __init__(self, index: ProductIndex | None = None, *, catalog: CatalogSettings, index_root: Path | None = None,
                 expected_model_id: str | None = None, poll_s: float = 5.0,
                 on_load: Callable[[], object] | None = None) -> None:
        """`on_load` runs on the loop after each index is opened or swapped in (the sidecar settles its heap)."""
        self._index = index
        self._on_load = on_load
        self._root = index_root
        self._expected = expected_model_id
        self._poll_s = poll_s
        self._catalog = catalog
        self._why = ("not opened yet" if index_root is not None else
                     "this sidecar has no index_dir (set EMBEDCAR_SIDECAR_INDEX_DIR)")
        # Only "nothing published yet" (or a root still loading) is worth retrying; no index_dir, an
        # index of another model or a broken one needs an operator first.
        self._retry_helps = index_root is not None
        # FAISS calls hold the GIL only briefly, but one flat search is ~3 ms: keep it off the loop.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search")
        self._task: asyncio.Task[None] | None = None
        self._warned: set[str] = set()  # refused versions already logged

    def current(self) -> ProductIndex | None:
        return self._index

    def reason(self) -> str:
        return self._why

    def missing(self) -> EmbedcarError:
        """The error for a Search while no index is loaded: UNAVAILABLE where retrying later can
        help, FAILED_PRECONDITION where it cannot."""
        message = f"no product index loaded: {self._why}"
        return Unavailable(message) if self._retry_helps else FailedPrecondition(message)

    async def start(self) -> None:
        if self._index is None and self._root is not None:
            await self._try_open()
        if self._root is not None or self._index is not None:
            self._task = asyncio.get_running_loop().create_task(self._poll(), name="index-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _try_open(self) -> None:
        from catalog.index import ProductIndex

        assert self._root is not None
        root = self._root
        try:
            # Opening and reloading use their own thread: a big index takes seconds to load and
            # searches of the version in service must go on meanwhile.
            self._index = await asyncio.to_thread(
                lambda: ProductIndex.from_settings(self._catalog, expected_model_id=self._expected, index_root=root))
            log.info("serving product index %s (%d items) from %s", self._index.version, self._index.size, root)
            self._loaded()
        except EmbedcarError as exc:
            self._why = exc.message
            self._retry_helps = isinstance(exc, Unavailable)
            with contextlib.suppress(OSError):  # the reason is a courtesy: never a failed start
                held = await asyncio.to_thread(store.refused_versions, root, model_id=self._expected)
                if held:
                    path, why = held[-1]
                    self._why += f" ({path.name} was not published: {why})"

    def _loaded(self) -> None:
        if self._on_load is not None:
            self._on_load()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                if self._index is None:
                    await self._try_open()
                elif (newer := await asyncio.to_thread(self._index.reloaded)) is not None:
                    # A new object, not a swap inside the old one: a search in flight still
                    # reports the version it searched (the Search reply names it).
                    self._index = newer
                    log.info("product index reloaded: version %s", newer.version)
                    self._loaded()
                await asyncio.to_thread(self._warn_refused)
            except Exception:  # keep serving the version we have
                log.exception("product index reload failed")

    def _warn_refused(self) -> None:
        """A WARNING, once each, for versions newer than the served one that it will not swap to."""
        root = self._root if self._index is None else self._index.index_root
        if root is None:
            return
        serving = self._index.version if self._index is not None else ""
        for path, why in store.refused_versions(root, model_id=self._expected, newer_than=serving):
            if path.name not in self._warned:
                self._warned.add(path.name)
                log.warning("not swapping to product index %s: %s; still serving %s", path.name, why,
                            serving or "no index")

    async def query(self, index: ProductIndex, texts: Sequence[str], queries: np.ndarray | None, k: int, *,
                    mode: SearchMode, filters: Mapping[str, str]) -> tuple[list[list[Hit]], Ranking]:
        """`ProductIndex.query` in the worker thread: the hits, and each leg's time."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, lambda: index.query(texts, queries, k, mode=mode, filters=filters))
        except EmbedcarError:
            raise
        except Exception as exc:
            raise Internal(f"index search failed: {exc}") from exc
