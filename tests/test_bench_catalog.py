"""`embedcar bench catalog search` on small synthetic sets: memory-mapped sizes, skips, every row's fields."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from catalog import index_build
from embedcar_settings import Settings
from loadtest.bench import catalog as bench
from tests.test_catalog_index import DIM, clustered


def test_search_bench_maps_large_sizes_and_skips_uncompressed_types_that_would_not_fit(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = clustered(1500, seed=2)
    # "Available memory": 6000 fp32 vectors of DIM. 1000 items stay in memory; 5000 are a quarter
    # or more of it (mapped) and over half (flat and IVF skipped); ivfpq still runs.
    monkeypatch.setattr(bench, "_available_bytes", lambda: 6000 * DIM * 4)
    monkeypatch.setattr(index_build, "IVFPQ_M", DIM // 2)
    rows = bench.bench_search(settings, base, sizes=(1000, 5000), types=("flat", "ivf", "ivfpq"),
                              work_dir=tmp_path)
    by = {(r["items"], r["type"]): r for r in rows}
    assert set(by) == {(n, t) for n in (1000, 5000) for t in ("flat", "ivf", "ivfpq")}
    assert "available memory" in by[(5000, "flat")]["skipped"] and "skipped" in by[(5000, "ivf")]
    for key in [(1000, "flat"), (1000, "ivf"), (1000, "ivfpq"), (5000, "ivfpq")]:
        r = by[key]
        assert r["memory_mapped_input"] == (key[0] == 5000)
        assert r["size_mb"] > 0 and r["build_s"] >= 0 and 0 < r["p50_ms"] <= r["p95_ms"]
        assert r["peak_rss_mb"] >= 0 and r["peak_anon_mb"] >= 0 and r["queries"] == 500
        assert 0.0 <= r["recall_at_10_vs_exact"] <= 1.0
    assert by[(1000, "flat")]["recall_at_10_vs_exact"] == 1.0
    assert by[(5000, "ivfpq")]["params"]["build_recall_at_10"] >= 0.96  # target + margin, synthetic queries
    assert list(tmp_path.iterdir()) == []  # the mapped vectors and index files are gone
    table = bench.search_markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "skipped" in table


def test_scaled_vectors_keep_the_real_rows_and_are_unit_length(tmp_path: Path) -> None:
    base = clustered(300, seed=1)
    mapped = bench.scale_vectors(base, 1000, path=tmp_path / "v.npy")
    assert isinstance(mapped, np.memmap) and mapped.shape == (1000, DIM)
    assert np.array_equal(mapped[:300], base)
    assert np.allclose(np.linalg.norm(mapped, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(mapped, bench.scale_vectors(base, 1000))  # same draw in memory
