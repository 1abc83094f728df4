"""`embedcar bench gpu` (loadtest/bench/gpu.py) where no GPU is: its plan, its refusal, what travels.

The check itself runs on a lent GPU machine (docs/gpu.md); here it must say what it would do, refuse at
once without a GPU, and keep the working tree and the bundle under the device tool's limit.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.bench import gpu

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadtest.bench.gpu", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_dry_run_prints_the_plan_and_the_bundle_without_a_gpu() -> None:
    p = _check("--dry-run", "--out", "reports/gpu-dry")
    assert p.returncode == 0, p.stderr
    for row in gpu.ROWS:
        assert row.label in p.stdout
    assert "pytest -m gpu" in p.stdout and "minilm" in p.stdout and "modernbert" in p.stdout
    assert gpu.TRITON_ARCHIVE in p.stdout and "tritonclient" in p.stdout
    assert "MiB limit" in p.stdout
    assert not (ROOT / "reports/gpu-dry").exists()  # a dry run writes nothing


@pytest.mark.skipif(gpu.gpu_missing() is None, reason="this machine has a GPU: the refusal is not reachable")
def test_without_a_gpu_the_check_refuses_at_once_in_one_line(tmp_path: Path) -> None:
    t0 = time.monotonic()
    p = _check("--out", str(tmp_path / "out"))
    assert p.returncode == gpu.EXIT_NO_GPU
    assert time.monotonic() - t0 < 30
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU" in lines[0], p.stderr
    assert not (tmp_path / "out").exists()


def test_tree_and_bundle_stay_under_the_travel_limit() -> None:
    bundle = gpu.planned_bundle(ROOT / gpu.BUNDLE_DIR)
    if not bundle["built"] and not gpu.triton_members():
        pytest.skip("no bundle built and no nvidia-pytriton here to plan one from (make install; make gpu-bundle)")
    # Not built here (make gpu-bundle downloads wheels): the plan's estimates stand in for its sizes.
    tree = gpu.tree_bytes(ROOT)
    assert tree + bundle["total_bytes"] <= gpu.TRAVEL_LIMIT, (
        f"tree {tree / MiB:.1f} MiB + bundle {bundle['total_bytes'] / MiB:.1f} MiB"
        f" ({'built' if bundle['built'] else 'planned'}) exceed {gpu.TRAVEL_LIMIT / MiB:.0f} MiB")


def test_the_bundle_leaves_out_what_the_server_does_not_load() -> None:
    names = [n for _, n in gpu.triton_members()]
    if not names:
        pytest.skip("nvidia-pytriton is not installed here")
    assert "pytriton/tritonserver/bin/tritonserver" in names
    assert f"pytriton/tritonserver/python_backend_stubs/{gpu.DEVICE_PYTHON}/triton_python_backend_stub" in names
    assert any("libtritonserver" in n for n in names)
    assert not any("libpython" in n for n in names)  # another stub's 32 MB interpreter


@pytest.mark.parametrize(("target", "command"), [
    ("gpu-check", "-m loadtest.bench.gpu --out"),
    ("gpu-bundle", "-m loadtest.bench.gpu --build-bundle"),
])
def test_make_targets_name_the_commands(target: str, command: str) -> None:
    p = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert command in p.stdout


def test_bench_gpu_is_an_embedcar_bench_area() -> None:
    p = subprocess.run([sys.executable, "-m", "inference.cli_main", "bench", "gpu", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "--dry-run" in p.stdout and "--budget" in p.stdout
