"""The FAISS product index: index types, filters, publishing, hot swap, model-id checks.

Vectors here are synthetic clustered unit vectors (real FAISS, no model): the model path is
covered by test_catalog_job.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from catalog import index as index_mod
from catalog import store
from catalog.index import ProductIndex, build_faiss
from catalog.publish import publish_index
from catalog.sources import Product
from demo_ui.settings import Settings
from inference.errors import InvalidInput, ModelError, Unavailable

DIM = 32
MODEL = "test-model@0000/fp32"
DEPTS = ("produce", "dairy eggs", "snacks")


def clustered(n: int, seed: int = 0, clusters: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, DIM))
    x = centres[rng.integers(0, clusters, n)] + 0.35 * rng.normal(size=(n, DIM))
    out: np.ndarray = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return out


def products(n: int, tag: str = "") -> list[Product]:
    return [Product(f"p{i}", {"title": f"item {i}{tag}", "department": DEPTS[i % 3], "aisle": f"aisle {i % 7}"},
                    i + 1) for i in range(n)]


def publish(s: Settings, x: np.ndarray, *, model_id: str = MODEL, index_type: str | None = None,
            tag: str = "") -> Path:
    version, _ = publish_index(s, x, products(len(x), tag), {"model_id": model_id, "text_fields": ["title"]},
                               index_type=index_type)
    return version


@pytest.fixture
def s(settings: Settings, tmp_path: Path) -> Settings:
    return settings.with_section("catalog", index_root=tmp_path / "idx")


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_each_index_type_finds_stored_items(s: Settings, kind: str) -> None:
    x = clustered(3000)
    publish(s, x, index_type=kind)
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
    assert idx.size == 3000 and idx.manifest["index"]["type"] == kind and idx.model_id == MODEL
    hits = idx.search(x[:20], k=5)
    assert len(hits) == 20 and all(len(h) == 5 for h in hits)
    top1 = [h[0].id for h in hits]
    assert sum(t == f"p{i}" for i, t in enumerate(top1)) >= 19
    assert hits[0][0].fields["title"] == "item 0" and hits[0][0].fields["department"] == "produce"
    assert hits[0][0].score == pytest.approx(1.0, abs=1e-4)
    assert all(a.score >= b.score for a, b in zip(hits[3], hits[3][1:], strict=False))


def test_ivf_nprobe_is_chosen_to_reach_the_recall_target(s: Settings) -> None:
    x = clustered(8000, seed=3)
    index, params = build_faiss(x, s.catalog, index_type="ivf")
    assert params["nlist"] == index_mod.auto_nlist(8000)
    assert params["build_recall_at_10"] >= s.catalog.ann_recall_target
    q = index_mod.sample_queries(x, seed=99)
    assert index_mod.ann_recall(index, x, q) >= 0.9  # fresh queries: close to the target too


def test_auto_type_is_flat_small_hnsw_medium_ivf_large(s: Settings) -> None:
    small = s.with_section("catalog", flat_max_items=1000, hnsw_max_items=5000)
    assert index_mod.resolve_type("auto", 1000, small.catalog) == "flat"
    assert index_mod.resolve_type("auto", 1001, small.catalog) == "hnsw"
    assert index_mod.resolve_type("auto", 5001, small.catalog) == "ivf"
    assert index_mod.resolve_type("auto", 49_688, s.catalog) == "hnsw"  # the grocery catalog
    with pytest.raises(InvalidInput):
        index_mod.resolve_type("annoy", 10, s.catalog)


@pytest.mark.parametrize("kind", ["flat", "ivf"])
@pytest.mark.parametrize("exact_subset_max", [0, 50_000])
def test_filters_return_only_matching_products(s: Settings, kind: str, exact_subset_max: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # exact_subset_max=0 forces the FAISS selector path for IVF; the default uses exact subsets.
    monkeypatch.setattr(index_mod, "EXACT_SUBSET_MAX", exact_subset_max)
    x = clustered(3000, seed=1)
    publish(s, x, index_type=kind)
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
    hits = idx.search(x[:5], k=10, department="Snacks ")  # case and spaces do not matter
    for row in hits:
        assert row and all(h.fields["department"] == "snacks" for h in row)
    both = idx.search(x[:5], k=10, department="snacks", aisle="aisle 2")
    for row in both:
        assert row and all(h.fields["department"] == "snacks" and h.fields["aisle"] == "aisle 2" for h in row)
    # The true best in-filter product comes first. Flat and the exact-subset path are exact as
    # built; IVF through the FAISS selector is approximate at its tuned nprobe, so that path is
    # checked with every list probed, where it must be exact too.
    if kind == "ivf" and exact_subset_max == 0:
        idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL, nprobe=idx.manifest["index"]["nlist"])
        both = idx.search(x[:5], k=10, department="snacks", aisle="aisle 2")
    rows = np.array([i for i in range(3000) if i % 3 == 2 and i % 7 == 2])
    best = rows[np.argmax(x[rows] @ x[0])]
    assert both[0][0].id == f"p{best}"
    assert idx.search(x[:2], k=3, aisle="no such aisle") == [[], []]


def test_bad_queries_are_invalid_input(s: Settings) -> None:
    publish(s, clustered(100))
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=None)
    with pytest.raises(InvalidInput):
        idx.search(np.zeros((1, DIM + 1), np.float32))
    with pytest.raises(InvalidInput):
        idx.search(np.full((1, DIM), np.nan, np.float32))
    with pytest.raises(InvalidInput):
        idx.search(np.zeros((1, DIM), np.float32), k=0)
    assert len(idx.search(np.ones(DIM, np.float32), k=500)[0]) == 100  # k capped at the size


def test_no_index_is_unavailable_and_model_mismatch_is_refused(s: Settings) -> None:
    with pytest.raises(Unavailable):
        ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
    publish(s, clustered(100), model_id="other-model@1111/fp32")
    with pytest.raises(ModelError, match="other-model"):
        ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
    assert ProductIndex.open(s.catalog.index_root, expected_model_id=None).size == 100


def test_reload_refuses_a_newer_version_of_another_model(s: Settings) -> None:
    publish(s, clustered(100))
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
    old = idx.version
    publish(s, clustered(120), model_id="other-model@1111/fp32")
    assert idx.maybe_reload() is False
    assert idx.version == old and idx.size == 100


def test_a_failed_publish_leaves_no_version_and_the_old_one_serving(s: Settings) -> None:
    first = publish(s, clustered(100))

    def crash(tmp: Path) -> None:
        (tmp / store.MANIFEST_FILE).write_text("{}")  # half-written version...
        raise RuntimeError("killed mid-build")  # ...and the builder dies

    with pytest.raises(RuntimeError):
        store.publish(s.catalog.index_root, crash)
    assert store.complete_versions(s.catalog.index_root) == [first]
    assert not [p for p in s.catalog.index_root.iterdir() if p.name.startswith(".tmp-")]
    assert ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL).version == first.name


def test_readers_never_see_a_half_written_version(s: Settings) -> None:
    publish(s, clustered(200))
    errors: list[BaseException] = []
    stop = threading.Event()
    seen: set[str] = set()

    def reader() -> None:
        while not stop.is_set():
            try:
                idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
                assert idx.size in (200, 300)
                seen.add(idx.version)
            except BaseException as exc:
                errors.append(exc)
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(4):
            publish(s, clustered(300, seed=i), tag=f" v{i}")
    finally:
        stop.set()
        t.join()
    assert not errors, errors[0]
    assert len(seen) >= 2


def test_hot_swap_under_concurrent_searches_fails_no_search(s: Settings) -> None:
    x = clustered(2000)
    publish(s, x, tag=" old")
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
    errors: list[BaseException] = []
    stop = threading.Event()
    counts = [0] * 4

    def searcher(n: int) -> None:
        while not stop.is_set():
            try:
                hits = idx.search(x[n : n + 3], k=5, department="snacks" if n % 2 else None)
                assert len(hits) == 3 and all(len(h) == 5 for h in hits)
                counts[n] += 1
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=searcher, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    try:
        swaps = 0
        for i in range(3):
            publish(s, x, tag=f" new{i}")
            swaps += idx.maybe_reload()
        assert idx.maybe_reload() is False  # nothing newer now
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert swaps == 3 and all(c > 0 for c in counts)
    assert idx.search(x[:1], k=1)[0][0].fields["title"] == "item 0 new2"


def test_old_versions_are_pruned(s: Settings) -> None:
    for i in range(5):
        publish(s, clustered(50, seed=i))
    assert len(store.complete_versions(s.catalog.index_root)) == 3


def test_fixed_ivf_settings_are_used_and_checked(s: Settings) -> None:
    x = clustered(2000, seed=4)
    fixed = s.with_section("catalog", ivf_nlist=20, ivf_nprobe=3)
    index, params = build_faiss(x, fixed.catalog, index_type="ivf")
    assert (params["nlist"], params["nprobe"], index.nprobe) == (20, 3, 3)
    assert 0 < params["build_recall_at_10"] <= 1
    with pytest.raises(InvalidInput, match="more than"):
        build_faiss(x[:10], fixed.catalog, index_type="ivf")
    with pytest.raises(InvalidInput):
        build_faiss(np.zeros((0, DIM), np.float32), s.catalog)


def test_search_from_a_worker_thread_uses_the_configured_faiss_threads(s: Settings) -> None:
    """OpenMP thread counts are per thread: the sidecar searches from a worker thread, which must
    not fall back to FAISS's default team of one thread per core (3x slower single queries)."""
    import faiss

    x = clustered(500)
    publish(s, x, index_type="flat")
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL, search_threads=1)
    seen: list[int] = []

    def worker() -> None:
        idx.search(x[:1], k=3)
        seen.append(faiss.omp_get_max_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [1]
