"""A new version of a served model rolled out with its index, then rolled back, under load: not one
reply in which the query vector and the index it searched come from different model versions.

Real processes throughout: a sidecar serving Search from an index root (embedded backend, then a
real tritonserver), the real `embedcar model prepare` / `catalog build` / `model rollback` commands
run as a team would run them, and a load of Search calls going on from before the first change to
after the last.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from embedcar_client.client import Client
from embedcar_settings import Settings
from inference.errors import EmbedcarError
from inference.manifest import load_manifest
from inference.triton.launcher import TritonServer
from sidecar.app import Sidecar, SidecarThread
from tests.components import require_triton
from tests.conftest import ROOT
from tests.fixtures_models import tiny_st_folder
from tests.fixtures_sidecar import sidecar_settings
from tests.fixtures_triton import triton_settings

NAME = "shop"
QUERIES = ["greek yogurt", "organic pasta sauce", "whole milk", "green tea", "fresh strawberries", "chicken broth"]


def _cli(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "inference.cli_main", *args], cwd=ROOT, capture_output=True,
                          text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _index_model(index_root: Path, version: str) -> str:
    """The model id an index version was built with (its manifest), read from disk, not from the sidecar."""
    return str(json.loads((index_root / version / "manifest.json").read_text())["model_id"])


def rolling_settings(settings: Settings, models: Path, index_root: Path, name: str) -> Settings:
    """A sidecar serving model `name`'s default variant from `models`, looking for new model and index
    versions every 0.2 s: a rollout's switch shows within a second."""
    s = sidecar_settings(settings, index_dir=index_root, poll_s=0.2, grace_s=0.5)
    return dataclasses.replace(s, model=dataclasses.replace(s.model, models_dir=models, name=name, variant=""))


