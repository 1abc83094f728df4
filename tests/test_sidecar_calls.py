"""sidecar.calls: one request path for every transport. A bug in a handler answers INTERNAL (HTTP 500) on
gRPC and HTTP, unary and Stream alike, its traceback logged once per request; a keyed request has its key
checked once, before its bytes are decoded, and takes one rate-limit token, whatever the transport."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest

from embedcar_client.client import AsyncClient, Client
from embedcar_client.wire import SERVICE
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.errors import Internal, InvalidInput
from sidecar import calls
from sidecar.app import Sidecar, SidecarThread
from sidecar.calls import failure
from sidecar.metrics import Metrics
from tests.fixtures_sidecar import sidecar_settings

KEY = "calls-key-1f2e3d4c5b6a"


def test_failure_logs_a_bugs_traceback_once_and_counts_it(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    caplog.set_level(logging.ERROR, logger="sidecar.calls")
    refused = InvalidInput("no")
    assert failure(metrics, "embed", refused) is refused
    assert not caplog.records  # a project error is an answer, not a bug
    try:
        raise KeyError("boom")
    except KeyError as exc:
        err = failure(metrics, "embed", exc)
    assert isinstance(err, Internal) and err.message == "unexpected error: KeyError"
    [record] = caplog.records
    assert record.exc_info is not None and record.exc_info[0] is KeyError
    count = metrics.registry.get_sample_value
    assert count("embedcar_requests_total", {"rpc": "embed", "code": Internal.code}) == 1
    assert count("embedcar_requests_total", {"rpc": "embed", "code": refused.code}) == 1


@pytest.fixture(scope="module")
def keyed(settings: Settings, onnx_backend: OnnxBackend) -> Iterator[Sidecar]:
    """gRPC and HTTP: one key."""
    s = sidecar_settings(settings, api_keys=f"shop={KEY}")
    with SidecarThread(s, backend=onnx_backend) as sc:
        yield sc


def _http_embed(sc: Sidecar, text: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{sc.http_port}/v1/embeddings", json={"input": text},
                      headers={"authorization": f"Bearer {KEY}"}, timeout=30)


async def _stream_embed(target: str, text: str) -> None:
    async with AsyncClient(target, api_key=KEY, stream=True) as c:
        await c.embed([text])


def _counting(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str) -> list[int]:
    calls: list[int] = []
    real: Callable[..., Any] = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_a_keyed_request_checks_its_key_once_and_takes_one_token(keyed: Sidecar,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    checked = _counting(monkeypatch, keyed.service.keys, "tenant_for")
    tokens = _counting(monkeypatch, keyed.service.limiter, "take")
    r = _http_embed(keyed, "sparkling water lime")
    assert r.status_code == 200, r.text
    assert (len(checked), len(tokens)) == (1, 1)
    checked = _counting(monkeypatch, keyed.service.keys, "tenant_for")
    tokens = _counting(monkeypatch, keyed.service.limiter, "take")
    with Client(keyed.grpc_target, api_key=KEY) as c:
        c.embed(["rye crackers"])
    assert (len(checked), len(tokens)) == (1, 1)


def test_no_byte_of_an_unauthenticated_request_is_decoded(keyed: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong key is refused before the request's bytes are parsed, whatever they hold (unary gRPC)."""
    decoded = _counting(monkeypatch, calls, "decode")
    for rpc in ("Embed", "Search"):
        with grpc.insecure_channel(keyed.grpc_target) as ch:
            call = ch.unary_unary(f"/{SERVICE}/{rpc}")
            for key in (None, "wrong-key-0123456789"):
                metadata = (("x-api-key", key),) if key else None
                with pytest.raises(grpc.RpcError) as refused:
                    call(b"\xff" * 64, timeout=10, metadata=metadata)  # not even a valid message
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc, key)
            with pytest.raises(grpc.RpcError) as bad:
                call(b"\xff" * 64, timeout=10, metadata=(("x-api-key", KEY),))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(decoded) == 2  # the keyed calls' only


def test_a_bug_is_internal_on_every_transport_and_logged_once(keyed: Sidecar,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(keyed.service, "embed", broken)
    caplog.set_level(logging.ERROR, logger="sidecar.calls")
    answers: list[object] = []
    r = _http_embed(keyed, "plum jam")
    answers.append(r.status_code)
    assert r.json()["error"] == {"message": "unexpected error: ZeroDivisionError", "type": Internal.code}
    with Client(keyed.grpc_target, api_key=KEY) as c, pytest.raises(Internal, match="ZeroDivisionError"):
        c.embed(["plum jam"])
    answers.append("unary")
    with pytest.raises(Internal, match="ZeroDivisionError"):
        asyncio.run(_stream_embed(keyed.grpc_target, "plum jam"))
    answers.append("stream")
    assert answers == [500, "unary", "stream"]
    bugs = [r for r in caplog.records if r.exc_info is not None and r.exc_info[0] is ZeroDivisionError]
    assert len(bugs) == 3  # one traceback per request, whichever transport brought it
