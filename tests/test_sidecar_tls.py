"""The sidecar's own ports beyond loopback: TLS on gRPC and HTTP (mutual TLS where a client CA is set),
a start-up error instead of plaintext, loopback unchanged; the demo's web server likewise. Certificates
are made at test time (`embedcar triton certs`' code); none is committed."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from demo_ui.server import build_server
from embedcar_client.client import Client, ClientTls
from embedcar_settings import DemoSettings, Settings
from inference.backends.onnx import OnnxBackend
from inference.errors import FailedPrecondition, Unavailable
from inference.triton.certs import PoolFiles, make_pool_certs
from sidecar.app import Sidecar, SidecarThread
from sidecar.tls import server_tls
from tests.fixtures_sidecar import sidecar_settings

KEY = "tls-test-key-0123456789"
ANY = "0.0.0.0"  # beyond loopback: every interface of this test host


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> PoolFiles:
    return make_pool_certs(tmp_path_factory.mktemp("pki"), ["sidecar-host"], ["search-node"])


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> PoolFiles:
    return make_pool_certs(tmp_path_factory.mktemp("other-pki"), ["sidecar-host"], ["search-node"])


def _verify(pool: PoolFiles, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """An HTTPS client context trusting `pool`'s CA, presenting `cert` where given."""
    ctx = ssl.create_default_context(cafile=str(pool.ca_cert))
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def _tls_settings(settings: Settings, pool: PoolFiles, **changes: object) -> Settings:
    cert, key = pool.hosts["sidecar-host"]
    return sidecar_settings(settings, host=ANY, api_keys=f"shop={KEY}", tls_cert_file=cert, tls_key_file=key,
                            **changes)


@pytest.fixture(scope="module")
def tls_sidecar(settings: Settings, pool: PoolFiles, onnx_backend: OnnxBackend) -> Iterator[Sidecar]:
    with SidecarThread(_tls_settings(settings, pool), backend=onnx_backend) as sc:
        yield sc


def test_beyond_loopback_grpc_and_http_serve_tls(tls_sidecar: Sidecar, pool: PoolFiles) -> None:
    target = f"127.0.0.1:{tls_sidecar.grpc_port}"  # the certificate names localhost and 127.0.0.1 too
    with Client(target, api_key=KEY, tls=ClientTls(pool.ca_cert)) as c:
        assert c.embed(["oat milk"]).embeddings.shape == (1, 384)
    r = httpx.post(f"https://127.0.0.1:{tls_sidecar.http_port}/v1/embeddings", json={"input": "oat milk"},
                   headers={"Authorization": f"Bearer {KEY}"}, verify=_verify(pool))
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


def test_plaintext_and_unknown_ca_clients_are_refused_and_the_sidecar_keeps_serving(
        tls_sidecar: Sidecar, pool: PoolFiles, foreign: PoolFiles) -> None:
    target = f"127.0.0.1:{tls_sidecar.grpc_port}"
    with Client(target, api_key=KEY) as plain, pytest.raises(Unavailable):
        plain.embed(["oat milk"], timeout_s=10)
    with Client(target, api_key=KEY, tls=ClientTls(foreign.ca_cert)) as wrong_ca, pytest.raises(Unavailable):
        wrong_ca.embed(["oat milk"], timeout_s=10)  # the sidecar's certificate does not verify
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://127.0.0.1:{tls_sidecar.http_port}/v1/embeddings", json={"input": "oat milk"},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    with Client(target, api_key=KEY, tls=ClientTls(pool.ca_cert)) as c:
        assert c.embed(["still serving"]).embeddings.shape == (1, 384)
    assert tls_sidecar.serving


def test_mutual_tls_admits_only_certificates_from_the_client_ca(
        settings: Settings, pool: PoolFiles, foreign: PoolFiles, onnx_backend: OnnxBackend) -> None:
    s = _tls_settings(settings, pool, tls_client_ca_file=pool.ca_cert)
    cert, key = pool.clients["search-node"]
    other_cert, other_key = foreign.clients["search-node"]
    with SidecarThread(s, backend=onnx_backend) as sc:
        target = f"127.0.0.1:{sc.grpc_port}"
        with Client(target, api_key=KEY, tls=ClientTls(pool.ca_cert, cert, key)) as c:
            assert c.embed(["greek yogurt"]).embeddings.shape == (1, 384)
        for tls in (ClientTls(pool.ca_cert), ClientTls(pool.ca_cert, other_cert, other_key)):
            with Client(target, api_key=KEY, tls=tls) as refused, pytest.raises(Unavailable):
                refused.embed(["greek yogurt"], timeout_s=10)
        url = f"https://127.0.0.1:{sc.http_port}/v1/embeddings"
        ok = httpx.post(url, json={"input": "x"}, headers={"Authorization": f"Bearer {KEY}"},
                        verify=_verify(pool, cert, key))
        assert ok.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.post(url, json={"input": "x"}, headers={"Authorization": f"Bearer {KEY}"},
                       verify=_verify(pool), timeout=10)
        # The sidecar's own listener check presents no certificate: the handshake's answer is its answer.
        check, task = sc.listener_check, sc._listener_task
        assert check is not None and task is not None and {lst.tls for lst in check.listeners} == {True}
        assert asyncio.run_coroutine_threadsafe(check.check_once(), task.get_loop()).result(30)
        assert sc.serving


def test_beyond_loopback_without_a_certificate_is_a_start_up_error(settings: Settings, pool: PoolFiles) -> None:
    s = sidecar_settings(settings, host=ANY, api_keys=f"shop={KEY}")
    with pytest.raises(FailedPrecondition, match=r"sidecar\.tls_cert_file"):
        Sidecar(s)
    cert = pool.hosts["sidecar-host"][0]
    other_key = pool.clients["search-node"][1]
    with pytest.raises(FailedPrecondition, match=r"sidecar\.tls_key_file does not belong"):
        Sidecar(sidecar_settings(settings, host=ANY, api_keys=f"shop={KEY}", tls_cert_file=cert,
                                 tls_key_file=other_key))
    with pytest.raises(FailedPrecondition, match=r"sidecar\.tls_key_file"):
        Sidecar(sidecar_settings(settings, host=ANY, api_keys=f"shop={KEY}", tls_cert_file=cert))
    # The explicit opt-out (TLS ends in a proxy in front), and loopback, serve plaintext.
    assert server_tls("sidecar", ANY, None, None, plaintext_beyond_loopback=True) is None
    assert server_tls("sidecar", "127.0.0.1", None, None) is None
    assert server_tls("sidecar", "::1", None, None) is None


def test_a_key_never_shows_in_the_settings_repr(pool: PoolFiles) -> None:
    cert, key = pool.hosts["sidecar-host"]
    tls = server_tls("sidecar", ANY, cert, key)
    assert tls is not None and "PRIVATE KEY" not in repr(tls) and str(key) in repr(tls)


def test_the_demo_serves_https_beyond_loopback(pool: PoolFiles) -> None:
    from fastapi import FastAPI

    app = FastAPI()
    with pytest.raises(FailedPrecondition, match=r"demo\.tls_cert_file"):
        build_server(app, DemoSettings(host=ANY), port=0)
    cert, key = pool.hosts["sidecar-host"]
    server = build_server(app, DemoSettings(host=ANY, tls_cert_file=cert, tls_key_file=key), port=0)
    assert server.config.is_ssl
    assert not build_server(app, DemoSettings(), port=0).config.is_ssl  # loopback: as before
    assert not build_server(app, DemoSettings(host=ANY, plaintext_beyond_loopback=True), port=0).config.is_ssl

