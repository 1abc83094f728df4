"""Torch backend: the prepared model's PyTorch weights in-process (inference/torch_encoder.py), for a GPU.

On a GPU every (batch bucket, length bucket) pass is a CUDA graph captured at start: a forward pass of
a small encoder is mostly kernel launches, and a replay launches them all at once. Capture and every
replay run on one worker thread (a graph replays on the stream state it was captured with, and one
pass at a time is what the GPU runs anyway); `ready()` is False until every graph is captured. A
bucket whose capture fails (a model whose forward synchronises with the host: ModernBERT builds its
sliding-window mask on the CPU) is computed eagerly instead, named in `eager_buckets` and the log.
On a CPU there are no graphs: a pass runs in the caller's thread, as the embedded backend's does.

The sidecar's micro-batcher and admission feed it (batches_itself False). Precision: fp16 on a GPU,
fp32 on a CPU, or model.variant's where it names fp32, fp16 or bf16; the version id is that variant's,
so caches and indexes keep vectors of each precision apart.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference.backends.base import Backend, Embeddings
from inference.buckets import bucket_for
from inference.errors import EmbedcarError, FailedPrecondition, Internal, InvalidInput
from inference.manifest import Manifest
from inference.padding import trim
from inference.pooling import check_finite
from inference.tokenizer import TokenBatch
from inference.torch_encoder import TorchEncoder, default_device, load_encoder

log = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
WARMUP_PASSES = 2  # eager passes before a capture: lazy initialisation (cuBLAS handles, kernels) kept out of it


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, … up to and including `max_batch`: a batch is padded to at most twice its rows."""
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(min(sizes[-1] * 2, max_batch))
    return tuple(sizes)


