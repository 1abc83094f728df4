"""Bad input over gRPC and HTTP -> INVALID_ARGUMENT / 4xx with a message; the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from embedcar_client.client import Client
from embedcar_client.proto import embedcar_pb2 as pb
from inference.errors import InvalidInput
from sidecar.app import Sidecar


@pytest.fixture(autouse=True)
def still_serving(sidecar_client: Client) -> Iterator[None]:
    yield
    assert sidecar_client.embed(["still serving"]).embeddings.shape == (1, 384)


@pytest.mark.parametrize(("texts", "message"), [
    ([], "empty batch"),
    ([""], "empty or whitespace"),
    (["ok", " \t\n "], "text 1 is empty"),
    (["x" * 100_000], "over the maximum"),
    (["milk"] * 257, "over the maximum of 256"),
])
def test_grpc_rejects_bad_texts(sidecar_client: Client, texts: list[str], message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as err:
        sidecar_client.embed(texts)
    assert err.value.code == "invalid_argument"


def test_grpc_rejects_bad_search_k(sidecar_client: Client) -> None:
    with pytest.raises(InvalidInput, match="k must be"):
        sidecar_client.search(["milk"], k=10_000)


def raw_embed(client: Client, payload: bytes, *, timeout_s: float | None = None) -> bytes:
    """Pre-serialised request bytes to Embed, as a client with another proto (or none) sends them."""
    from embedcar_client.client import EMBED, RPC_ERRORS

    call = client._channel.unary_unary(EMBED)
    with RPC_ERRORS:
        out: bytes = call(payload, timeout=timeout_s)
    return out


def test_grpc_rejects_unknown_fields_and_invalid_utf8(sidecar_client: Client) -> None:
    good = pb.EmbedRequest(texts=["milk"]).SerializeToString()
    with pytest.raises(InvalidInput, match="unknown"):
        raw_embed(sidecar_client, good + b"\x98\x06\x01")  # field 99, varint 1
    with pytest.raises(InvalidInput, match="UTF-8"):
        raw_embed(sidecar_client, b"\x0a\x03\xff\xfe\xfd")  # texts[0] = invalid UTF-8
    with pytest.raises(InvalidInput):
        raw_embed(sidecar_client, b"\xff\xff\xff")  # not a message at all


def test_grpc_rejects_50mb_payload(sidecar_client: Client) -> None:
    payload = pb.EmbedRequest(texts=["y" * (1 << 20)] * 50).SerializeToString()
    with pytest.raises(InvalidInput, match="larger than max"):
        raw_embed(sidecar_client, payload, timeout_s=60)


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"\xff\xfe{}", 400, "UTF-8"),
    (b'{"input": 12}', 400, "string or a list"),
    (b'{"input": ["a", null]}', 400, "string or a list"),
    (b'{"input": "a", "extra": true}', 400, "unknown fields"),
    (b'{"input": []}', 400, "empty batch"),
    (b'{"input": "   "}', 400, "whitespace"),
    (b"not json", 400, "not JSON"),
])
def test_http_rejects_bad_bodies(sidecar_embedded: Sidecar, body: bytes, status: int, message: str) -> None:
    r = httpx.post(f"http://127.0.0.1:{sidecar_embedded.http_port}/v1/embeddings", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status
    assert message in r.json()["error"]["message"]


def test_http_rejects_50mb_body(sidecar_embedded: Sidecar) -> None:
    body = b'{"input": "' + b"z" * (50 << 20) + b'"}'
    r = httpx.post(f"http://127.0.0.1:{sidecar_embedded.http_port}/v1/embeddings", content=body, timeout=60)
    assert r.status_code == 413
    assert "over the limit" in r.json()["error"]["message"]


def test_http_rejects_chunked_oversized_body(sidecar_embedded: Sidecar) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"input": "'
        for _ in range(10):
            yield b"z" * (1 << 20)
        yield b'"}'

    r = httpx.post(f"http://127.0.0.1:{sidecar_embedded.http_port}/v1/embeddings", content=chunks(), timeout=60)
    assert r.status_code == 413
