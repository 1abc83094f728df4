"""pytest fixtures for the Triton tests (loaded by tests/conftest.py).

One real tritonserver from the nvidia-pytriton wheel serves the whole test run (`_triton_session`),
in its own temporary repository and backend folder and on free loopback ports, so parallel test
runs on the same machine do not collide. `triton_server` hands it to each test after checking it
still answers: a server that a test killed, or that crashed, is restarted instead of failing every
later test with "connection refused". Read `grpc_url` from the fixture in each test: a restart may
have moved a port that was taken meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.settings import Settings
from inference.triton.launcher import TritonServer
from tests.components import require_triton


def triton_settings(settings: Settings, root: Path) -> Settings:
    """The session settings with a private repository/backend folder under `root`."""
    return settings.with_section("triton", repo_dir=root / "repo")


@pytest.fixture(scope="session")
def _triton_session(settings: Settings, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[TritonServer]:
    require_triton()
    s = triton_settings(settings, tmp_path_factory.mktemp("triton"))
    server = TritonServer(s, variant="fp32")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def triton_server(_triton_session: TritonServer) -> TritonServer:
    """The shared server, alive and answering over gRPC (restarted first if it was not)."""
    return _triton_session.ensure_running()


@pytest.fixture
def own_triton(settings: Settings, model_dir: Path, tmp_path: Path) -> Iterator[TritonServer]:
    """A tritonserver of the test's own on fresh ports (the ones a test may kill), stopped after it."""
    require_triton()
    server = TritonServer(triton_settings(settings, tmp_path), variant="fp32")
    server.start()
    try:
        yield server
    finally:
        server.stop()
