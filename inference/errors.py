"""The project's one error hierarchy.

Lower libraries (ONNX Runtime, tritonclient, grpc, FAISS) are mapped into these types once, where
they are called; the gRPC and HTTP layers map these types once to status codes.
"""

from __future__ import annotations


class EmbedcarError(Exception):
    """Base of every error the project raises on purpose."""

    code = "internal"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidInput(EmbedcarError):
    """The caller sent something we cannot embed or search (empty batch, too long, bad type)."""

    code = "invalid_argument"


class Unauthenticated(EmbedcarError):
    """Missing or wrong API key."""

    code = "unauthenticated"


class Overloaded(EmbedcarError):
    """Rate limit or admission control said no; retry after `retry_after_s`."""

    code = "resource_exhausted"


class DeadlineExceeded(EmbedcarError):
    """The request's deadline passed (or would pass) before an answer."""

    code = "deadline_exceeded"


class Unavailable(EmbedcarError):
    """A dependency (Triton, the index) is not there or not ready; retrying later may work."""

    code = "unavailable"


class NotFound(EmbedcarError):
    """A named thing (model, index version) does not exist."""

    code = "not_found"


class FailedPrecondition(EmbedcarError):
    """The sidecar is not set up for this call (e.g. Search without an index_dir): retrying will not
    help until an operator acts, unlike Unavailable."""

    code = "failed_precondition"


class ModelError(FailedPrecondition):
    """The model files are missing, corrupt or disagree with their manifest."""

    code = "failed_precondition"


class Internal(EmbedcarError):
    """A bug or an unexpected failure of a lower library."""

    code = "internal"
