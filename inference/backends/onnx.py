"""Embedded backend: the model in-process, no server needed, on ONNX Runtime (or OpenVINO for bf16:
inference/runtimes.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from inference.backends.base import Backend, Embeddings
from inference.errors import FailedPrecondition, Internal, InvalidInput
from inference.head import Head
from inference.manifest import Manifest
from inference.padding import trim
from inference.runtimes import Graph, open_graph
from inference.tokenizer import TokenBatch

log = logging.getLogger(__name__)
# Every core is kept for a short query only where it cuts the query's time by at least this share:
# below that, the second core is taken from the search node for little latency (docs/benchmarks.md).
MORE_THREADS_MIN_GAIN = 0.25
CHOICE_TOKENS = 12  # a typical shopper query, special tokens included
CHOICE_RUNS = 25  # timed passes per setting, alternating


class OnnxBackend(Backend):
    name = "embedded"
    runs_inline = True

    def __init__(self, model_dir: Path, manifest: Manifest, *, variant: str | None = None,
                 threads: int = 0, max_batch: int = 256, lanes: int = 1,
                 choose_threads: bool = False) -> None:
        """`threads`: ORT threads in all (0 = every core), split over `lanes` calls that may run at once.
        `choose_threads` (with threads 0 and one lane, on a host of several cores): measured at load,
        one thread unless every core makes a typical query at least MORE_THREADS_MIN_GAIN faster.

        Each pass is padded only to its longest sequence (inference.padding.trim): padding a short
        query to its bucket cost 25-35 % of a CPU pass for the same embeddings (docs/benchmarks.md).
        """
        if manifest.torch_only:
            raise FailedPrecondition(manifest.onnx_refusal("the embedded backend"))
        self.manifest = manifest
        self.variant_name = variant or manifest.default_variant
        self._path = model_dir / manifest.variant(self.variant_name).file
        self._precision = manifest.variant(self.variant_name).precision
        self.lanes = max(1, lanes)
        self.threads = max(1, (threads if threads > 0 else (os.cpu_count() or 1)) // self.lanes)  # per call
        self._choose = choose_threads and threads <= 0 and self.lanes == 1 and self.threads > 1
        self.thread_choice: dict[str, float] = {}  # what the choice measured: median ms per setting
        self.version_id = manifest.variant_id(self.variant_name)
        self.dim = manifest.dim
        self.head = Head.from_manifest(model_dir, manifest)
        self.max_batch = max_batch
        self._sess: Graph | None = None
        # At most `lanes` ORT calls at a time, each on its share of the threads: more calls than
        # that only fight over the cores and lengthen the tail. (A session runs concurrent calls.)
        self._calls = threading.BoundedSemaphore(self.lanes)
        self._executor = ThreadPoolExecutor(max_workers=self.lanes, thread_name_prefix="ort")
        self._ready = False

    # --- lifecycle -------------------------------------------------------------------------
    def load(self) -> None:
        if self._sess is None:
            sess = open_graph(self._path, self._precision, self.threads)
            if self._choose:
                one = open_graph(self._path, self._precision, 1)
                if self._one_thread_wins(one, sess):
                    sess, self.threads = one, 1
            self._sess = sess

    def _one_thread_wins(self, one: Graph, every_core: Graph) -> bool:
        """Time a typical query on one thread and on every core (alternating, medians): one thread
        unless every core is MORE_THREADS_MIN_GAIN faster. On a small shared host one thread is
        often faster too: no second thread to wake and join after every op."""
        feed = {k: v for k, v in self._query(CHOICE_TOKENS).arrays().items() if k in one.inputs}
        times: dict[Graph, list[float]] = {one: [], every_core: []}
        for i in range(CHOICE_RUNS + 3):
            for graph, got in times.items():
                t = time.perf_counter()
                graph.hidden(feed)
                if i >= 3:  # the first passes set the runtime up
                    got.append((time.perf_counter() - t) * 1e3)
        t1, tn = statistics.median(times[one]), statistics.median(times[every_core])
        self.thread_choice = {"1": t1, str(self.threads): tn}
        wins = tn > (1 - MORE_THREADS_MIN_GAIN) * t1
        log.info("embedded backend on %d ORT thread(s): a %d-token query took %.2f ms on 1 thread, %.2f ms on %d",
                 1 if wins else self.threads, CHOICE_TOKENS, t1, tn, self.threads)
        return wins

    def _query(self, n: int) -> TokenBatch:
        """One row of `n` tokens (a special token, then padding ids under a full mask)."""
        ids = np.full((1, n), self.manifest.pad_id, dtype=np.int64)
        ids[0, 0] = self.manifest.special_ids[0] if self.manifest.special_ids else 1
        types = np.zeros_like(ids) if self.manifest.has_token_type_ids else None
        return TokenBatch(ids, np.ones((1, n), dtype=np.int64), types)

    def warm_up(self) -> None:
        """One forward pass per bucket so first requests don't pay for ORT's lazy set-up."""
        self.load()
        for n in self.manifest.buckets:
            self.embed_sync(self._query(n))
        self._ready = True

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self.warm_up)

    def ready(self) -> bool:
        return self._ready

    async def close(self) -> None:
        self._ready = False
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._sess = None

    # --- inference -------------------------------------------------------------------------
    def hidden_sync(self, batch: TokenBatch) -> np.ndarray:
        """last_hidden_state of `batch` as given (no cut: its rows line up with the batch's mask)."""
        self.load()
        if batch.shape[0] > self.max_batch:
            raise InvalidInput(f"batch of {batch.shape[0]} is over the backend maximum {self.max_batch}")
        assert self._sess is not None
        return self._run(self._sess, batch)

    def _run(self, graph: Graph, batch: TokenBatch) -> np.ndarray:
        feed = {k: v for k, v in batch.arrays().items() if k in graph.inputs}
        with self._calls:
            try:
                return graph.hidden(feed)
            except Exception as exc:
                raise Internal(f"{type(graph).__name__} failed on a {batch.shape} batch: {exc}") from exc

    def embed_sync(self, batch: TokenBatch) -> Embeddings:
        batch = trim(batch)
        hidden = self.hidden_sync(batch)
        return self.head(hidden, batch.attention_mask, input_ids=batch.input_ids, skip=batch.pool_skip)

    async def embed(self, batch: TokenBatch, *, timeout_s: float | None = None) -> Embeddings:
        fut = asyncio.get_running_loop().run_in_executor(self._executor, self.embed_sync, batch)
        return await fut
