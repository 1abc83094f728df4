"""Attributes typed by a shopper: mined from the catalog's titles, matched as phrases on the lexical
leg, a negated one never matched by its positive word, and in hybrid the products carrying every
typed attribute first. Real tantivy and FAISS; vectors random (the semantic leg favours non-carriers
as often as not, which is what the hybrid ordering must overcome)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from catalog import store
from catalog.attributes import Typed, Vocabulary, candidates, mine
from catalog.fusion import SearchMode
from catalog.index import ProductIndex
from catalog.lexical import words
from catalog.publish import publish_index
from catalog.sources import Product
from embedcar_settings import Settings

MODEL = "test-model@0000/fp32"
TITLES = [
    "Dairy Free Ice Cream Sandwich", "Vanilla Ice Cream Sandwiches", "Chocolate Ice Cream Sandwich",
    "Dairy-Free Chocolate Frozen Dessert", "Dairy Free Cheddar Shreds", "Neapolitan Ice Cream Sandwich",
    "Mini Ice Cream Sandwiches Dairy Dessert", "Gluten Free Pasta Penne", "Penne Pasta", "Gluten Free Bread",
    "Gluten-Free Crackers", "Low Sodium Chicken Soup", "Chicken Noodle Soup", "Low Fat Sodium Rich Soup",
    "Low Sodium Broth", "Low Sodium Soy Sauce", "Unsweetened Almond Milk", "Sweetened Almond Milk",
    "Sweetened Condensed Milk",
    "Non GMO Tortilla Chips", "Non GMO Corn", "Non GMO Popcorn", "Sugar Free Gum", "Sugar Free Syrup",
    "Sugar Free Candy", "Cane Sugar",
]


def test_attributes_are_mined_by_their_shapes_and_counted_by_product() -> None:
    docs = [words(t) for t in TITLES]
    mined = mine(docs)
    assert mined == {"dairy free": 3, "gluten free": 3, "low sodium": 3, "non gmo": 3, "sugar free": 3}
    assert "sugar free" not in mine(docs[:-2])  # two products: a title's accident, not an attribute
    assert "unsweetened" in candidates(words("Unsweetened Almond Milk"), frozenset({"sweetened"}))
    assert "unsweetened" not in candidates(words("Unsweetened Almond Milk"), frozenset())


def test_typed_attributes_take_their_words_out_of_the_word_match() -> None:
    vocab = Vocabulary(["dairy free", "low sodium", "unsweetened"])
    t = vocab.typed(["dairy", "free", "ice", "cream", "sandwich"])
    assert t.attributes == ("dairy free",) and t.words == ("ice", "cream", "sandwich")
    t = vocab.typed(["free", "dairy", "low", "sodium", "unsweetened", "milk"])
    assert t.attributes == ("low sodium", "unsweetened") and t.words == ("free", "dairy", "milk")
    # The full query comes without a trailing space: a last word typed to its end completes the attribute.
    assert vocab.typed(["dairy"], "free") == Typed(("dairy free",), (), None)
    assert vocab.typed(["dairy"], "fr") == Typed((), ("dairy",), "fr")
    assert vocab.typed([], "unsweetened") == Typed(("unsweetened",), (), None)


@pytest.fixture
def idx(settings: Settings, tmp_path: Path) -> ProductIndex:
    s = settings.with_section("catalog", index_root=tmp_path / "idx", use_gpu=False)
    products = [Product(f"p{i}", {"title": t}, i + 1) for i, t in enumerate(TITLES)]
    x = np.random.default_rng(3).normal(size=(len(products), 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    version, _ = publish_index(s, x, products, {"model_id": MODEL, "text_fields": ["title"]}, index_type="flat")
    manifest = store.read_manifest(version)
    assert manifest["attributes"]["dairy free"] == 3 and manifest["lexical"]["attributes"]
    return ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL, use_gpu=False)


def search(idx: ProductIndex, text: str, mode: SearchMode, k: int = 10) -> list[tuple[str, tuple[str, ...]]]:
    vec = None
    if mode != SearchMode.LEXICAL:  # a random query vector: the semantic leg has no idea of attributes
        vec = np.random.default_rng(len(text)).normal(size=(1, 16)).astype(np.float32)
    hits, _ = idx.query([text], vec, k, mode=mode)
    return [(h.fields["title"], h.matched) for h in hits[0]]


def test_a_negated_attribute_is_never_matched_by_its_positive_word(idx: ProductIndex) -> None:
    got = search(idx, "dairy free ice cream sandwich", SearchMode.LEXICAL)
    assert got[0] == ("Dairy Free Ice Cream Sandwich", ("dairy free",))
    assert {t for t, _m in got} <= {"Dairy Free Ice Cream Sandwich", "Dairy-Free Chocolate Frozen Dessert",
                                    "Dairy Free Cheddar Shreds"}  # never "... Dairy Dessert", never dairy
    assert all(m == ("dairy free",) for _t, m in got)
    # The phrase, not its words apart: "Low Fat Sodium Rich Soup" has both words, not the attribute.
    assert [t for t, _m in search(idx, "low sodium soup", SearchMode.LEXICAL)] == ["Low Sodium Chicken Soup"]
    assert {t for t, _m in search(idx, "low sodium ", SearchMode.LEXICAL)} == {
        "Low Sodium Chicken Soup", "Low Sodium Broth", "Low Sodium Soy Sauce"}
    # Still typing the attribute: its words are matched as words until it is complete.
    assert "Mini Ice Cream Sandwiches Dairy Dessert" in {t for t, _m in search(idx, "dairy fr", SearchMode.LEXICAL)}


@pytest.mark.parametrize("text, attribute", [("dairy free ice cream sandwich", "dairy free"),
                                             ("gluten free pasta", "gluten free"), ("sugar free", "sugar free"),
                                             ("non gmo chips", "non gmo"), ("low sodium soup", "low sodium")])
def test_hybrid_puts_the_products_carrying_the_typed_attribute_first(idx: ProductIndex, text: str,
                                                                     attribute: str) -> None:
    got = search(idx, text, SearchMode.HYBRID, k=8)
    carriers = [i for i, (_t, m) in enumerate(got) if m == (attribute,)]
    assert carriers and carriers == list(range(len(carriers))), got  # every carrier before every other
    assert all(attribute.replace(" ", "") in t.lower().replace(" ", "").replace("-", "") for t, _m in
               got[:len(carriers)])
    # Semantic search says which typed attribute a hit carries too.
    assert all(m in ((), (attribute,)) for _t, m in search(idx, text, SearchMode.SEMANTIC))


def test_attribute_queries_label_the_products_with_the_attribute_and_the_type(tmp_path: Path) -> None:
    from catalog.quality import attribute_queries

    f = tmp_path / "q.csv"
    f.write_text("query,attribute\ndairy free ice cream sandwich,dairy free\nlow sodium soup,low sodium\n"
                 "sugar free tofu,sugar free\n", encoding="utf-8")
    products = [Product(f"p{i}", {"title": t}, i + 1) for i, t in enumerate(TITLES)]
    both, carried = attribute_queries(products, f)
    assert both.queries == carried.queries == ["dairy free ice cream sandwich", "low sodium soup"]  # no tofu
    assert [{TITLES[i] for i in r} for r in both.relevant] == [{"Dairy Free Ice Cream Sandwich"},
                                                              {"Low Sodium Chicken Soup"}]
    assert {TITLES[i] for i in carried.relevant[1]} == {"Low Sodium Chicken Soup", "Low Sodium Broth",
                                                        "Low Sodium Soy Sauce"}  # not "Low Fat Sodium Rich"
