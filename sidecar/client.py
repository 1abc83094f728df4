"""Python client for the sidecar (sync `Client`, async `AsyncClient`), one gRPC channel each.

    with Client("127.0.0.1:50051", api_key=...) as c:
        r = c.embed(["oat milk"])          # r.embeddings: [1, 384] float32
        s = c.search(["oat milk"], k=5)    # s.hits[0][0].id, .score, .fields, .legs
        t = c.search(["oat mi"], mode="hybrid")  # FAISS + lexical prefix search, fused

A target is anything grpc dials: `host:port`, or `unix:/abs/path` (also `unix:///abs/path`) for the
sidecar's Unix socket (sidecar.uds_path) for same-host callers.
Failures raise inference.errors types (Unauthenticated, Overloaded, InvalidInput, Unavailable,
DeadlineExceeded, Internal); Overloaded carries the server's retry_after_s hint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import grpc
import numpy as np

from catalog.fusion import SearchMode, parse_mode
from catalog.index import Hit
from inference.backends.base import Embeddings
from inference.errors import EmbedcarError
from sidecar.errors import RETRY_AFTER_KEY, from_grpc
from sidecar.grpc_server import API_KEY
from sidecar.proto import embedcar_pb2 as pb
from sidecar.proto import embedcar_pb2_grpc  # generated, untyped: mypy treats it as Any
from sidecar.timings import STAGES

_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.max_send_message_length", -1)]
EMBED = "/embedcar.v1.Embedder/Embed"


@dataclass(frozen=True, slots=True)
class EmbedResult:
    embeddings: Embeddings  # [n, dim] float32
    model: str
    cache_hits: list[bool]
    truncated: list[bool]
    timings_ns: dict[str, int]
    backend: str = ""  # which backend computed the misses ("" = all from the cache)


@dataclass(frozen=True, slots=True)
class SearchResult:
    hits: list[list[Hit]]
    model: str
    index_version: str
    cache_hits: list[bool]
    timings_ns: dict[str, int]
    backend: str = ""


def _timings(t: pb.Timings) -> dict[str, int]:
    return {k: int(getattr(t, k)) for k in STAGES}


def decode_embed(reply: pb.EmbedReply) -> EmbedResult:
    # float32 replies are a zero-copy, read-only view over the reply bytes.
    dtype = "<f2" if reply.dtype == pb.FLOAT16 else "<f4"
    emb = np.frombuffer(reply.embeddings, dtype=dtype).reshape(reply.rows, reply.dim)
    return EmbedResult(emb.astype(np.float32, copy=False), reply.model, list(reply.cache_hits),
                       list(reply.truncated), _timings(reply.timings), reply.backend)


def decode_search(reply: pb.SearchReply) -> SearchResult:
    hits = [[Hit(h.id, float(h.score), dict(h.fields), tuple(h.legs)) for h in hl.hits] for hl in reply.results]
    return SearchResult(hits, reply.model, reply.index_version, list(reply.cache_hits), _timings(reply.timings),
                        reply.backend)


def embed_request(texts: Sequence[str], float16: bool) -> pb.EmbedRequest:
    return pb.EmbedRequest(texts=list(texts), float16=float16)


def search_request(texts: Sequence[str], k: int, department: str | None, aisle: str | None,
                   mode: SearchMode | str = SearchMode.SEMANTIC) -> pb.SearchRequest:
    return pb.SearchRequest(texts=list(texts), k=k, department=department or "", aisle=aisle or "",
                            mode=parse_mode(mode).name)  # the enum label, e.g. "HYBRID"


def map_rpc_error(exc: grpc.RpcError) -> EmbedcarError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    retry: float | None = None
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == RETRY_AFTER_KEY:
            try:
                retry = float(value)
            except ValueError:
                retry = None
    return from_grpc(code, details, retry)


class _RpcErrors:
    """`with RPC_ERRORS:` re-raises a failed call's grpc.RpcError as the project's error (sync and async)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, grpc.RpcError):
            raise map_rpc_error(exc) from None


RPC_ERRORS = _RpcErrors()


class _Calls:
    """What both clients share: target, key metadata, and the generated stub (the method table),
    which builds the same multi-callables on a sync or an aio channel."""

    def __init__(self, target: str, api_key: str | None, channel: Any) -> None:
        self.target = target
        self._metadata = ((API_KEY, api_key),) if api_key else None
        self._channel = channel
        self._stub = embedcar_pb2_grpc.EmbedderStub(channel)


class AsyncClient(_Calls):
    def __init__(self, target: str, *, api_key: str | None = None) -> None:
        super().__init__(target, api_key, grpc.aio.insecure_channel(target, options=_OPTIONS))

    async def embed(self, texts: Sequence[str], *, float16: bool = False,
                    timeout_s: float | None = None) -> EmbedResult:
        with RPC_ERRORS:
            reply = await self._stub.Embed(embed_request(texts, float16), timeout=timeout_s, metadata=self._metadata)
        return decode_embed(reply)

    async def search(self, texts: Sequence[str], *, k: int = 10, department: str | None = None,
                     aisle: str | None = None, mode: SearchMode | str = SearchMode.SEMANTIC,
                     timeout_s: float | None = None) -> SearchResult:
        with RPC_ERRORS:
            reply = await self._stub.Search(search_request(texts, k, department, aisle, mode), timeout=timeout_s,
                                            metadata=self._metadata)
        return decode_search(reply)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class Client(_Calls):
    def __init__(self, target: str, *, api_key: str | None = None) -> None:
        super().__init__(target, api_key, grpc.insecure_channel(target, options=_OPTIONS))

    def embed(self, texts: Sequence[str], *, float16: bool = False, timeout_s: float | None = None) -> EmbedResult:
        with RPC_ERRORS:
            reply = self._stub.Embed(embed_request(texts, float16), timeout=timeout_s, metadata=self._metadata)
        return decode_embed(reply)

    def search(self, texts: Sequence[str], *, k: int = 10, department: str | None = None,
               aisle: str | None = None, mode: SearchMode | str = SearchMode.SEMANTIC,
               timeout_s: float | None = None) -> SearchResult:
        with RPC_ERRORS:
            reply = self._stub.Search(search_request(texts, k, department, aisle, mode), timeout=timeout_s,
                                      metadata=self._metadata)
        return decode_search(reply)

    def raw_embed(self, payload: bytes, *, timeout_s: float | None = None) -> bytes:
        """Send pre-serialised request bytes (tests of malformed input, benchmarks)."""
        call: Any = self._channel.unary_unary(EMBED)
        with RPC_ERRORS:
            out: bytes = call(payload, timeout=timeout_s, metadata=self._metadata)
        return out

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
