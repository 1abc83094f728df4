"""Scale generator: deterministic by seed, flagged generated, readable by the job's readers."""

from __future__ import annotations

from pathlib import Path

import pytest

from catalog.generator import TitleGenerator, write_rows
from catalog.sources import Loaded, read_path
from inference.errors import InvalidInput


@pytest.fixture(scope="module")
def gen(grocery_slice: Loaded) -> TitleGenerator:
    return TitleGenerator(grocery_slice.products)


def test_same_seed_same_rows_other_seed_other_rows(gen: TitleGenerator) -> None:
    a = list(gen.rows(500, seed=7))
    assert a == list(gen.rows(500, seed=7))
    assert a != list(gen.rows(500, seed=8))
    assert len({r["id"] for r in a}) == 500


def test_rows_are_flagged_and_look_like_their_aisle(gen: TitleGenerator, grocery_slice: Loaded) -> None:
    aisles = {p.fields["aisle"]: p.fields["department"] for p in grocery_slice.products}
    vocab = {w for p in grocery_slice.products for w in p.fields["title"].split()}
    rows = list(gen.rows(300, seed=1))
    assert all(r["generated"] == "true" and r["id"].startswith("gen-1-") for r in rows)
    assert all(aisles[r["aisle"]] == r["department"] for r in rows)
    assert all(r["title"].strip() for r in rows)
    words = [w for r in rows for w in r["title"].split()]
    # Titles are made of the catalog's words (plus size/pack slots).
    assert sum(w in vocab or w.isdigit() or w == "Pack" for w in words) / len(words) > 0.9


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_written_files_read_back_as_valid_products(gen: TitleGenerator, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"gen{suffix}"
    assert write_rows(gen.rows(1000, seed=3), out, batch=300) == 1000
    loaded = read_path(out, text_fields=("title",))
    assert len(loaded.products) == 1000 and not loaded.bad
    assert all(p.fields["generated"] == "true" for p in loaded.products)


def test_bad_requests_are_clear_errors(gen: TitleGenerator, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput):
        write_rows(gen.rows(1), tmp_path / "x.txt")
    with pytest.raises(InvalidInput):
        list(gen.rows(-1))
    with pytest.raises(InvalidInput):
        TitleGenerator([])
