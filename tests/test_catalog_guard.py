"""The guarded publish: a build with too many bad rows, or far fewer items than the
current version, is written aside (held), not made current, and says why in one line; `--force`
publishes it and the manifest records that; a sidecar serving the root never swaps to a held version.

Real model, real FAISS, real catalog files in tmp_path, a real sidecar where the swap matters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from catalog import store
from catalog.job import BuildSummary, build, merge
from catalog.publish import KEEP_HELD, check_build, publish_index
from catalog.shards import SHARDS_DIR
from catalog.sources import BadRow, Loaded, Product
from catalog.spec import BuildSpec
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.errors import FailedPrecondition, InvalidInput
from tests.fixtures_catalog import catalog_settings_for


def write_csv(path: Path, titles: list[str], *, missing_id_every: int = 0) -> Path:
    """id,title rows; with `missing_id_every` k, every row but each k-th has an empty id."""
    lines = ["id,title"]
    for i, t in enumerate(titles):
        keep = not missing_id_every or i % missing_id_every == 0
        lines.append(f"{f'p{i}' if keep else ''},\"{t}\"")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def titles(grocery_slice: Loaded) -> list[str]:
    return [p.fields["title"] for p in grocery_slice.products]


def run_build(s: Settings, src: Path, backend: OnnxBackend, **kw: object) -> BuildSummary:
    return asyncio.run(build(s, BuildSpec(source=str(src)), backend=backend, progress=False, **kw))  # type: ignore[arg-type]


def bad_rows(n: int) -> list[BadRow]:
    return [BadRow(i + 2, "missing id") for i in range(n)]


# --- the checks themselves (no model) --------------------------------------------------------
def test_the_bad_row_limit_is_a_count_or_a_share_of_the_rows(settings: Settings, tmp_path: Path) -> None:
    s = catalog_settings_for(settings, tmp_path / "idx")  # defaults: 10 rows or 1 %, whichever allows more

    def failures(items: int, bad: int, **limits: object) -> tuple[str, ...]:
        return check_build(s.with_section("catalog", **limits), items=items, bad=bad_rows(bad), model_id="m").failures

    assert failures(1, 199) and "199 of 200 rows are bad" in failures(1, 199)[0]
    assert "line 2: missing id" in failures(1, 199)[0]
    assert not failures(3, 4)  # a small file's few broken rows: the count allows them
    assert not failures(990, 10) and failures(989, 11)  # 1 % of 1000 = 10
    assert not failures(4950, 50) and failures(4949, 51)  # above the count, the share decides
    assert failures(9996, 4, max_bad_share=0.0, max_bad_rows=3)  # a count alone
    assert failures(9990, 10, max_bad_rows=0, max_bad_share=0.0005)  # a share alone
    forced = check_build(s, items=1, bad=bad_rows(199), model_id="m", force=True)
    assert forced.failures and forced.servable and forced.to_manifest()["forced"] is True
    for limits in ({"max_bad_share": 1.5}, {"min_count_share": -0.1}, {"max_bad_rows": -1}):
        with pytest.raises(InvalidInput, match=next(iter(limits))):
            check_build(s.with_section("catalog", **limits), items=1, bad=[], model_id="m")


def publish_random(s: Settings, n: int, model_id: str = "m", **kw: object) -> Path:
    x = np.random.default_rng(n).standard_normal((n, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    products = [Product(f"p{i}", {"title": f"item {i}"}, i + 1) for i in range(n)]
    version, _ = publish_index(s, x, products, {"model_id": model_id}, index_type="flat", **kw)  # type: ignore[arg-type]
    return version


def test_held_versions_are_never_current_and_never_crowd_out_live_ones(settings: Settings, tmp_path: Path) -> None:
    s = catalog_settings_for(settings, tmp_path / "idx", use_gpu=False)
    live = [publish_random(s, 40), publish_random(s, 41)]
    drop = check_build(s, items=5, bad=[], model_id="m")
    assert drop.failures == (f"5 items, under min_count_share 50% of the 41 of the current version {live[-1].name}",)
    assert drop.current == live[-1].name and not drop.servable
    assert not check_build(s, items=21, bad=[], model_id="m").failures
    assert not check_build(s.with_section("catalog", min_count_share=0.0), items=1, bad=[], model_id="m").failures
    held = [publish_random(s, 5, checks=drop) for _ in range(KEEP_HELD + 2)]
    assert all(h.name.startswith(store.HELD_PREFIX) for h in held)
    assert store.complete_versions(s.catalog.index_root) == live  # neither listed nor pruning the live ones
    assert store.newest_version(s.catalog.index_root) == live[-1]
    kept = [p for p, _why in store.refused_versions(s.catalog.index_root)]
    assert kept == held[-KEEP_HELD:]  # older held versions pruned
    assert store.read_manifest(held[-1])["checks"]["passed"] is False
    # A held version renamed into place by hand is still refused: its manifest says it failed.
    renamed = s.catalog.index_root / held[-1].name.removeprefix(store.HELD_PREFIX)
    shutil.copytree(held[-1], renamed)
    assert store.newest_version(s.catalog.index_root) == live[-1]
    assert store.newest_version(s.catalog.index_root, model_id="m") == live[-1]
    why = dict(store.refused_versions(s.catalog.index_root, newer_than=live[-1].name))
    assert "failed its publish checks: 5 items" in why[renamed]


# --- the job and the CLI ---------------------------------------------------------------------
def test_a_mostly_bad_file_keeps_the_current_version_exits_non_zero_and_force_publishes_it(
        settings: Settings, tmp_path: Path, titles: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from inference.cli_main import main

    root = tmp_path / "idx"
    common = ["--index-root", str(root), "--models-dir", str(settings.model.models_dir), "--variant", "fp32",
              "--threads", "2", "--no-progress"]
    assert main(["catalog", "build", str(write_csv(tmp_path / "good.csv", titles[:60])), *common]) == 0
    current = store.newest_version(root)
    assert current is not None and store.read_manifest(current)["checks"]["passed"] is True
    capsys.readouterr()

    bad = write_csv(tmp_path / "bad.csv", titles[:200], missing_id_every=200)  # 199 of 200 rows lack an id
    assert main(["catalog", "build", str(bad), *common]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("embedcar:")]
    assert len(lines) == 1, err
    assert "199 of 200 rows are bad" in lines[0] and "missing id" in lines[0] and "--force" in lines[0]
    assert f"still current: {current.name}" in lines[0] and "items embedded" not in out
    assert store.newest_version(root) == current  # nothing swapped
    [(held, _why)] = store.refused_versions(root)
    assert held.name.startswith(store.HELD_PREFIX) and store.read_manifest(held)["count"] == 1
    assert str(held) in lines[0]

    assert main(["catalog", "build", str(bad), "--force", *common]) == 0
    out = capsys.readouterr().out
    assert "published with --force despite: 199 of 200 rows are bad" in out
    assert "resumed 1 chunks" in out  # the held run's embeddings were kept for this
    forced = store.newest_version(root)
    assert forced is not None and forced != current and forced.name.startswith(store.VERSION_PREFIX)
    checks = store.read_manifest(forced)["checks"]
    assert checks["forced"] is True and checks["passed"] is False
    assert (checks["rows"], checks["bad_rows"], checks["items"]) == (200, 199, 1)


def test_the_limits_are_flags_of_build(settings: Settings, tmp_path: Path, titles: list[str]) -> None:
    from inference.cli_main import main

    common = ["--index-root", str(tmp_path / "idx"), "--models-dir", str(settings.model.models_dir),
              "--variant", "fp32", "--threads", "2", "--no-progress"]
    src = write_csv(tmp_path / "half.csv", titles[:40], missing_id_every=2)  # 20 of 40 bad
    assert main(["catalog", "build", str(src), "--max-bad-share", "0.6", *common]) == 0
    assert main(["catalog", "build", str(src), "--max-bad-share", "2", *common]) == 2  # out of range


def test_a_sharp_drop_in_items_is_held_and_a_healthy_rebuild_publishes(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, titles: list[str]) -> None:
    s = catalog_settings_for(settings, tmp_path / "idx")
    root = s.catalog.index_root
    first = run_build(s, write_csv(tmp_path / "full.csv", titles[:60]), onnx_backend).version_dir
    assert first is not None
    with pytest.raises(FailedPrecondition, match=f"20 items, under min_count_share 50% of the 60 of the current "
                       f"version {first.name}"):
        run_build(s, write_csv(tmp_path / "cut.csv", titles[:20]), onnx_backend)
    assert store.newest_version(root) == first and len(store.refused_versions(root)) == 1
    healthy = run_build(s, write_csv(tmp_path / "next.csv", titles[5:60]), onnx_backend)  # 55 of 60: normal churn
    assert healthy.version_dir is not None and store.newest_version(root) == healthy.version_dir
    checks = store.read_manifest(healthy.version_dir)["checks"]
    assert checks["passed"] is True and checks["forced"] is False and checks["failures"] == []


def test_a_first_build_with_many_bad_rows_is_held_unless_forced(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, titles: list[str]) -> None:
    # Nothing to protect yet, but a first version goes live as soon as it is written, and a mostly
    # bad file is usually a misread one: better told now than served.
    s = catalog_settings_for(settings, tmp_path / "idx")
    src = write_csv(tmp_path / "bad.csv", titles[:60], missing_id_every=4)  # 45 of 60 bad
    with pytest.raises(FailedPrecondition, match="still current: nothing") as err:
        run_build(s, src, onnx_backend)
    assert "45 of 60 rows are bad" in err.value.message
    assert store.complete_versions(s.catalog.index_root) == []
    forced = run_build(s, src, onnx_backend, force=True)
    assert forced.version_dir is not None and forced.items == 15 and forced.resumed_chunks == 1
    assert store.newest_version(s.catalog.index_root) == forced.version_dir
    assert store.read_manifest(forced.version_dir)["checks"]["forced"] is True


def test_a_merge_is_checked_and_keeps_its_shards_until_forced(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, titles: list[str]) -> None:
    s = catalog_settings_for(settings, tmp_path / "idx")
    root = s.catalog.index_root
    first = run_build(s, write_csv(tmp_path / "full.csv", titles[:60]), onnx_backend).version_dir
    small = write_csv(tmp_path / "small.csv", titles[:24])
    for i in range(2):
        asyncio.run(build(s, BuildSpec(source=str(small), shard=(i, 2)), backend=onnx_backend, progress=False))
    with pytest.raises(FailedPrecondition, match="rerun the merge with --force"):
        merge(s, BuildSpec(source=str(small), shard=(0, 2)), model_id=onnx_backend.version_id)
    assert store.newest_version(root) == first and any((root / SHARDS_DIR).iterdir())
    merged = merge(s, BuildSpec(source=str(small), shard=(0, 2)), model_id=onnx_backend.version_id, force=True)
    assert merged.version_dir is not None and store.newest_version(root) == merged.version_dir
    assert store.read_manifest(merged.version_dir)["checks"]["forced"] is True


# --- the sidecar -----------------------------------------------------------------------------
def test_a_sidecar_serving_the_root_never_swaps_to_a_held_version(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, titles: list[str],
        caplog: pytest.LogCaptureFixture) -> None:
    from embedcar_client.client import Client
    from sidecar.app import SidecarThread
    from tests.fixtures_sidecar import sidecar_settings
    from tests.test_sidecar_reliability import wait_for

    caplog.set_level(logging.WARNING, logger="sidecar.search_index")
    s = catalog_settings_for(settings, tmp_path / "idx", use_gpu=False)
    root = s.catalog.index_root
    current = run_build(s, write_csv(tmp_path / "good.csv", titles[:60]), onnx_backend).version_dir
    assert current is not None
    sc_settings = sidecar_settings(s, http_port=-1, index_dir=root, poll_s=0.05)
    with SidecarThread(sc_settings, backend=onnx_backend) as sc, Client(sc.grpc_target) as c:
        assert c.search([titles[0]], k=1).index_version == current.name

        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records if "not swapping to product index" in r.getMessage()]

        with pytest.raises(FailedPrecondition):
            run_build(s, write_csv(tmp_path / "bad.csv", titles[:200], missing_id_every=200), onnx_backend)
        [(held, _why)] = store.refused_versions(root)
        assert wait_for(lambda: len(warned()) == 1)
        # A hand copy of it under a live name is refused too (its manifest says it failed).
        renamed = root / held.name.removeprefix(store.HELD_PREFIX)
        shutil.copytree(held, renamed)
        assert wait_for(lambda: len(warned()) == 2)
        time.sleep(1.0)  # 20 more polls: still one warning each
        assert [w.split(":")[0] for w in warned()] == [f"not swapping to product index {held.name}",
                                                       f"not swapping to product index {renamed.name}"]
        assert "199 of 200 rows are bad" in warned()[0] and f"still serving {current.name}" in warned()[0]
        reply = c.search([titles[7]], k=1)
        assert reply.index_version == current.name and reply.hits[0][0].fields["title"] == titles[7]
        assert sc.index.current() is not None and sc.index.current().size == 60  # type: ignore[union-attr]

        healthy = run_build(s, write_csv(tmp_path / "next.csv", titles[:70]), onnx_backend).version_dir
        assert healthy is not None
        assert wait_for(lambda: c.search([titles[65]], k=1).index_version == healthy.name)
        assert c.search([titles[65]], k=1).hits[0][0].fields["title"] == titles[65]
    assert json.loads((healthy / store.MANIFEST_FILE).read_text())["checks"]["passed"] is True
