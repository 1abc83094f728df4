"""`embedcar bench triton` against the session's real tritonserver, with the shared-memory path."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from embedcar_settings import Settings
from inference.triton.launcher import TritonServer
from loadtest.bench.triton import SHM_PATH, run

pytestmark = pytest.mark.triton


async def test_bench_times_every_path_and_leaves_no_shared_memory(settings: Settings,
                                                                   triton_server: TritonServer) -> None:
    # run() first checks that the shared-memory path returns the gRPC message's vectors (else Internal).
    report = await run(settings, triton_server.grpc_url, shapes=((1, 16),), reps=8, warmup=2, shm=True)
    paths = {r.path: r for r in report.results}
    assert set(paths) == {"raw ORT", "triton ensemble", SHM_PATH, "embedded"}
    assert all(r.n == 8 and 0 < r.p50_ms <= r.p95_ms for r in paths.values())
    assert report.steps_us["1x16"][triton_server.ensembles[0]]["compute_infer"] > 0  # Triton's own statistics were read
    region = Path(f"/dev/shm/embedcar-bench-{os.getpid()}")
    assert not await asyncio.to_thread(region.exists)  # unregistered and removed
