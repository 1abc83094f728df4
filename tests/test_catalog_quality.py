"""Weak-label quality metrics: the arithmetic, the query sets, and a small real evaluation."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from catalog.calibration import fragment
from catalog.quality import aisle_queries, evaluate, known_item_queries, markdown, score
from catalog.sources import Loaded
from demo_ui.settings import Settings
from inference.errors import InvalidInput


def test_recall_and_ndcg_arithmetic() -> None:
    ranked = np.array([[5, 1, 2], [9, 8, 7]])
    s = score(ranked, [{1}, {7, 8, 9, 10}], k=3)
    # query 1: hit at rank 2 -> recall 1, nDCG 1/log2(3); query 2: 3 of min(4, 3) -> 1 and 1.
    assert s.recall_at_10 == pytest.approx(1.0)
    assert s.ndcg_at_10 == pytest.approx((1 / np.log2(3) + 1.0) / 2, abs=1e-4)
    assert score(np.array([[0, 0, 0]]), [{1}], k=3).recall_at_10 == 0.0
    with pytest.raises(InvalidInput):
        score(np.zeros((0, 3), np.int64), [])


def test_fragments_are_strict_contiguous_parts_of_the_title() -> None:
    rng = random.Random(0)
    title = "Organic Unsweetened Vanilla Almond Milk Half Gallon"
    for _ in range(50):
        f = fragment(title, rng)
        assert f is not None and f in title and f != title and len(f.split()) >= 2
    assert fragment("Two Words", rng) is None


def test_query_sets_from_the_catalog(grocery_slice: Loaded) -> None:
    aisles = aisle_queries(grocery_slice.products)
    assert aisles.queries and all(
        all(grocery_slice.products[r].fields["aisle"] == q for r in rel)
        for q, rel in zip(aisles.queries, aisles.relevant, strict=True))
    items = known_item_queries(grocery_slice.products, 50, seed=1)
    assert len(items.queries) == 50
    assert items.queries == known_item_queries(grocery_slice.products, 50, seed=1).queries
    for q, rel in zip(items.queries, items.relevant, strict=True):
        assert any(q in grocery_slice.products[r].fields["title"] for r in rel)


def test_small_real_evaluation(settings: Settings, grocery_slice: Loaded) -> None:
    s = settings.with_section("model", intra_op_threads=2)
    result = asyncio.run(evaluate(s, variant="fp32", pooling="mean", known_items=60, ann_types=("ivf",),
                                  products=grocery_slice.products))
    ki = result["exact"]["known-item"]
    assert ki["queries"] == 60 and ki["recall_at_10"] > 0.6  # fragments of titles find their product
    assert 0 < result["exact"]["aisle-name"]["ndcg_at_10"] <= 1
    assert 0 <= result["ann"]["ivf"]["known-item"]["recall_vs_exact"] <= 1
    table = markdown([result])
    assert "| fp32 | mean | flat (exact) | known-item | 60 |" in table and "ivf nlist=" in table
