"""`embedcar catalog export`: the catalog job's vectors as each engine's bulk feed, read back as the
engine's bulk loader reads it (NDJSON action/document pairs, a JSON array, JSON Lines of puts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from catalog import store
from catalog.product_table import read_products
from inference.cli_main import main as cli_main


def export(fmt: str, root: Path, model_dir: Path, out: Path, *extra: str) -> str:
    rc = cli_main(["catalog", "export", fmt, "--out", str(out), "--index-root", str(root),
                   "--models-dir", str(model_dir.parent), "--variant", "fp32", *extra])
    assert rc == 0
    return out.read_text(encoding="utf-8")


def catalog_vectors(root: Path) -> tuple[list[str], np.ndarray]:
    version = store.newest_version(root)
    assert version is not None
    products, _ = read_products(version / store.PRODUCTS_FILE)
    return [p.id for p in products], np.load(version / store.VECTORS_FILE)


@pytest.mark.parametrize("fmt", ["elasticsearch", "opensearch"])
def test_bulk_ndjson_pairs_carry_each_products_exact_vector(fmt: str, grocery_index_root: Path, model_dir: Path,
                                                            tmp_path: Path) -> None:
    text = export(fmt, grocery_index_root, model_dir, tmp_path / "bulk.ndjson", "--index", "shop-products")
    ids, vectors = catalog_vectors(grocery_index_root)
    lines = text.splitlines()
    assert text.endswith("\n") and len(lines) == 2 * len(ids)  # _bulk needs the final newline
    for i in (0, 1, len(ids) - 1):
        action, doc = json.loads(lines[2 * i]), json.loads(lines[2 * i + 1])
        assert action == {"index": {"_index": "shop-products", "_id": ids[i]}}
        assert doc["title"] and np.array_equal(np.asarray(doc["embedding"], dtype=np.float32), vectors[i])
        # dense_vector with dot_product accepts only unit-length float32 vectors (|m^2 - 1| <= 1e-4)
        v = np.asarray(doc["embedding"], dtype=np.float32)
        assert abs(float(np.sum(v * v, dtype=np.float32)) - 1) <= 1e-4


def test_solr_update_array_and_vespa_feed(grocery_index_root: Path, model_dir: Path, tmp_path: Path) -> None:
    ids, vectors = catalog_vectors(grocery_index_root)
    solr: list[dict[str, Any]] = json.loads(export("solr", grocery_index_root, model_dir, tmp_path / "solr.json",
                                                   "--field", "vector"))
    assert [d["id"] for d in solr] == ids
    assert np.array_equal(np.asarray([d["vector"] for d in solr], dtype=np.float32), vectors)
    text = export("vespa", grocery_index_root, model_dir, tmp_path / "feed.jsonl", "--namespace", "grocery")
    puts = [json.loads(line) for line in text.splitlines()]
    assert [p["put"] for p in puts] == [f"id:grocery:product::{i}" for i in ids]
    assert puts[0]["fields"]["product_id"] == ids[0]
    assert np.array_equal(np.asarray(puts[-1]["fields"]["embedding"]["values"], dtype=np.float32), vectors[-1])


def test_export_refuses_an_index_of_another_model(grocery_index_root: Path, model_dir: Path, tmp_path: Path) -> None:
    """The grocery slice was built with fp32: an int8 sidecar's query vectors must not meet it."""
    rc = cli_main(["catalog", "export", "solr", "--out", str(tmp_path / "x.json"), "--index-root",
                   str(grocery_index_root), "--models-dir", str(model_dir.parent), "--variant", "int8"])
    assert rc != 0 and not (tmp_path / "x.json").exists()
