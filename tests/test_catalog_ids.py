"""Ids and types from a team's own catalog to its engine: a product id leaves exactly as the source has
it (a pandas float64 id column with a gap, JSON's `1004.0`, a CSV's `007`), so the engine's documents
join back to the catalog's rows; numbers stay numbers on the way (issue: `_id "2001.0"`, `"price":"4.5"`)."""

from __future__ import annotations

import asyncio
import csv
import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog.job import build
from catalog.product_table import read_products, write_products
from catalog.sources import Product, read_path
from catalog.spec import BuildSpec
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from tests.fixtures_catalog import catalog_settings_for
from tests.test_integrations_export import check_documented_types, export, exported_documents

ENGINES = ("elasticsearch", "opensearch", "solr", "vespa")


# --- the id rules -----------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [
    (2001, "2001"), (2001.0, "2001"), (-3.0, "-3"), ("2001.0", "2001.0"), (" 007 ", "007"), ("A-17", "A-17"),
    (True, "'id' is a boolean (true), not text or an integer"),
    (3.5, "'id' is 3.5, not a whole number: an id is text or an integer"),
    (1e17, "'id' is 1e+17, a float too large to hold an integer id exactly: write ids as integers or text"),
    ([1], "'id' is a list, not text or an integer"),
    ({"n": 1}, "'id' is an object, not text or an integer"),
    (None, "missing id ('id')"), ("", "missing id ('id')"),
])
def test_an_id_is_text_or_an_integer_and_nothing_else(tmp_path: Path, value: Any, expected: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": value, "title": "Milk"}) + "\n" + json.dumps({"id": "x", "title": "Tea"}) + "\n")
    loaded = read_path(path)
    if loaded.products[0].id != "x":
        assert loaded.products[0].id == expected and not loaded.bad
    else:
        assert [(b.line, b.reason) for b in loaded.bad] == [(1, expected)]


def test_the_catalogs_id_type_is_int_only_when_every_id_was_an_integer(tmp_path: Path) -> None:
    def id_type(ids: list[Any], name: str = "p.jsonl") -> str:
        path = tmp_path / name
        if name.endswith(".csv"):
            path.write_text("id,title\n" + "".join(f"{i},t\n" for i in ids))
        else:
            path.write_text("".join(json.dumps({"id": i, "title": "t"}) + "\n" for i in ids))
        return read_path(path).id_type

    assert id_type([1, 2.0, 3]) == "int"
    assert id_type([1, "2"]) == "string"  # text is text, even when it reads as a number
    assert id_type([1, 2], "p.csv") == "string"  # a CSV's ids are text as written
    assert id_type([1, 2.5]) == "int"  # the 2.5 row is bad; the ids kept are integers
    assert read_path("grocery", limit=3).id_type == "int"


# --- typed values through products.parquet -------------------------------------------------------
def test_products_table_keeps_a_columns_type_and_falls_back_to_text_when_mixed(tmp_path: Path) -> None:
    rows = [{"id": 1, "title": "Milk", "price": 4.5, "stock": 3, "organic": True, "tags": ["dairy"], "size": "1l",
             "code": 7},
            {"id": 2, "title": "Tea", "price": 5, "stock": 0, "organic": False, "tags": [], "size": 2, "code": 8}]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = read_path(src)
    write_products(tmp_path / "products.parquet", loaded.products)
    table = pq.read_table(tmp_path / "products.parquet")
    # Every column is still text: Search, its filters and an older embedcar read it as before.
    assert all(t == pa.string() for t in table.schema.types)
    products, _ = read_products(tmp_path / "products.parquet")
    assert [p.fields for p in products] == [p.fields for p in loaded.products]
    assert [p.typed() for p in products] == [
        {"title": "Milk", "price": 4.5, "stock": 3, "organic": True, "tags": ["dairy"], "size": "1l", "code": 7},
        # a price written 5 beside 4.5 is a float; `size` mixes text and a number: text
        {"title": "Tea", "price": 5.0, "stock": 0, "organic": False, "tags": [], "size": "2", "code": 8}]
    assert isinstance(products[1].typed()["price"], float)


def test_a_products_table_without_types_reads_as_before(tmp_path: Path) -> None:
    old = tmp_path / "products.parquet"  # as versions before typed values wrote it
    pq.write_table(pa.table({"id": ["1", "2"], "title": ["Milk", "Tea"], "price": ["4.5", ""]}), old)
    products, rows = read_products(old)
    assert rows is None and [(p.id, p.fields, p.values) for p in products] == [
        ("1", {"title": "Milk", "price": "4.5"}, {}), ("2", {"title": "Tea"}, {})]
    assert Product("3", {"price": "1"}, 0).typed() == {"price": "1"}  # made in code: text only


# --- a team's catalogs, built and exported, joined back --------------------------------------------
def _catalogs(folder: Path) -> dict[str, tuple[Path, dict[str, dict[str, Any]]]]:
    """Each catalog file, and its rows by the id an engine must hold them under (read from the file
    as a team would: csv strings, JSON's integers, the floats of a column with gaps)."""
    folder.mkdir()
    out: dict[str, tuple[Path, dict[str, dict[str, Any]]]] = {}
    csv_path = folder / "catalog.csv"
    csv_path.write_text("id,title,price,aisle\n007,Greek Yogurt,4.50,yogurt\n2001,Oat Milk,3,milk\n"
                        "A-17,Green Tea,2.25,tea\n", encoding="utf-8")
    with csv_path.open(newline="", encoding="utf-8") as f:
        out["csv"] = csv_path, {r["id"]: r for r in csv.DictReader(f)}

    rows: list[dict[str, Any]] = [
        {"id": 1004.0, "title": "Whole Milk", "price": 4.5, "organic": True, "tags": ["dairy"]},
        {"id": 1005, "title": "Rye Bread", "price": 3, "organic": False, "tags": []},
        {"id": True, "title": "Mystery"},  # a bad row: no product "true"
        {"id": 1006, "title": "Coffee Beans", "price": 7.25, "organic": False, "tags": ["hot", "drinks"]}]
    jsonl = folder / "catalog.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out["jsonl"] = jsonl, {str(int(r["id"])): r for r in rows if not isinstance(r["id"], bool)}

    # As pandas writes an integer id column with a gap: float64, the gap null (another writer's NaN too).
    parquet = folder / "catalog.parquet"
    pq.write_table(pa.table({
        "id": pa.array([2001.0, None, 2003.0, math.nan, 2004.0], pa.float64()),
        "title": ["Bananas", "No Id", "Apples", "NaN Id", "Pears"], "price": [0.25, 1.0, 3.5, 9.0, 2.0],
        "in_stock": [True, False, True, True, False], "stock": pa.array([3, 0, 12, 1, 7], pa.int64())}), parquet)
    back = pq.read_table(parquet).to_pylist()
    out["parquet"] = parquet, {str(int(r["id"])): r for r in back if r["id"] is not None and not math.isnan(r["id"])}
    return out


def test_each_catalog_exports_ids_that_join_back_and_numbers_that_stay_numbers(
        settings: Settings, onnx_backend: OnnxBackend, model_dir: Path, tmp_path: Path) -> None:
    for kind, (path, source) in _catalogs(tmp_path / "files").items():
        loaded = read_path(path)
        assert loaded.id_type == ("string" if kind == "csv" else "int")
        s = catalog_settings_for(settings, tmp_path / kind / "indexes")  # a fresh index root per catalog
        summary = asyncio.run(build(s, BuildSpec(source=str(path)), backend=onnx_backend, progress=False))
        assert summary.items == len(source)
        for fmt in ENGINES:
            docs = exported_documents(fmt, export(fmt, s.catalog.index_root, model_dir, tmp_path / f"{kind}.{fmt}"))
            assert [i for i, _ in docs] == list(source), (kind, fmt)  # exact ids, in the file's order
            for pid, doc in docs:
                row = source[pid]  # the join a search team does
                assert doc["title"] == row["title"]
                if fmt == "vespa":
                    assert doc["product_id"] == pid
                if kind == "csv":  # a CSV has no types: its text, exactly (the engine's mapping converts)
                    assert doc["price"] == row["price"]
                else:
                    assert isinstance(doc["price"], float) and math.isclose(doc["price"], row["price"])
                if kind == "jsonl":
                    assert doc["organic"] is row["organic"] and doc["tags"] == row["tags"]
                if kind == "parquet":
                    assert doc["in_stock"] is row["in_stock"] and doc["stock"] == row["stock"]
                    assert type(doc["stock"]) is int
            check_documented_types(fmt, [d for _, d in docs], text_only={"price"} if kind == "csv" else ())
