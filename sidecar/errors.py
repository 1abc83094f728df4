"""inference.errors mapped once to gRPC status codes and once to HTTP status codes (and back)."""

from __future__ import annotations

from typing import TypeVar

import grpc

from inference.errors import (
    DeadlineExceeded,
    EmbedcarError,
    FailedPrecondition,
    Internal,
    InvalidInput,
    ModelError,
    NotFound,
    Overloaded,
    Unauthenticated,
    Unavailable,
)

# Trailing-metadata key carrying Overloaded.retry_after_s (seconds, as text).
RETRY_AFTER_KEY = "x-retry-after-s"

_T = TypeVar("_T")

_GRPC: dict[type[EmbedcarError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,  # ModelError included
    Internal: grpc.StatusCode.INTERNAL,
}

_HTTP: dict[type[EmbedcarError], int] = {
    InvalidInput: 400,
    FailedPrecondition: 400,  # Google's API mapping: the call cannot work in the system's present state
    Unauthenticated: 401,
    NotFound: 404,
    Overloaded: 429,
    Internal: 500,
    ModelError: 500,  # broken model files are the server's fault, not the caller's
    Unavailable: 503,
    DeadlineExceeded: 504,
}

# Client side: what a gRPC status means in our hierarchy.
_FROM_GRPC: dict[grpc.StatusCode, type[EmbedcarError]] = {
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: NotFound,
}


def _lookup(table: dict[type[EmbedcarError], _T], exc: EmbedcarError, default: _T) -> _T:
    for cls in type(exc).__mro__:
        if cls in table:
            return table[cls]
    return default


def grpc_code(exc: EmbedcarError) -> grpc.StatusCode:
    return _lookup(_GRPC, exc, grpc.StatusCode.INTERNAL)


def http_status(exc: EmbedcarError) -> int:
    return _lookup(_HTTP, exc, 500)


def from_grpc(code: grpc.StatusCode, details: str | None, retry_after_s: float | None = None) -> EmbedcarError:
    """The project error for a gRPC failure seen by a client."""
    cls = _FROM_GRPC.get(code, Internal)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details and "larger than max" in details:
        cls = InvalidInput  # grpc's own max-message-size check: the request, not the server, is at fault
    return cls(details or code.name.lower(), retry_after_s=retry_after_s)
