"""sidecar.listeners: the open-files limit raised, connection caps kept under it, and one health truth: a
listener the sidecar serves that stops answering new connections turns HTTP /health, gRPC health and the
metrics NOT_SERVING, and one that stays silent ends `sidecar serve` (exit 70) for its supervisor to restart.

A dead listener is made for real: a socket that listens but is never accepted from (the kernel completes
the TCP handshake, nothing ever answers: what a server whose accept loop stopped looks like), and a
`sidecar serve` process whose Unix socket file is removed from under it.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedcar_client.client import Client
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from sidecar.app import Sidecar, SidecarThread
from sidecar.listeners import RESERVED_FILES, ConnectionCaps, Listener, ListenerCheck, answers, connection_caps
from tests.conftest import ROOT
from tests.fixtures_sidecar import sidecar_settings


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose connections complete in the kernel and are never accepted or answered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield int(s.getsockname()[1])


def test_caps_fit_under_the_open_files_limit() -> None:
    assert connection_caps(100_000, 1000, 1024, http_on=True) == ConnectionCaps(1000, 1024)  # room for both
    small = connection_caps(512, 1000, 1024, http_on=True)
    assert small.grpc + small.http <= 512 - RESERVED_FILES and small.grpc >= 8 and small.http >= 8
    assert connection_caps(512, 1000, 1024, http_on=False).grpc <= 512 - RESERVED_FILES


def test_the_soft_open_files_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    code = "from sidecar.listeners import raise_open_files_limit as r; import resource; " \
           "print(r(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    got, now = map(int, out.stdout.split())
    assert got == now == (hard if hard != resource.RLIM_INFINITY else max(low, 1 << 20)), (soft, hard, out.stdout)


async def test_a_listener_that_never_answers_is_found_and_one_that_answers_is_not(silent_port: int) -> None:
    started = time.monotonic()
    assert not await answers(Listener("grpc", "127.0.0.1", silent_port, "h2"), timeout_s=0.5)
    assert time.monotonic() - started < 5
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed = int(free.getsockname()[1])  # bound, not listening: refused
    assert not await answers(Listener("http", "127.0.0.1", closed, "http1"), timeout_s=0.5)


@pytest.fixture
def served(settings: Settings, onnx_backend: OnnxBackend, tmp_path: Path) -> Iterator[Sidecar]:
    with SidecarThread(sidecar_settings(settings, uds_path=tmp_path / "run" / "embedcar.sock",
                                        listener_dead_s=0), backend=onnx_backend) as sc:
        yield sc


def _grpc_health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status)


def test_every_listener_answers_the_check(served: Sidecar) -> None:
    check = served.listener_check
    assert check is not None
    assert {lst.name for lst in check.listeners} == {"grpc", "uds", "http"}
    assert asyncio.run_coroutine_threadsafe(check.check_once(), _running_loop(served)).result(30)
    value = served.metrics.registry.get_sample_value
    assert all(value("embedcar_listener_up", {"listener": n}) == 1 for n in ("grpc", "uds", "http"))


def _running_loop(sc: Sidecar) -> asyncio.AbstractEventLoop:
    task = sc._listener_task
    assert task is not None
    return task.get_loop()


def test_a_silent_listener_turns_every_health_surface_not_serving_until_it_answers(served: Sidecar,
                                                                                  silent_port: int) -> None:
    """One listener that accepts nothing: HTTP /health 503, gRPC health NOT_SERVING, the metrics 0, on the
    listeners that still answer; once it answers again, SERVING everywhere."""
    check = served.listener_check
    assert check is not None
    loop = _running_loop(served)
    healthy = list(check.listeners)
    check.listeners = [*healthy, Listener("grpc", "127.0.0.1", silent_port, "h2")]
    check.timeout_s = 0.5
    assert not asyncio.run_coroutine_threadsafe(check.check_once(), loop).result(30)
    http = f"http://127.0.0.1:{served.http_port}/health"
    deadline = time.monotonic() + 10
    while served.serving and time.monotonic() < deadline:  # published by a task on the loop
        time.sleep(0.05)
    assert httpx.get(http, timeout=10).status_code == 503
    assert _grpc_health(served.grpc_target) == health_pb2.HealthCheckResponse.NOT_SERVING
    value = served.metrics.registry.get_sample_value
    assert value("embedcar_serving", {}) == 0 and value("embedcar_listener_up", {"listener": "grpc"}) == 0
    check.listeners = healthy
    assert asyncio.run_coroutine_threadsafe(check.check_once(), loop).result(30)
    deadline = time.monotonic() + 10
    while not served.serving and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(http, timeout=10).status_code == 200
    assert _grpc_health(served.grpc_target) == health_pb2.HealthCheckResponse.SERVING
    assert value("embedcar_serving", {}) == 1


async def test_a_listener_silent_past_its_limit_is_reported_once(silent_port: int) -> None:
    dead: list[str] = []
    changes: list[bool] = []
    check = ListenerCheck([Listener("grpc", "127.0.0.1", silent_port, "h2")], dead_after_s=0.2,
                          on_change=changes.append, on_dead=dead.append, timeout_s=0.3)
    for _ in range(3):
        assert not await check.check_once()
    assert changes == [False]
    [message] = dead
    assert f"grpc 127.0.0.1:{silent_port}" in message and "sidecar.listener_dead_s" in message


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_serve_exits_70_when_its_unix_socket_stays_unreachable(settings: Settings, tmp_path: Path,
                                                               event_loop: str) -> None:
    """The socket file removed from under a running `sidecar serve` (a /tmp cleaner, a wrong script): its
    Unix listener is gone for good, so the process says so in one line and exits for a restart. On either
    event loop, having served an Embed on the socket first."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    sock = folder / "embedcar.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDCAR_")}
    env |= {"EMBEDCAR_SIDECAR_LISTENER_DEAD_S": "1", "EMBEDCAR_SIDECAR_POLL_S": "0",
            "EMBEDCAR_SIDECAR_EVENT_LOOP": event_loop}
    proc = subprocess.Popen([sys.executable, "-m", "inference.cli_main", "sidecar", "serve",
                             "--models-dir", str(settings.model.models_dir), "--variant", "fp32", "--threads", "1",
                             "--grpc-port", "0", "--http-port", "0", "--uds-path", str(sock)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("sidecar ready"):
                break
        assert sock.exists(), "".join(lines)
        with Client(f"unix:{sock}") as c:
            assert c.embed(["oat milk"], timeout_s=30).embeddings.shape[0] == 1
        sock.unlink()
        rc = proc.wait(timeout=60)
        rest = proc.stdout.read()
    finally:
        proc.kill()
    assert rc == 70, rest
    said = [line for line in rest.splitlines() if "has not answered a new connection" in line]
    assert len(said) == 1 and str(sock) in said[0], rest
    assert "Traceback" not in rest
