"""The project's one error hierarchy and its one code table, in the client's distribution: the client
raises these, and the server (inference.errors re-exports them) raises and answers them.

Lower libraries (ONNX Runtime, tritonclient, grpc, FAISS) are mapped into these types once, where
they are called. `ERROR_CODES` gives each class its gRPC status, HTTP status and label (metrics, JSON
error replies); the gRPC and HTTP layers, the demo and the load test all read it, and the inverse
lookups (a status a client received back to a class) are derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ErrorCode:
    # A grpc.StatusCode member name: this module does not import grpc (embedcar_client.client.from_grpc and
    # sidecar/errors.py convert it).
    grpc: str
    http: int
    label: str  # metric label and the `code` of JSON error replies


class _Label:
    """`code` of an error class or instance: its label in ERROR_CODES (nearest class in the MRO)."""

    def __get__(self, obj: object, owner: type[EmbedcarError]) -> str:
        return error_code(owner).label


class EmbedcarError(Exception):
    """Base of every error the project raises on purpose."""

    code = _Label()

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidInput(EmbedcarError):
    """The caller sent something the sidecar cannot embed or search (empty batch, too long, bad type)."""


class UnknownModel(InvalidInput):
    """A request named a model this server does not serve (HTTP 404, as OpenAI's API answers it)."""


class PayloadTooLarge(InvalidInput):
    """A request body over the configured size (the HTTP facade's check; gRPC refuses one itself)."""


class RequestTimeout(InvalidInput):
    """A request's head or body did not arrive within the HTTP facade's timeout (HTTP 408)."""


class HeadersTooLarge(InvalidInput):
    """An HTTP request head over the facade's limit (HTTP 431)."""


class Unauthenticated(EmbedcarError):
    """Missing or wrong API key."""


class Overloaded(EmbedcarError):
    """Rate limit or admission control said no; retry after `retry_after_s`."""


class Shed(Overloaded):
    """Refused by gRPC's C core before the sidecar ran any code: too many calls were waiting for its
    event loop (`sidecar.transport_backlog`). gRPC answers such a call CANCELLED and the sidecar has no
    say in that status, so a client reads a CANCELLED it did not cause as this (retry elsewhere or later)."""


class DeadlineExceeded(EmbedcarError):
    """The request's deadline passed (or would pass) before an answer."""


class Unavailable(EmbedcarError):
    """A dependency (Triton, the index) is not there or not ready; retrying later may work."""


class NotFound(EmbedcarError):
    """A named thing (model, index version) does not exist."""


class FailedPrecondition(EmbedcarError):
    """The sidecar is not set up for this call (e.g. Search without an index_dir): retrying will not
    help until an operator acts, unlike Unavailable."""


class ModelError(FailedPrecondition):
    """The model files are missing, corrupt or disagree with their manifest."""


class Internal(EmbedcarError):
    """A bug or an unexpected failure of a lower library."""


# The inverse lookups take the first row with a status, so the general class comes first (Internal
# before ModelError for 500, InvalidInput before FailedPrecondition for 400).
ERROR_CODES: dict[type[EmbedcarError], ErrorCode] = {
    Internal: ErrorCode("INTERNAL", 500, "internal"),
    InvalidInput: ErrorCode("INVALID_ARGUMENT", 400, "invalid_argument"),
    PayloadTooLarge: ErrorCode("INVALID_ARGUMENT", 413, "invalid_argument"),
    RequestTimeout: ErrorCode("INVALID_ARGUMENT", 408, "request_timeout"),
    HeadersTooLarge: ErrorCode("INVALID_ARGUMENT", 431, "invalid_argument"),
    Unauthenticated: ErrorCode("UNAUTHENTICATED", 401, "unauthenticated"),
    Overloaded: ErrorCode("RESOURCE_EXHAUSTED", 429, "resource_exhausted"),
    Shed: ErrorCode("CANCELLED", 429, "shed"),
    DeadlineExceeded: ErrorCode("DEADLINE_EXCEEDED", 504, "deadline_exceeded"),
    Unavailable: ErrorCode("UNAVAILABLE", 503, "unavailable"),
    NotFound: ErrorCode("NOT_FOUND", 404, "not_found"),
    UnknownModel: ErrorCode("INVALID_ARGUMENT", 404, "model_not_found"),
    # HTTP 400 after Google's API mapping: the call cannot work in the system's present state.
    FailedPrecondition: ErrorCode("FAILED_PRECONDITION", 400, "failed_precondition"),
    # Broken model files are the server's fault, not the caller's.
    ModelError: ErrorCode("FAILED_PRECONDITION", 500, "failed_precondition"),
}


def error_code(cls: type[EmbedcarError]) -> ErrorCode:
    """The row of `cls` or of its nearest listed base; Internal's for EmbedcarError itself."""
    for base in cls.__mro__:
        row = ERROR_CODES.get(base)
        if row is not None:
            return row
    return ERROR_CODES[Internal]


# Reversed, so that the first row with a status wins.
_BY_GRPC = {row.grpc: cls for cls, row in reversed(ERROR_CODES.items())}
_BY_HTTP = {row.http: cls for cls, row in reversed(ERROR_CODES.items())}


def error_for_grpc(name: str) -> type[EmbedcarError]:
    """The class for a gRPC status name a client received (Internal for codes we never send)."""
    return _BY_GRPC.get(name, Internal)


def error_for_http(status: int) -> type[EmbedcarError]:
    """The class for an HTTP error status a client received: another 4xx is still the caller's fault."""
    return _BY_HTTP.get(status) or (InvalidInput if 400 <= status < 500 else Internal)
