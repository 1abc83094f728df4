"""API keys on every surface of a real sidecar (and the demo in front of it); no key in any log line.

Embed, Search, Stream, gRPC reflection, HTTP /v1/embeddings, HTTP /metrics and the demo websocket each get
no key, a wrong key and the right key (loadtest/faults/auth.py `probe_surfaces`, also the fault
suite's `auth` scenario); health stays open. Every log record of the run is captured at DEBUG
(caplog for the root logger, a LogCapture for uvicorn's loggers, which do not propagate).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from embedcar_settings import Settings
from inference.errors import Unauthenticated
from loadtest.faults import auth
from loadtest.faults.surfaces import DemoThread, LogCapture
from sidecar.app import Sidecar, SidecarThread
from sidecar.auth import KeyRing
from sidecar.settings import SidecarSettings
from tests.fixtures_sidecar import sidecar_settings

KEY = "sk-test-right-" + "ab12" * 8
WRONG = "sk-test-wrong-" + "cd34" * 8


@pytest.fixture(scope="module")
def keyed(settings: Settings, grocery_index_root: Path) -> Iterator[tuple[Sidecar, str]]:
    """A sidecar with one API key, HTTP on, a real index; the demo server in front of it."""
    s = sidecar_settings(settings, api_keys=f"shop={KEY}", index_dir=grocery_index_root)
    s = s.with_section("catalog", use_gpu=False)
    with SidecarThread(s) as car, DemoThread(car.grpc_target, api_key=KEY, keys=car.keys) as ws_url:
        yield car, ws_url


def test_every_surface_needs_the_key_and_none_is_logged(keyed: tuple[Sidecar, str],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    car, ws_url = keyed
    assert car.http_port is not None
    caplog.set_level(logging.DEBUG)
    with LogCapture() as logs:
        checks = auth.probe_surfaces(car.grpc_target, car.http_port, ws_url, KEY, WRONG, lambda: logs.lines)
    by_name = {c.surface: c for c in checks}
    assert {"gRPC Embed", "gRPC Search", "gRPC Stream", "gRPC reflection", "HTTP POST /v1/embeddings (bearer)",
            "HTTP GET /metrics", "demo websocket (header)", "demo websocket (?api_key=)"} <= set(by_name)
    for c in checks:
        assert c.rejected and c.served, c
    assert by_name["gRPC reflection"].no_key == "UNAUTHENTICATED"
    assert by_name["HTTP GET /metrics"].wrong_key == "401"
    assert by_name["demo websocket (header)"].no_key == "error unauthenticated, close 1008"

    lines = [caplog.text, *(r.getMessage() for r in caplog.records), *logs.lines]
    assert len(caplog.records) > 0  # DEBUG capture did see the run (else "no key" proves nothing)
    assert auth.leaks(lines, KEY, WRONG) == []
    assert not any(c.key_in_logs for c in checks)
    assert auth.leaks([repr(car.settings), str(car.settings.sidecar), repr(car.keys)], KEY, WRONG) == []


def test_key_ring_compares_against_every_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit: the first key, the last key and a wrong key cost the same comparisons."""
    keys = "a=key-one-0123456789,b=key-two-0123456789,c=key-three-0123456789"
    ring = KeyRing.from_settings(SidecarSettings(api_keys=keys))
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for key, tenant in (("key-one-0123456789", "a"), ("key-three-0123456789", "c"), ("nope", None),
                        ("\ud800", None)):
        calls.clear()
        if tenant is None:
            with pytest.raises(Unauthenticated, match="wrong API key"):
                ring.tenant_for(key)
        else:
            assert ring.tenant_for(key) == tenant
        assert calls == [32, 32, 32]  # SHA-256 digests: equal lengths, every entry


def test_auth_scenario_quick(settings: Settings, tmp_path: Path) -> None:
    """The scenario as the fault command runs it (its own sidecar, index and demo), short form."""
    result = auth.run(settings, tmp_path, quick=True)
    assert result.passed, result.to_json()
    assert len(result.figures["surfaces"]) >= 10


def test_http_search_needs_the_key(keyed: tuple[Sidecar, str]) -> None:
    import httpx

    car, _ws = keyed
    url = f"http://127.0.0.1:{car.http_port}/v1/search"
    body = {"input": "choc", "mode": "lexical", "k": 3}
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    assert httpx.post(url, json=body, headers={"authorization": f"Bearer {WRONG}"}, timeout=30).status_code == 401
    ok = httpx.post(url, json=body, headers={"x-api-key": KEY}, timeout=30)
    assert ok.status_code == 200 and ok.json()["data"][0]["hits"]


def test_a_missing_key_is_named_in_each_transports_words(keyed: tuple[Sidecar, str]) -> None:
    """gRPC names its metadata; HTTP its headers (Authorization: Bearer, x-api-key), never gRPC's metadata;
    the demo's websocket the page's ?api_key= too. A wrong key is "wrong API key" everywhere."""
    import grpc
    import httpx
    from websockets.sync.client import connect

    from embedcar_client.proto import embedcar_pb2 as pb
    from embedcar_client.wire import API_KEY, SERVICE

    car, ws_url = keyed
    embed = pb.EmbedRequest(texts=["oat milk"]).SerializeToString()
    with grpc.insecure_channel(car.grpc_target) as channel:
        for key in (None, WRONG):
            with pytest.raises(grpc.RpcError) as got:
                channel.unary_unary(f"/{SERVICE}/Embed")(embed, timeout=30,
                                                         metadata=((API_KEY, key),) if key else None)
            assert got.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert got.value.details() == ("missing API key (send metadata x-api-key)" if key is None
                                           else "wrong API key")

    base = f"http://127.0.0.1:{car.http_port}"
    for path, body in (("/v1/embeddings", {"input": "oat milk"}), ("/v1/search", {"input": "oat", "k": 3})):
        missing = httpx.post(base + path, json=body, timeout=30)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        message = missing.json()["error"]["message"]
        assert message == "missing API key (send header Authorization: Bearer <key>, or x-api-key: <key>)", path
        assert "metadata" not in message
        wrong = httpx.post(base + path, json=body, headers={"authorization": f"Bearer {WRONG}"}, timeout=30)
        assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "wrong API key"

    with connect(ws_url, proxy=None, open_timeout=30) as ws:
        error = json.loads(ws.recv(timeout=30))["error"]
    assert error["code"] == "unauthenticated" and "?api_key=<key>" in error["message"], error
    assert "metadata" not in error["message"]


def test_a_missing_key_on_keyed_gets_names_the_http_headers(keyed: tuple[Sidecar, str]) -> None:
    import httpx

    car, _ws = keyed
    for path in ("/v1/models", "/metrics"):
        missing = httpx.get(f"http://127.0.0.1:{car.http_port}{path}", timeout=30)
        assert missing.status_code == 401
        assert "Authorization: Bearer" in missing.json()["error"]["message"], path
