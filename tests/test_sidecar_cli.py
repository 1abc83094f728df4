"""`embedcar sidecar serve` as a real process: serves, then exits cleanly on SIGTERM; cache warm-up."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedcar_client.client import Client
from embedcar_settings import Settings
from inference.errors import Unavailable
from inference.ports import free_port
from sidecar.allocator import library
from sidecar.app import SidecarThread
from sidecar.cpu_slice import get_slice_ns
from tests.conftest import ROOT
from tests.fixtures_sidecar import ProbeBackend, sidecar_settings


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until gRPC health says SERVING (open without a key, unlike Embed)."""
    end = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise Unavailable(f"sidecar exited with {proc.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise Unavailable(f"sidecar at {target} not serving after {timeout_s:.0f} s")


@pytest.mark.slow
def test_serve_until_sigterm(settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inference.cli_main", "sidecar", "serve", "--grpc-port", str(port),
             "--http-port", "-1", "--models-dir", str(settings.model.models_dir), "--threads", "1"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={"EMBEDCAR_SIDECAR_API_KEYS": "t=serve-key-0123456789",
                                                                 "PATH": "/usr/bin:/bin"})
        try:
            wait_serving(f"127.0.0.1:{port}", proc, timeout_s=120)
            with Client(f"127.0.0.1:{port}", api_key="serve-key-0123456789") as c:
                assert c.embed(["served"]).embeddings.shape == (1, 384)
            # Every thread (the model's and gRPC's, started after the slice was set) asks for 0.1 ms,
            # where the kernel keeps custom slices (sidecar/cpu_slice.py; the log says which).
            slices = {get_slice_ns(int(t.name)) for t in Path(f"/proc/{proc.pid}/task").iterdir()}
            said = log.read_text()
            assert "CPU slice: " in said
            if "CPU slice: not set" not in said:
                assert slices == {100_000}
            # mimalloc is its malloc where installed: started again with it preloaded (sidecar/allocator.py).
            mimalloc = library("auto")
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            assert ("libmimalloc" in maps) == (mimalloc is not None)
            assert f"allocator: {mimalloc or 'the C library'}" in said
            proc.terminate()
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert "sidecar ready" in text
    assert "heap settled" in text  # its own process: the startup heap frozen out of full collections
    assert "serve-key-0123456789" not in text  # settings are logged with secrets redacted


def test_cache_warm_up_from_file(settings: Settings, probe_backend: ProbeBackend, tmp_path: Path) -> None:
    top = tmp_path / "top_queries.txt"
    top.write_text("milk\nbananas\n\nfree range eggs\n")
    with SidecarThread(sidecar_settings(settings, http_port=-1, warm_queries_file=top),
                       backend=probe_backend) as sc, Client(sc.grpc_target) as c:
        calls = probe_backend.calls
        assert c.embed(["milk", "Bananas", "free range eggs"]).cache_hits == [True, True, True]
        assert probe_backend.calls == calls
