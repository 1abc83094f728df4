"""TritonServer start-up when its ports are contested: real tritonserver, real sockets in the way.

A port can be taken between choosing it and tritonserver binding it, or another process can answer
on it (even "ready"). Start-up must notice (the port is not this tritonserver's), retry on fresh
ports when it chose them, and name the port when the caller gave it.
"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from inference.errors import Unavailable
from inference.settings import Settings
from inference.triton.launcher import BindFailure, TritonServer
from tests.components import require_triton
from tests.fixtures_triton import triton_settings

KIND_NAMES = {"grpc": "gRPC", "http": "HTTP", "metrics": "metrics"}


class _Ready(http.server.BaseHTTPRequestHandler):
    """A foreign server that claims to be a ready Triton on every path."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def foreign_ready() -> Iterator[int]:
    """Port of an HTTP server answering 200 to everything (e.g. /v2/health/ready)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port some other socket listens on (never accepts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


class CountingServer(TritonServer):
    """Records each start attempt; `first_grpc` replaces the first automatically chosen gRPC port(s)."""

    def __init__(self, *args: object, first_grpc: int | None = None, times: int = 1, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.first_grpc = first_grpc
        self.times = times
        self.picks: list[dict[str, int]] = []
        self.launched: list[int] = []

    def _pick_ports(self, kinds: Sequence[str]) -> dict[str, int]:
        ports = super()._pick_ports(kinds)
        if self.first_grpc is not None and len(self.picks) < self.times and "grpc" in ports:
            ports["grpc"] = self.first_grpc
        self.picks.append(dict(ports))
        return ports

    def _launch(self) -> None:
        self.launched.append(self.grpc_port)
        super()._launch()


@pytest.fixture
def tsettings(settings: Settings, model_dir: Path, tmp_path: Path) -> Settings:
    require_triton()
    return triton_settings(settings, tmp_path)


@pytest.mark.triton
@pytest.mark.parametrize("kind", ["grpc", "http", "metrics"])
def test_a_given_port_held_by_a_ready_looking_server_is_a_clear_error(
        tsettings: Settings, foreign_ready: int, kind: str) -> None:
    server = CountingServer(tsettings, variant="fp32", **{f"{kind}_port": foreign_ready})
    with pytest.raises(Unavailable) as info:
        server.start()
    assert isinstance(info.value, BindFailure) and info.value.kinds == {kind}
    msg = info.value.message
    assert f"{KIND_NAMES[kind]} port 127.0.0.1:{foreign_ready} (given)" in msg and "already in use" in msg
    assert len(server.launched) == 1  # a port the caller gave is not swapped for another
    assert not server.running()


@pytest.mark.triton
def test_an_automatic_port_taken_before_bind_is_retried_on_fresh_ports(
        tsettings: Settings, busy_port: int, caplog: pytest.LogCaptureFixture) -> None:
    server = CountingServer(tsettings, variant="fp32", first_grpc=busy_port)
    try:
        server.start()
        assert server.launched[0] == busy_port and len(server.launched) == 2
        assert server.grpc_port not in (0, busy_port)
        assert server.running() and server.answers()
        assert f"gRPC port 127.0.0.1:{busy_port} (chosen automatically)" in caplog.text
    finally:
        server.stop()


@pytest.mark.triton
def test_retries_are_bounded(tsettings: Settings, busy_port: int) -> None:
    server = CountingServer(tsettings, variant="fp32", first_grpc=busy_port, times=99)
    server.start_attempts = 2
    with pytest.raises(BindFailure, match=f"127.0.0.1:{busy_port}"):
        server.start()
    assert server.launched == [busy_port, busy_port]
    assert not server.running()


def test_an_exit_with_a_bind_error_in_the_log_names_the_port(settings: Settings, tmp_path: Path) -> None:
    # Triton 2.51's own lines when its gRPC port is taken after start-up checked it (the process exits).
    log = tmp_path / "tritonserver.log"
    log.write_text("I1201 08:37:49.1 main.cc:100] an earlier run's line: failed to start HTTP service\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write("E1201 08:37:53.155707579 3915 chttp2_server.cc:1060] UNKNOWN:No address added out of total 1 "
                "resolved for '127.0.0.1:59695' {children:[UNKNOWN:Address already in use {errno:98}]}\n"
                "E1201 08:37:53.159390 3915 main.cc:245] \"failed to start GRPC service: Unavailable - Socket "
                "'127.0.0.1:59695' already in use \"\n")
    server = TritonServer(triton_settings(settings, tmp_path), grpc_port=59695, log_file=log)
    server._log_offset = offset  # as start() records it: only this attempt's lines count
    err = server._exit_failure()
    assert isinstance(err, BindFailure) and err.kinds == {"grpc"}  # the earlier run's HTTP line is ignored
    assert "gRPC port 127.0.0.1:59695 (given)" in err.message
    server._log_offset = 0
    assert server._exit_failure().kinds == {"grpc", "http"}  # type: ignore[attr-defined]
