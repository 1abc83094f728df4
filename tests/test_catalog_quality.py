"""Weak-label quality metrics: the arithmetic, the query sets, and a small real evaluation."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest

from catalog.calibration import fragment
from catalog.quality import aisle_queries, evaluate, known_item_queries, markdown, score
from catalog.sources import Loaded
from embedcar_settings import Settings
from inference.errors import InvalidInput


def test_recall_and_ndcg_arithmetic() -> None:
    ranked = np.array([[5, 1, 2], [9, 8, 7]])
    s = score(ranked, [{1}, {7, 8, 9, 10}], k=3)
    # query 1: hit at rank 2 -> recall 1, nDCG 1/log2(3); query 2: 3 of min(4, 3) -> 1 and 1.
    assert s.recall_at_10 == pytest.approx(1.0)
    assert s.ndcg_at_10 == pytest.approx((1 / np.log2(3) + 1.0) / 2, abs=1e-4)
    assert s.precision_at_10 == pytest.approx((1 / 3 + 1.0) / 2, abs=1e-4)
    assert score(np.array([[0, 0, 0]]), [{1}], k=3).recall_at_10 == 0.0
    assert score([[1], []], [{1}, {2}], k=3).recall_at_10 == pytest.approx(0.5)  # short and empty lists
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


def test_prefix_cuts() -> None:
    from catalog.prefix_quality import cut

    assert [cut("greek yogurt", p) for p in (25, 50, 75, 100)] == ["gre", "greek", "greek yog", "greek yogurt"]
    assert cut("a", 25) == "a"
    with pytest.raises(InvalidInput):
        cut("milk", 0)


def test_prefix_evaluation_scores_the_three_modes_per_cut(settings: Settings, grocery_index_root: Path) -> None:
    """On the small real index the test session builds (real model, real FAISS, real tantivy)."""
    from catalog.prefix_quality import evaluate_prefixes, verdict
    from catalog.prefix_quality import markdown as prefix_markdown

    s = settings.with_section("catalog", index_root=grocery_index_root).with_section("model", intra_op_threads=2)
    result = asyncio.run(evaluate_prefixes(s, known_items=40, cuts=(50, 100)))
    assert set(result["sets"]) >= {"aisle-name", "known-item"} and result["modes"] == ["semantic", "lexical", "hybrid"]
    known = result["sets"]["known-item"]
    assert set(known) == {"50", "100"} and known["100"]["lexical"]["queries"] == 40
    assert known["100"]["lexical"]["recall_at_10"] > 0.8  # whole title fragments: their words are in the title
    for per_cut in result["sets"].values():
        for modes in per_cut.values():
            for sc in modes.values():
                assert 0 <= sc["precision_at_10"] <= sc["recall_at_10"] <= 1 and 0 <= sc["ndcg_at_10"] <= 1
    assert result["precision_ceiling"]["known-item"] == pytest.approx(0.1, abs=0.02)
    table = prefix_markdown(result)
    assert "| known-item | 50 % | 40 |" in table and "nDCG@10 hybrid" in table
    assert any(line.startswith("known-item recall@10: hybrid >= best single mode") for line in verdict(result))