@dataclass(slots=True)
class _Graph:
    """One captured pass: its static inputs (written before each replay) and its output."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor | None
    skip: torch.Tensor
    out: torch.Tensor


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, model_dir: Path, manifest: Manifest, *, variant: str | None = None,
                 device: str | None = None, max_batch: int = 256, threads: int = 0) -> None:
        """`threads`: CPU intra-op threads (0: torch's own choice, every core)."""
        self.model_dir = model_dir
        self.manifest = manifest
        self.device = torch.device(device or default_device())
        self.on_gpu = self.device.type == "cuda"
        self.precision = variant or ("fp16" if self.on_gpu else "fp32")
        if self.precision not in DTYPES:
            raise FailedPrecondition(f"the torch backend computes {', '.join(DTYPES)}, not {self.precision}: set "
                                     "model.variant to one of them, or leave it empty (fp16 on a GPU, fp32 on a CPU)")
        self.runs_inline = not self.on_gpu  # a GPU pass stays on the thread its graphs were captured on
        self.version_id = manifest.variant_id(self.precision)
        self.dim = manifest.dim
        self.max_batch = max_batch
        self.batch_buckets = batch_buckets(max_batch)
        self.length_buckets = tuple(manifest.buckets)
        self.threads = threads
        self.encoder: TorchEncoder | None = None
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.eager_buckets: dict[tuple[int, int], str] = {}  # (rows, length) -> why its capture failed
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self._ready = False

    # --- lifecycle -------------------------------------------------------------------------
    def load(self) -> TorchEncoder:
        if self.encoder is None:
            if not self.on_gpu and self.threads > 0:
                torch.set_num_threads(self.threads)
            self.encoder = load_encoder(self.model_dir, device=self.device, dtype=DTYPES[self.precision])
        return self.encoder

    def warm_up(self) -> None:
        """Load, then capture every bucket's graph (GPU) or run one pass per length bucket (CPU)."""
        enc = self.load()
        if self.on_gpu:
            self._capture_all(enc)
        else:
            for n in self.length_buckets:
                self._eager(self._filler(1, n))
        self._ready = True

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self.warm_up)

    def ready(self) -> bool:
        return self._ready

    async def close(self) -> None:
        self._ready = False
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.graphs.clear()
        self.encoder = None
        if self.on_gpu:
            torch.cuda.empty_cache()

    # --- inference -------------------------------------------------------------------------
    def embed_sync(self, batch: TokenBatch) -> Embeddings:
        if self.on_gpu:  # on the graphs' thread, waited for here
            return self._executor.submit(self._embed, batch).result()
        return self._embed(batch)

    async def embed(self, batch: TokenBatch, *, timeout_s: float | None = None) -> Embeddings:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._embed, batch)

    def _embed(self, batch: TokenBatch) -> Embeddings:
        rows = batch.shape[0]
        if rows > self.max_batch:
            raise InvalidInput(f"batch of {rows} is over the backend maximum {self.max_batch}")
        batch = trim(batch)  # columns that are padding in every row change nothing
        try:
            if self.on_gpu and (graph := self.graphs.get(self._bucket(batch))) is not None:
                return check_finite(self._replay(graph, batch))
            return check_finite(self._eager(batch))
        except EmbedcarError:
            raise
        except Exception as exc:  # torch's own errors (out of memory, a CUDA fault): a project error
            raise Internal(f"torch failed on a {batch.shape} batch: {exc}") from exc

    def _bucket(self, batch: TokenBatch) -> tuple[int, int]:
        rows, n = batch.shape
        return bucket_for(rows, self.batch_buckets), bucket_for(n, self.length_buckets)

    def _eager(self, batch: TokenBatch) -> Embeddings:
        enc = self.encoder or self.load()
        return enc.encode(batch.input_ids, batch.attention_mask, batch.token_type_ids, skip=batch.pool_skip)

    def _replay(self, g: _Graph, batch: TokenBatch) -> Embeddings:
        rows, n = batch.shape
        padded = self._filler(*g.input_ids.shape)
        padded.input_ids[:rows, :n] = batch.input_ids
        padded.attention_mask[:rows] = 0
        padded.attention_mask[:rows, :n] = batch.attention_mask
        g.input_ids.copy_(torch.from_numpy(padded.input_ids))
        g.attention_mask.copy_(torch.from_numpy(padded.attention_mask))
        if g.token_type_ids is not None and padded.token_type_ids is not None:
            if batch.token_type_ids is not None:
                padded.token_type_ids[:rows, :n] = batch.token_type_ids
            g.token_type_ids.copy_(torch.from_numpy(padded.token_type_ids))
        g.skip.fill_(batch.pool_skip)
        g.graph.replay()
        out: Embeddings = g.out[:rows].cpu().numpy()
        return out

    def _filler(self, rows: int, n: int) -> TokenBatch:
        """`rows` x `n` of padding, each row attending to its first token only: a row that attends to
        nothing can turn a softmax into NaN, and the rows that fill a batch bucket are of this kind."""
        ids = np.full((rows, n), self.manifest.pad_id, dtype=np.int64)
        mask = np.zeros((rows, n), dtype=np.int64)
        mask[:, 0] = 1
        types = np.zeros_like(ids) if self.manifest.has_token_type_ids else None
        return TokenBatch(ids, mask, types)

    def _capture_all(self, enc: TorchEncoder) -> None:
        """One graph per (batch bucket, length bucket), the largest first: the graphs share one memory
        pool (one pass at a time, each output read before the next replay), so the largest sizes it."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        for rows in reversed(self.batch_buckets):
            for n in reversed(self.length_buckets):
                try:
                    self.graphs[(rows, n)] = self._capture(enc, rows, n, pool, side)
                except RuntimeError as exc:
                    self.eager_buckets[(rows, n)] = str(exc).splitlines()[0]
                    torch.cuda.synchronize(self.device)
        if self.eager_buckets:
            log.warning("torch backend: %d of %d buckets run without a CUDA graph (capture failed: %s)",
                        len(self.eager_buckets), len(self.eager_buckets) + len(self.graphs),
                        next(iter(self.eager_buckets.values())))
        log.info("torch backend on %s (%s): %d CUDA graphs captured", self.device, self.precision, len(self.graphs))

    def _capture(self, enc: TorchEncoder, rows: int, n: int, pool: Any,
                 side: torch.cuda.Stream) -> _Graph:
        fill = self._filler(rows, n)
        ids = torch.from_numpy(fill.input_ids).to(self.device)
        mask = torch.from_numpy(fill.attention_mask).to(self.device)
        types = torch.zeros_like(ids) if fill.token_type_ids is not None else None
        skip = torch.zeros((), dtype=torch.int64, device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):
                enc.forward(ids, mask, types, skip)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = enc.forward(ids, mask, types, skip)
        return _Graph(graph, ids, mask, types, skip, out)
