"""inference.errors' code table at the sidecar's surfaces: an error's gRPC and HTTP status (`status`,
what every transport answers). A client's gRPC status back to an error is the client's
(embedcar_client.client.from_grpc)."""

from __future__ import annotations

from typing import NamedTuple

import grpc

from inference.errors import EmbedcarError, error_code


class Status(NamedTuple):
    """What a failed request answers, on gRPC (either server) and on HTTP alike."""

    grpc: grpc.StatusCode
    http: int
    message: str
    retry_after_s: float | None


def status(exc: EmbedcarError) -> Status:
    code = error_code(type(exc))
    return Status(grpc.StatusCode[code.grpc], code.http, exc.message, exc.retry_after_s)
