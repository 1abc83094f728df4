"""What a gRPC caller and the server agree on besides the .proto: the service's full name and the
metadata keys. The client imports this, not the server."""

from __future__ import annotations

from embedcar_client.proto import embedcar_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Embedder"].full_name
API_KEY = "x-api-key"  # request metadata: the caller's key (HTTP: Authorization: Bearer)
RETRY_AFTER_KEY = "x-retry-after-s"  # trailing metadata: Overloaded.retry_after_s, seconds as text
