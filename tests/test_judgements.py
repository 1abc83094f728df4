"""Labelled queries (catalog/judgements.py): read against a catalog, joined per query, mistakes counted
by line, a mostly bad file refused; the grocery demo's bundled set names only aisles that exist; the
tuning gate scores them on held-out products (catalog/tuning/heldout.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from catalog.judgements import GROCERY_JUDGEMENTS, read_judgements
from catalog.sources import Product, read_grocery
from catalog.tuning import heldout
from inference.errors import InvalidInput


def _products() -> list[Product]:
    rows = [("1", "Greek Yogurt Plain", "yogurt", "dairy eggs"), ("2", "Vanilla Yogurt", "yogurt", "dairy eggs"),
            ("3", "Whole Milk", "milk", "dairy eggs"), ("4", "Paper Towels", "paper goods", "household")]
    return [Product(pid, {"title": t, "aisle": a, "department": d}, 0) for pid, t, a, d in rows]


def test_categories_and_products_are_joined_per_query(tmp_path: Path) -> None:
    f = tmp_path / "j.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [
        {"query": "yogurt", "category": "Yogurt"},
        {"query": "Yogurt ", "product_id": "3"},  # the same query, another row: joined
        {"query": "dairy", "category": "dairy eggs"},  # a department is a category too
        {"query": "towels", "product_id": 4},
    ]))
    j = read_judgements(f, _products())
    got = dict(zip(j.queries.queries, j.queries.relevant, strict=True))
    assert got == {"yogurt": {0, 1, 2}, "dairy": {0, 1, 2}, "towels": {3}}
    assert j.named == {"3", "4"} and not j.bad


def test_mistakes_are_counted_by_line_and_a_mostly_bad_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "j.csv"
    f.write_text("query,category\nyogurt,yogurt\nmilk,dairy air\n,milk\nyogurt,yogurt\n")
    j = read_judgements(f, _products())
    assert [(b.line, b.reason) for b in j.bad] == [
        (3, "unknown category 'dairy air'"), (4, "empty query"), (5, "repeats an earlier row (category yogurt)")]
    assert j.queries.queries == ["yogurt"]
    f.write_text("query,product_id\na,x\nb,y\nc,1\n")
    with pytest.raises(InvalidInput, match="refused as judgements: 2 of 3 rows are bad; first: line 2: unknown "
                       "product id 'x'"):
        read_judgements(f, _products())
    f.write_text("q,sku\na,1\n")
    assert read_judgements(f, _products()).queries.relevant == [{0}]
    f.write_text("text,label\na,1\n")
    with pytest.raises(InvalidInput, match="no query column"):
        read_judgements(f, _products())


def test_the_grocery_set_names_only_aisles_of_the_demo_catalog() -> None:
    j = read_judgements("grocery", read_grocery().products)
    assert GROCERY_JUDGEMENTS.is_file() and not j.bad
    assert len(j.queries.queries) >= 200 and all(len(r) >= 5 for r in j.queries.relevant)


def test_the_gate_scores_judged_queries_on_held_out_products() -> None:
    products = [Product(str(i), {"title": f"thing {i}", "aisle": f"aisle {i % 4}", "department": "d"}, i)
                for i in range(40)]
    s = heldout.split(products, [], share=0.25, max_held=100, seed=0)
    held_ids = {p.id for p in s.held}
    # a trained-on product named by a product row joins the corpus
    named = next(p.id for p in s.train if p.fields["aisle"] != "aisle 0")
    aisle0 = {p.id for p in products if p.fields["aisle"] == "aisle 0"}
    judged = heldout.Judged(["zero", "one named"], [aisle0, {named}], {named})
    h = heldout.held_out(s, {p.id: p for p in products}, ["title"], seed=0, judged=judged)
    sets = {qs.name: qs for qs in h.sets}
    assert sets["judged"].queries == ["zero", "one named"]
    zero, one = sets["judged"].relevant
    assert {h.documents[r] for r in zero} == {f"thing {i}" for i in map(int, aisle0 & held_ids)}
    assert {h.documents[r] for r in one} == {f"thing {named}"} and len(h.documents) == len(s.held) + 1
