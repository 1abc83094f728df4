"""The project's one error hierarchy and its one code table, as the server imports them.

They live in the client's distribution (client/embedcar_client/errors.py), which the server depends
on: a search node's client raises the same classes the sidecar answers with. This floor re-exports
them, so the server's modules import `from inference.errors import X`.
"""

from __future__ import annotations

from embedcar_client.errors import (
    ERROR_CODES,
    DeadlineExceeded,
    EmbedcarError,
    ErrorCode,
    FailedPrecondition,
    HeadersTooLarge,
    Internal,
    InvalidInput,
    ModelError,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    Shed,
    Unauthenticated,
    Unavailable,
    UnknownModel,
    error_code,
    error_for_grpc,
    error_for_http,
)

__all__ = [
    "ERROR_CODES",
    "DeadlineExceeded",
    "EmbedcarError",
    "ErrorCode",
    "FailedPrecondition",
    "HeadersTooLarge",
    "Internal",
    "InvalidInput",
    "ModelError",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "RequestTimeout",
    "Shed",
    "Unauthenticated",
    "Unavailable",
    "UnknownModel",
    "error_code",
    "error_for_grpc",
    "error_for_http",
]
