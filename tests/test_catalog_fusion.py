"""Reciprocal rank fusion and the hybrid tiers: pure functions."""

from __future__ import annotations

import pytest

from catalog.fusion import Fusion, Ranked, SearchMode, parse_mode, rrf
from inference.errors import InvalidInput


def test_rrf_sums_reciprocal_ranks_and_says_which_legs_found_each_row() -> None:
    out = rrf({"semantic": [1, 2, 3], "lexical": [3, 4]}, k=60, limit=10)
    assert out.rows == [3, 1, 2, 4]  # found by both beats rank 1 of one leg
    assert out.scores[0] == pytest.approx(1 / 63 + 1 / 61)
    assert out.scores[1] == pytest.approx(1 / 61)
    assert out.legs == [("semantic", "lexical"), ("semantic",), ("semantic",), ("lexical",)]
    assert rrf({"semantic": [1, 2, 3], "lexical": [3, 4]}, k=60, limit=2).rows == [3, 1]


def test_rrf_weights_ties_duplicates_and_empty_legs() -> None:
    assert rrf({"semantic": [1], "lexical": [2]}, k=10, limit=2).rows == [1, 2]  # a tie: the first leg wins
    assert rrf({"semantic": [1], "lexical": [2]}, k=10, limit=2, weights={"lexical": 2.0}).rows == [2, 1]
    dup = rrf({"semantic": [5, 5, 6]}, k=10, limit=5)
    assert dup.rows == [5, 6] and dup.scores[0] == pytest.approx(1 / 11)  # counted once, at its best rank
    assert rrf({"semantic": [], "lexical": []}, k=60, limit=10) == Ranked([], [], [])
    assert rrf({"semantic": [7, 8], "lexical": []}, k=60, limit=10).rows == [7, 8]


def test_fuse_puts_rows_matching_every_word_first_in_lexical_order() -> None:
    f = Fusion(k=10, depth=50, complete_weight=8.0, partial_weight=0.25)
    semantic = Ranked.single("semantic", [1, 2, 3], [0.9, 0.8, 0.7])
    lexical = Ranked.single("lexical", [5, 4, 6], [9.0, 8.0, 7.0])
    out = f.fuse(semantic, lexical, frozenset({5, 4}), 10)
    assert out.rows == [5, 4, 1, 2, 3, 6]  # the complete matches in lexical order, then RRF 1:1 over the rest
    assert out.legs[:3] == [("lexical",), ("lexical",), ("semantic",)]
    assert out.scores == sorted(out.scores, reverse=True) and out.scores[1] > 1.0 > out.scores[2]
    assert f.fuse(semantic, lexical, frozenset({5, 4}), 3).rows == [5, 4, 1]
    # Within the tier the semantic rank breaks near-ties: 4 is lexical 2nd but semantic 1st.
    near = f.fuse(Ranked.single("semantic", [4], [0.9]), lexical, frozenset({5, 4}), 2)
    assert near.rows == [4, 5] and near.legs[0] == ("semantic", "lexical")


def test_fuse_lets_the_semantic_leg_lead_when_nothing_matches_every_word() -> None:
    f = Fusion(k=10, depth=50, complete_weight=8.0, partial_weight=0.25)
    semantic = Ranked.single("semantic", [1, 2, 3], [0.9, 0.8, 0.7])
    lexical = Ranked.single("lexical", [7, 8], [3.0, 2.0])
    partial = f.fuse(semantic, lexical, frozenset(), 5)
    assert partial.rows == [1, 2, 3, 7, 8]
    even = Fusion(k=10, complete_weight=8.0, partial_weight=1.0).fuse(semantic, lexical, frozenset(), 5)
    assert even.rows[:2] == [1, 7]  # with equal weights the legs alternate
    assert f.fuse(semantic, Ranked([], [], []), frozenset(), 2).rows == [1, 2]  # no lexical hit: semantic only
    assert f.fuse(Ranked([], [], []), lexical, frozenset({8}), 5).rows == [8, 7]


def test_a_one_word_query_lets_the_semantic_rank_order_the_lexical_hits() -> None:
    """One word or prefix: every lexical hit "matches every word", so the tier's lexical weight is
    single_word_weight (the semantic rank orders the lexical hits); they still come first."""
    f = Fusion(k=10, depth=50, complete_weight=8.0, partial_weight=0.25, single_word_weight=0.5)
    semantic = Ranked.single("semantic", [3, 9, 1, 2], [0.9, 0.8, 0.7, 0.6])
    lexical = Ranked.single("lexical", [1, 2, 3, 4], [9.0, 8.0, 7.0, 6.0])
    every = frozenset({1, 2, 3, 4})
    assert f.fuse(semantic, lexical, every, 10).rows == [1, 2, 3, 4, 9]  # several words: lexical order
    one = f.fuse(semantic, lexical, every, 10, single_word=True)
    assert one.rows == [3, 1, 2, 4, 9]  # semantic order among the lexical hits, then the semantic-only row
    assert one.scores == sorted(one.scores, reverse=True) and one.scores[3] > 1.0 > one.scores[4]
    assert Fusion(single_word_weight=8.0).fuse(semantic, lexical, every, 10, single_word=True).rows == \
        f.fuse(semantic, lexical, every, 10).rows  # at complete_weight: as every query was fused before


def test_modes() -> None:
    assert parse_mode("HYBRID") is SearchMode.HYBRID and parse_mode(SearchMode.LEXICAL) is SearchMode.LEXICAL
    assert parse_mode(" semantic ") is SearchMode.SEMANTIC
    with pytest.raises(InvalidInput, match="unknown search mode"):
        parse_mode("fuzzy")


def test_quality_flags_try_other_fusion_parameters_than_the_calibrated_ones() -> None:
    """The sidecar always fuses with the calibrated values; `catalog quality --prefixes` can try others
    (docs/benchmarks.md reproduces the old one-word weight with `--fusion-single-word-weight 8`)."""
    from catalog import cli as catalog_cli
    from inference.cli_main import build_parser

    parse = build_parser().parse_args
    assert catalog_cli._fusion(parse(["catalog", "quality", "--prefixes"])) is None
    tried = catalog_cli._fusion(parse(["catalog", "quality", "--prefixes", "--fusion-single-word-weight", "8"]))
    assert tried == Fusion(single_word_weight=8.0)
    with pytest.raises(InvalidInput, match="at least 1"):
        catalog_cli._fusion(parse(["catalog", "quality", "--fusion-depth", "0"]))