class Load:
    """Search calls back to back from a thread until stopped; every reply and error recorded."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.replies: list[tuple[str, str]] = []  # (model version id, index version)
        self.backends: list[tuple[str, str]] = []  # (model version id, backend that computed it; "" = cache)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with Client(self.target) as c:
            i = 0
            while not self._stop.is_set():
                try:
                    r = c.search([QUERIES[i % len(QUERIES)]], k=3, timeout_s=30)
                    self.replies.append((r.model, r.index_version))
                    self.backends.append((r.model, r.backend))
                except EmbedcarError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                i += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def wait_for_model(self, version_id: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.replies and self.replies[-1][0] == version_id:
                return
            time.sleep(0.1)
        raise AssertionError(f"no reply from {version_id} within {timeout_s} s; last {self.replies[-1:]}")


@pytest.mark.slow
def test_rollout_and_rollback_under_load_never_mix_model_and_index(settings: Settings, tmp_path: Path) -> None:
    models, index_root = tmp_path / "models", tmp_path / "index"
    common = ["--models-dir", str(models), "--model", NAME]
    build = ["catalog", "build", "--limit", "200", "--index-root", str(index_root),
             "--no-progress", *common]
    # Week 1: the team's model and the index built with it.
    v1_src = tiny_st_folder(tmp_path / "v1", "bert", pooling="mean", seed=1)
    _cli("model", "prepare", "--from", str(v1_src), *common)
    _cli(*build)
    v1 = load_manifest(models / NAME)
    v1_id = v1.variant_id(v1.default_variant)
    with SidecarThread(rolling_settings(settings, models, index_root, NAME)) as sc, Load(sc.grpc_target) as load:
        load.wait_for_model(v1_id)
        # Week 2: a retrained model (other weights) is prepared; the sidecar warms it, but its
        # index does not exist yet: replies stay on v1 with v1's index meanwhile.
        v2_src = tiny_st_folder(tmp_path / "v2", "bert", pooling="mean", seed=2)
        _cli("model", "prepare", "--from", str(v2_src), *common)
        v2 = load_manifest(models / NAME)
        v2_id = v2.variant_id(v2.default_variant)
        assert v2_id != v1_id
        _wait(lambda: _candidate_warm(sc))
        before_index = len(load.replies)
        time.sleep(1.0)
        assert {m for m, _ in load.replies[before_index:]} == {v1_id}, "switched before the new index existed"
        _cli(*build)  # the catalog job builds v2's index: now the switch happens
        load.wait_for_model(v2_id)
        # Rollback: one command; v1's index versions are still in the root.
        _cli("model", "rollback", *common)
        load.wait_for_model(v1_id)
        time.sleep(0.5)
        # The retired version's series go once it has drained; the served one's stay.
        _wait(lambda: _versions_in_metrics(sc) == {v1_id})
    _assert_never_mixed(load, index_root, v1_id, v2_id)


def _assert_never_mixed(load: Load, index_root: Path, first: str, second: str) -> None:
    assert load.errors == []
    mixed = [(m, v) for (m, v) in Counter(load.replies) if _index_model(index_root, v) != m]
    assert mixed == [], f"replies whose index was built by another model version: {mixed}"
    models_seen = [m for m, _ in load.replies]
    assert models_seen.count(second) > 0 and models_seen[0] == models_seen[-1] == first
    assert len(load.replies) > 50


@pytest.mark.slow
@pytest.mark.triton
def test_rollout_and_rollback_behind_triton_never_mix_model_and_index(settings: Settings, tmp_path: Path) -> None:
    """The same week on a Triton pool: the sidecar computes on Triton, which is restarted with a
    repository of both versions (docs/models.md's recipe) while the sidecar serves; each version
    calls its own ensemble, and the embedded fallback computes the sidecar's own version meanwhile."""
    require_triton()
    models, index_root = tmp_path / "models", tmp_path / "index"
    common = ["--models-dir", str(models), "--model", NAME]
    build = ["catalog", "build", "--limit", "200", "--index-root", str(index_root), "--no-progress", *common]
    _cli("model", "prepare", "--from", str(tiny_st_folder(tmp_path / "v1", "bert", pooling="mean", seed=1)), *common)
    _cli(*build)
    v1 = load_manifest(models / NAME)
    v1_id = v1.variant_id(v1.default_variant)
    base = dataclasses.replace(settings, model=dataclasses.replace(settings.model, models_dir=models, name=NAME,
                                                                  variant=""))
    server = TritonServer(triton_settings(base, tmp_path / "triton"), models=(NAME,)).start()
    try:
        s = base.with_section("triton", urls=(server.grpc_url,), timeout_ms=10_000)
        s = sidecar_settings(s, backend="triton", http_port=-1, index_dir=index_root, poll_s=0.2,
                             grace_s=0.5)
        with SidecarThread(s) as sc, Load(sc.grpc_target) as load:
            load.wait_for_model(v1_id)
            _cli("model", "prepare", "--from", str(tiny_st_folder(tmp_path / "v2", "bert", pooling="mean", seed=2)),
                 *common)
            v2 = load_manifest(models / NAME)
            v2_id = v2.variant_id(v2.default_variant)
            # The pool restarted with both versions, on its ports: the sidecar's calls for v1 go to
            # its fallback meanwhile; v2 warms on Triton once it answers for it.
            server.stop()
            server = TritonServer(triton_settings(base, tmp_path / "triton"), models=(NAME, f"{NAME}.previous"),
                                  grpc_port=server.grpc_port, http_port=server.http_port,
                                  metrics_port=server.metrics_port).start()
            assert len(server.ensembles) == 2
            _wait(lambda: _candidate_warm(sc))
            _cli(*build)
            load.wait_for_model(v2_id)
            _cli("model", "rollback", *common)
            load.wait_for_model(v1_id)
    finally:
        server.stop()
    _assert_never_mixed(load, index_root, v1_id, v2_id)
    computed = Counter(load.backends)
    assert computed[(v2_id, "triton")] > 0 and computed[(v1_id, "triton")] > 0, computed


def _versions_in_metrics(sc: Sidecar) -> set[str]:
    """The model versions with series in the sidecar's metrics (what Prometheus would scrape)."""
    return {smp.labels["version"] for fam in text_string_to_metric_families(sc.metrics.render().decode())
            for smp in fam.samples if "version" in smp.labels}


def _candidate_warm(sc: Sidecar) -> bool:
    return bool(sc.rollout._candidates)


def _wait(cond: object, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
