"""The backend interface: a padded token batch in, L2-normalised float32 embeddings out."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import numpy.typing as npt

from inference.tokenizer import TokenBatch

Embeddings = npt.NDArray[np.float32]


class Backend(ABC):
    """One model, one version id; `embed` takes a same-shape batch from one length bucket."""

    name: str = "backend"
    # True when the backend batches concurrent calls itself (Triton's dynamic batcher): the sidecar
    # then sends each request straight through; False: the sidecar's micro-batcher merges them.
    batches_itself: bool = False
    version_id: str = ""
    dim: int = 0
    max_batch: int = 256
    # True when `embed_sync` computes in the caller's thread (an in-process model): a scheduler
    # may then run it on the event loop itself when nothing else waits, saving the thread hop.
    runs_inline: bool = False
    # Calls worth running at once: the micro-batcher keeps up to this many forward passes in flight.
    lanes: int = 1

    @abstractmethod
    async def start(self) -> None:
        """Connect/load and warm up every bucket; `ready()` is True only after this."""

    @abstractmethod
    async def embed(self, batch: TokenBatch, *, timeout_s: float | None = None) -> Embeddings:
        """[B, L] tokens -> [B, dim] L2-normalised float32. Raises project errors only."""

    def embed_sync(self, batch: TokenBatch) -> Embeddings:
        """`embed` computed in the calling thread; only where `runs_inline`."""
        raise NotImplementedError(f"{self.name} cannot compute in the caller's thread")

    @abstractmethod
    def ready(self) -> bool:
        """Can serve now (started, warmed, and its server, if any, reachable)."""

    def down_reason(self) -> str:
        """Why the backend is not ready, where it knows (an error names it to callers); "" otherwise."""
        return ""

    @abstractmethod
    async def close(self) -> None:
        """Release sessions/channels; idempotent."""
