"""The backend interface: a padded token batch in, L2-normalised float32 embeddings out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from inference.tokenizer import TokenBatch

if TYPE_CHECKING:
    from inference.triton.tls import ClientCredentials

Embeddings = npt.NDArray[np.float32]
# A blocking unary call on one channel: (method, request bytes, timeout_s, metadata) -> reply bytes,
# raising CallFailed for a status other than OK; and what opens one: (url, channel options, credentials).
BlockingCall = Callable[[str, bytes, float, Sequence[tuple[str, str]]], bytes]
OpenChannel = Callable[[str, list[tuple[str, int | str]], "ClientCredentials | None"], BlockingCall]


class CallFailed(Exception):
    """A blocking call's status other than OK: `code` is gRPC's name for it (UNAVAILABLE, ...)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class BlockingCalls(Protocol):
    """What a backend that calls a server offers beside `embed`, where it can (`Backend.blocking`): the same
    call waited for by the calling thread, which must not be the event loop's, through channels the caller
    opens (the sidecar's compiled gRPC front: sidecar/native_front.py)."""

    def use_blocking_channels(self, open_channel: OpenChannel | None) -> None:
        """Call each server through a channel `open_channel` opens (None: no more blocking calls)."""

    def blocking_ready(self) -> bool:
        """`embed_blocking` can be called now (channels given, the server up)."""

    def embed_blocking(self, batch: TokenBatch, *, timeout_s: float | None = None) -> Embeddings:
        """`embed` waiting for its server in the calling thread."""


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

    def blocking(self) -> BlockingCalls | None:
        """This backend's blocking calls, where it has them (Triton's); None: `embed` only."""
        return None

    @abstractmethod
    def ready(self) -> bool:
        """Can serve now (started, warmed, and its server, if any, reachable)."""

    def down_reason(self) -> str:
        """Why the backend is not ready, where it knows (an error names it to callers); "" otherwise."""
        return ""

    @abstractmethod
    async def close(self) -> None:
        """Release sessions/channels; idempotent."""
