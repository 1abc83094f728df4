"""The lexical (tantivy) index: analysis, prefixes, filters, hostile query text, and the version
folder it shares with FAISS (modes, older versions, hot swap). Real tantivy and real FAISS over
synthetic vectors; the model path is in test_catalog_job.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from catalog import store
from catalog.fusion import SearchMode
from catalog.index import ProductIndex
from catalog.lexical import LEXICAL_DIR, MAX_QUERY_WORDS, PREFIX_MAX_CHARS, LexicalIndex, Terms, edge_ngrams, words
from catalog.publish import publish_index
from catalog.sources import Product
from embedcar_settings import Settings
from inference.errors import FailedPrecondition, InvalidInput

MODEL = "test-model@0000/fp32"
TITLES = [
    ("Chocolate Sandwich Cookies", "cookies cakes", "snacks"),
    ("Dark Chocolate Bar 85%", "candy chocolate", "snacks"),
    ("Organic Whole Milk", "milk", "dairy eggs"),
    ("Chocolate Milk", "milk", "dairy eggs"),
    ("Crème Brûlée Yogurt", "yogurt", "dairy eggs"),
    ("Greek Yogurt Plain", "yogurt", "dairy eggs"),
    ("Oat Milk Barista", "soy lactosefree", "dairy eggs"),
    ("Bananas", "fresh fruits", "produce"),
    ("Baby Spinach", "packaged vegetables", "produce"),
    ("Milky Way Minis", "candy chocolate", "snacks"),
]


def catalog(titles: list[tuple[str, str, str]] = TITLES, tag: str = "") -> list[Product]:
    return [Product(f"p{i}", {"title": t + tag, "aisle": a, "department": d}, i + 1)
            for i, (t, a, d) in enumerate(titles)]


def vectors(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, dim))
    out: np.ndarray = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return out


def publish(s: Settings, products: list[Product], seed: int = 0) -> Path:
    version, _ = publish_index(s, vectors(len(products), seed=seed), products,
                               {"model_id": MODEL, "text_fields": ["title"]}, index_type="flat")
    return version


@pytest.fixture
def s(settings: Settings, tmp_path: Path) -> Settings:
    return settings.with_section("catalog", index_root=tmp_path / "idx", use_gpu=False)


@pytest.fixture
def idx(s: Settings) -> ProductIndex:
    publish(s, catalog())
    return ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)


def titles(index: ProductIndex, text: str, k: int = 10, **filters: str) -> list[str]:
    hits, _ = index.query([text], None, k, mode=SearchMode.LEXICAL, filters=filters)
    return [h.fields["title"] for h in hits[0]]


# --- analysis: pure functions -----------------------------------------------------------------
def test_words_are_lowercased_ascii_folded_alphanumerics() -> None:
    assert words('Crème-Brûlée "85%" ＭＩＬＫ') == ["creme", "brulee", "85", "milk"]
    assert words("*** :: () \"\" -") == []
    assert edge_ngrams(["milk", "mi"]) == ["m", "mi", "mil", "milk"]
    assert max(map(len, edge_ngrams(["x" * 30]))) == PREFIX_MAX_CHARS


def test_the_last_word_is_a_prefix_until_a_space_follows_it() -> None:
    assert Terms.of("greek yog") == Terms(("greek",), "yog")
    assert Terms.of("greek yogurt ") == Terms(("greek", "yogurt"), None)
    assert Terms.of("milk milk mi") == Terms(("milk",), "mi")
    assert Terms.of("!!!") == Terms((), None)
    assert Terms.of("a" * 60) == Terms((), None)  # over the analyser's word length: no term at all
    long = Terms.of(" ".join(f"w{i}" for i in range(500)))
    assert len(long.words) + 1 == MAX_QUERY_WORDS and long.prefix == f"w{MAX_QUERY_WORDS - 1}"
    with pytest.raises(InvalidInput, match="surrogate"):
        Terms.of("milk \ud800")


# --- searching a real tantivy index -----------------------------------------------------------
def test_the_partial_last_word_matches_as_a_prefix_with_bm25_over_whole_words(idx: ProductIndex) -> None:
    assert idx.has_lexical
    assert set(titles(idx, "choc")) == {"Chocolate Sandwich Cookies", "Dark Chocolate Bar 85%", "Chocolate Milk"}
    assert titles(idx, "chocolate mi")[0] == "Chocolate Milk"  # both terms beat one
    assert set(titles(idx, "mil")) == {"Organic Whole Milk", "Chocolate Milk", "Oat Milk Barista", "Milky Way Minis"}
    assert set(titles(idx, "milk ")) == {"Organic Whole Milk", "Chocolate Milk", "Oat Milk Barista"}  # whole word
    assert titles(idx, "creme brul") == ["Crème Brûlée Yogurt"]  # accents folded on both sides
    assert titles(idx, "zzz") == []
    lex = LexicalIndex.open(idx.index_root / idx.version, idx.manifest["lexical"])
    one = lex.search("choc", 10)  # one term: every hit matches every word (the fusion's one-word tier)
    assert one.terms == 1 and one.complete == frozenset(one.rows.tolist()) and len(one.rows) == 3
    assert lex.search("milk ", 10).terms == 1 and lex.search("!!!", 10).terms == 0
    two = lex.search("chocolate mi", 10)
    assert two.terms == 2 and len(two.complete) == 1 < len(two.rows)  # "Chocolate Milk" alone has both
    _, ranking = idx.query(["choc"], None, 2, mode=SearchMode.LEXICAL)
    assert len(ranking.lists[0].rows) == 2 and ranking.lists[0].legs == [("lexical",), ("lexical",)]
    assert ranking.lists[0].scores[0] >= ranking.lists[0].scores[1] > 0 and ranking.lexical_ns > 0


def test_filters_are_exact_case_insensitive_terms_on_both_fields(idx: ProductIndex) -> None:
    assert set(titles(idx, "choc", department=" Dairy Eggs")) == {"Chocolate Milk"}
    assert set(titles(idx, "mi", department="snacks", aisle="CANDY chocolate")) == {"Milky Way Minis"}
    # A filter is a whole value, not a word; a value no product has is refused with the near ones,
    # never answered with an empty shelf.
    with pytest.raises(InvalidInput, match="has aisle 'candy'; did you mean 'candy chocolate'"):
        titles(idx, "choc", aisle="candy")
    with pytest.raises(InvalidInput, match=r"no product in index version .* has department 'no such department'"):
        titles(idx, "bananas", department="no such department")
    with pytest.raises(InvalidInput, match="has no filter field 'brand'; its filter fields: department, aisle"):
        idx.query(["milk"], None, 5, mode=SearchMode.LEXICAL, filters={"brand": "acme"})


# Expected by hand from TITLES, never through the analyser under test: whole words match whole
# words, the last word (unless whitespace follows it) matches as a prefix, only titles are searched.
MILK = {"Organic Whole Milk", "Chocolate Milk", "Oat Milk Barista"}  # the word "milk"
MILK_ = MILK | {"Milky Way Minis"}  # the prefix "milk" (also "mi": milk, milky, minis)
CHOCOLATE = {"Chocolate Sandwich Cookies", "Dark Chocolate Bar 85%", "Chocolate Milk"}


@pytest.mark.parametrize(("text", "expected"), [
    ('"milk', MILK_), ('milk"', MILK_), ('"chocolate milk"', CHOCOLATE | MILK_), ("milk AND", MILK),
    ("NOT milk", MILK_), ("milk OR -bananas", MILK | {"Bananas"}), ("+milk -", MILK_), ("title:milk", MILK_),
    ("department:snacks", set()), ("mi*", MILK_), ("*", set()), ("?", set()), ("(milk", MILK_), ("milk)", MILK_),
    ("[milk TO z]", MILK), ("milk^5", MILK), ("milk~2", MILK), ("/mi.*/", MILK_), ("\\", set()),
    ("\x00milk", MILK_), ("🍌", set()), ("日本茶", set()), ("ｍｉｌｋ", MILK_), ("  ", set()), ("", set()),
    ("a" * 200, set()), (" ".join(["milk"] * 2000), MILK_),
])
def test_any_query_text_is_searched_safely(idx: ProductIndex, text: str, expected: set[str]) -> None:
    """Operators, quotes, field and regex syntax are characters, never tantivy query syntax."""
    assert set(titles(idx, text)) == expected


def test_quoted_and_operator_words_are_plain_words(idx: ProductIndex) -> None:
    assert titles(idx, "NOT bananas") == ["Bananas"]  # "not" is a word no title has, not a negation
    assert titles(idx, "title:bananas") == ["Bananas"]  # and "title" is not a field name
    assert titles(idx, '"chocolate milk"')[0] == "Chocolate Milk"


# --- the version folder: modes, older versions, hot swap ---------------------------------------
def test_hybrid_fuses_both_legs_and_says_which_found_each_hit(idx: ProductIndex) -> None:
    x = np.load(idx.index_root / idx.version / store.VECTORS_FILE)
    q = x[[7]]  # the semantic leg's nearest product is "Bananas" (its own vector)
    hits, ranking = idx.query(["choc"], q, 5, mode=SearchMode.HYBRID)
    legs = {h.fields["title"]: h.legs for h in hits[0]}
    assert set(legs) >= {"Chocolate Sandwich Cookies", "Dark Chocolate Bar 85%", "Chocolate Milk"}
    assert all(set(v) <= {"semantic", "lexical"} and v for v in legs.values())
    assert ranking.semantic_ns > 0 and ranking.lexical_ns > 0
    assert [h.score for h in hits[0]] == sorted((h.score for h in hits[0]), reverse=True)
    bananas, _ = idx.query(["bananas"], q, 3, mode=SearchMode.HYBRID)
    assert bananas[0][0].fields["title"] == "Bananas" and bananas[0][0].legs == ("semantic", "lexical")
    sem, _ = idx.query(["choc"], q, 3, mode=SearchMode.SEMANTIC)
    assert sem[0][0].fields["title"] == "Bananas" and all(h.legs == ("semantic",) for h in sem[0])
    assert [h.id for h in sem[0]] == [h.id for h in idx.search(q, 3)[0]]
    only_produce, _ = idx.query(["choc"], q, 10, mode=SearchMode.HYBRID, department="produce")
    assert only_produce[0] and all(h.fields["department"] == "produce" for h in only_produce[0])
    with pytest.raises(InvalidInput):
        idx.query(["choc", "milk"], q, 3, mode=SearchMode.HYBRID)  # one vector per text


def test_the_lexical_index_lives_inside_the_version_folder(s: Settings) -> None:
    version = publish(s, catalog())
    manifest = store.read_manifest(version)
    assert manifest["lexical"]["docs"] == len(TITLES) and manifest["lexical"]["dir"] == LEXICAL_DIR
    assert (version / LEXICAL_DIR / "meta.json").is_file()
    assert not [p for p in s.catalog.index_root.iterdir() if p.name.startswith(".tmp-")]


def older_version(s: Settings) -> Path:
    """A version as published before lexical search existed: no lexical/ folder, no manifest entry."""
    version = publish(s, catalog())
    shutil.rmtree(version / LEXICAL_DIR)
    manifest = store.read_manifest(version)
    del manifest["lexical"]
    (version / store.MANIFEST_FILE).write_text(json.dumps(manifest))
    return version


def test_an_older_version_without_a_lexical_index_serves_semantic_search(s: Settings) -> None:
    older_version(s)
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
    assert not idx.has_lexical
    q = vectors(1, seed=5)
    hits, ranking = idx.query(["choc"], q, 3, mode=SearchMode.HYBRID)  # hybrid degrades to semantic
    assert [h.id for h in hits[0]] == [h.id for h in idx.search(q, 3)[0]]
    assert all(h.legs == ("semantic",) for h in hits[0]) and ranking.lexical_ns == 0
    with pytest.raises(FailedPrecondition, match="no lexical index"):
        idx.query(["choc"], None, 3, mode=SearchMode.LEXICAL)


def test_hot_swap_replaces_both_indexes_together(s: Settings) -> None:
    older_version(s)
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
    renamed = [(t.replace("Chocolate", "Cocoa"), a, d) for t, a, d in TITLES]
    publish(s, catalog(renamed, tag=" v2"), seed=1)
    newer = idx.reloaded()
    assert newer is not None and newer.has_lexical and not idx.has_lexical  # the old object keeps its version
    assert set(titles(newer, "coco")) == {"Cocoa Sandwich Cookies v2", "Dark Cocoa Bar 85% v2", "Cocoa Milk v2"}
    assert titles(newer, "chocolate") == []
    x2 = np.load(newer.index_root / newer.version / store.VECTORS_FILE)
    assert newer.search(x2[:1], 1)[0][0].fields["title"] == "Cocoa Sandwich Cookies v2"  # FAISS swapped too


def test_a_version_whose_lexical_index_is_broken_is_not_swapped_in(s: Settings) -> None:
    publish(s, catalog())
    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL)
    bad = publish(s, catalog(tag=" bad"))
    manifest = store.read_manifest(bad)
    analyzer = manifest["lexical"]["analyzer"]
    manifest["lexical"]["analyzer"] = "something else"  # analysed otherwise than this code queries
    (bad / store.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert idx.reloaded() is None  # keeps serving the good one
    manifest["lexical"]["analyzer"] = analyzer
    (bad / store.MANIFEST_FILE).write_text(json.dumps(manifest))
    (bad / LEXICAL_DIR / "meta.json").write_text("{not json")
    assert idx.reloaded() is None
    assert "Chocolate Milk" in titles(idx, "choc")
