"""inference.errors' code table at the sidecar's surfaces: an error's gRPC and HTTP status (`status`,
what every transport answers), and a client's gRPC status back to an error."""

from __future__ import annotations

from typing import NamedTuple

import grpc

from inference.errors import EmbedcarError, PayloadTooLarge, error_code, error_for_grpc


class Status(NamedTuple):
    """What a failed request answers, on gRPC (either server) and on HTTP alike."""

    grpc: grpc.StatusCode
    http: int
    message: str
    retry_after_s: float | None


def status(exc: EmbedcarError) -> Status:
    code = error_code(type(exc))
    return Status(grpc.StatusCode[code.grpc], code.http, exc.message, exc.retry_after_s)


def from_grpc(code: grpc.StatusCode, details: str | None, retry_after_s: float | None = None) -> EmbedcarError:
    """The project error for a gRPC failure seen by a client."""
    cls = error_for_grpc(code.name)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details and "larger than max" in details:
        cls = PayloadTooLarge  # grpc's own max-message-size check: the request, not the server, is at fault
    if code == grpc.StatusCode.CANCELLED:  # see Shed: gRPC's own refusal carries no message of ours
        details = f"refused in the transport: too many calls waiting ({details or 'cancelled'})"
    return cls(details or code.name.lower(), retry_after_s=retry_after_s)
