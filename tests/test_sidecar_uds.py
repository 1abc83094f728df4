"""gRPC over the sidecar's Unix socket (sidecar.uds_path): same answers and auth as TCP, socket file lifecycle.

Real sidecars (the session's ORT backend, no HTTP facade) and real gRPC over a real socket file.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from embedcar_client.client import AsyncClient, Client
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.errors import InvalidInput, Unauthenticated, Unavailable
from sidecar.app import SidecarThread
from tests.fixtures_sidecar import sidecar_settings
from tests.test_sidecar_reliability import health

KEY = "uds-key-5e4d3c2b1a"
QUERIES = ["oat milk", "free range eggs dozen", "dark chocolate sea salt 100g", "basmati rice 2 lb"]


@pytest.fixture
def sock() -> Iterator[Path]:
    """A socket path in a fresh short folder (sun_path holds at most 107 bytes; tmp_path can be long)."""
    with tempfile.TemporaryDirectory(prefix="ecuds-") as d:
        yield Path(d) / "run" / "grpc.sock"  # `run/` does not exist yet: the sidecar creates it


async def async_embed(target: str, texts: list[str]) -> np.ndarray:
    async with AsyncClient(target) as c:
        return (await c.embed(texts)).embeddings


def uds_settings(settings: Settings, path: Path, **changes: object) -> Settings:
    return sidecar_settings(settings, http_port=-1, uds_path=path, **changes)


def test_setting_from_environment() -> None:
    env = Settings.load(environ={"EMBEDCAR_SIDECAR_UDS_PATH": "/run/embedcar/grpc.sock"})
    assert env.sidecar.uds_path == Path("/run/embedcar/grpc.sock")
    assert Settings.load(environ={"EMBEDCAR_SIDECAR_UDS_PATH": ""}).sidecar.uds_path is None
    assert Settings.load(environ={}).sidecar.uds_path is None


def test_embed_over_socket_equals_tcp(settings: Settings, onnx_backend: OnnxBackend, sock: Path) -> None:
    # No cache: both transports get a real inference, not the other's cached answer.
    with SidecarThread(uds_settings(settings, sock, cache_entries=0), backend=onnx_backend) as sc:
        assert sc.uds_target == f"unix:{sock}"
        mode = sock.stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660, oct(mode)
        with Client(sc.grpc_target) as tcp, Client(f"unix:{sock}") as uds:
            for texts in (QUERIES[:1], QUERIES):
                over_tcp, over_uds = tcp.embed(texts), uds.embed(texts)
                assert over_uds.cache_hits == [False] * len(texts)
                assert over_uds.model == over_tcp.model
                np.testing.assert_allclose(over_uds.embeddings, over_tcp.embeddings, atol=1e-6)
            ref = tcp.embed(QUERIES[1:2]).embeddings
        np.testing.assert_allclose(asyncio.run(async_embed(f"unix://{sock}", QUERIES[1:2])), ref,  # unix:///abs
                                   atol=1e-6)
        assert health(f"unix:{sock}") == health_pb2.HealthCheckResponse.SERVING
    assert not sock.exists(), "the socket file is removed on stop"


def test_auth_applies_over_socket(settings: Settings, onnx_backend: OnnxBackend, sock: Path) -> None:
    with SidecarThread(uds_settings(settings, sock, api_keys=f"shop={KEY}"), backend=onnx_backend) as sc:
        assert sc.uds_target is not None
        with Client(sc.uds_target) as anon, pytest.raises(Unauthenticated, match="missing"):
            anon.embed(["milk"])
        with Client(sc.uds_target, api_key="wrong-key") as wrong, pytest.raises(Unauthenticated, match="wrong"):
            wrong.embed(["milk"])
        with Client(sc.uds_target, api_key=KEY) as ok:
            assert ok.embed(["milk"]).embeddings.shape == (1, 384)


def test_stale_socket_is_replaced(settings: Settings, onnx_backend: OnnxBackend, sock: Path) -> None:
    sock.parent.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as crashed:
        crashed.bind(str(sock))  # closed without unlinking: what a killed process leaves behind
    (sock.parent / "stale").hardlink_to(sock)  # keeps the old inode allocated, so a new file gets another
    stale = sock.lstat().st_ino
    with SidecarThread(uds_settings(settings, sock), backend=onnx_backend) as sc, Client(f"unix:{sock}") as c:
        assert sock.lstat().st_ino != stale
        assert c.embed(["milk"]).embeddings.shape == (1, 384)
        assert sc.uds_target == f"unix:{sock}"
    assert not sock.exists()


def test_live_socket_is_not_taken_over(settings: Settings, onnx_backend: OnnxBackend, sock: Path) -> None:
    sock.parent.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(sock))
        other.listen(1)
        with pytest.raises(Unavailable, match="another process"), \
                SidecarThread(uds_settings(settings, sock), backend=onnx_backend):
            pass
        assert sock.exists()  # still the other server's


def test_regular_file_at_the_path_is_refused(settings: Settings, onnx_backend: OnnxBackend, sock: Path) -> None:
    sock.parent.mkdir()
    sock.write_text("not a socket\n")
    with pytest.raises(InvalidInput, match="exists and is not a socket"), \
            SidecarThread(uds_settings(settings, sock), backend=onnx_backend):
        pass
    assert sock.read_text() == "not a socket\n", "the file is left alone"


def test_a_bare_name_serves_in_the_private_runtime_folder(settings: Settings, onnx_backend: OnnxBackend,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory(prefix="ecrun-") as d:
        runtime = Path(d) / "runtime"
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        path = runtime / "embedcar" / "grpc.sock"
        with SidecarThread(uds_settings(settings, Path("grpc.sock")), backend=onnx_backend) as sc:
            assert sc.uds_target == f"unix:{path}"
            assert stat.S_IMODE((runtime / "embedcar").stat().st_mode) == 0o700
            with Client(sc.uds_target) as c:
                assert c.embed(["milk"]).embeddings.shape == (1, 384)
        assert not path.exists()


def test_a_world_writable_sticky_folder_is_refused_at_start(settings: Settings, onnx_backend: OnnxBackend,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A /tmp-like folder (sticky, anyone may write; another user's where the test can make one): anyone
    could bind the name before the sidecar. Start-up fails naming the folder and the private default."""
    with tempfile.TemporaryDirectory(prefix="ecuds-") as d:
        monkeypatch.setenv("XDG_RUNTIME_DIR", f"{d}/runtime")
        shared = Path(d) / "shared"
        shared.mkdir()
        if os.getuid() == 0:
            os.chown(shared, 65534, -1)
        shared.chmod(0o1777)
        with pytest.raises(InvalidInput, match=rf"refusing to serve on Unix socket {shared}/grpc.sock: {shared} may be "
                           r"written by others \(mode 1777: sticky.*"
                           rf"uds_path=grpc.sock serves in {re.escape(d)}/runtime/embedcar"), \
                SidecarThread(uds_settings(settings, shared / "grpc.sock"), backend=onnx_backend):
            pass
        assert not list(shared.iterdir())
