"""Completing the half-typed last word of a query before it is embedded (catalog/completion.py):
the vocabulary's rules, the index's `embedding_texts` (the one place that decides what the semantic
leg embeds) and a real sidecar's Search with `catalog.complete_last_word` on."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from catalog.completion import MIN_PREFIX_CHARS, WHOLE_WORD_RATIO, Completer
from catalog.index import ProductIndex
from embedcar_client.client import Client
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.tokenizer import QueryTokenizer
from sidecar.app import SidecarThread
from tests.fixtures_sidecar import sidecar_settings
from tests.test_catalog_lexical import MODEL, TITLES, catalog
from tests.test_catalog_lexical import publish as publish_synthetic
from tests.test_sidecar_reliability import wait_for
from tests.test_sidecar_search import PRODUCTS
from tests.test_sidecar_search import publish as publish_real

VOCAB = Completer({"ice": 40, "iced": 3, "cream": 12, "creamer": 5, "crackers": 7, "cr": 1, "chai": 4, "chia": 4,
                   "12": 9, "128": 30, "oz": 50})


def test_the_last_word_is_completed_to_the_most_frequent_word_it_begins() -> None:
    assert VOCAB.complete("dairy free ice cr") == "dairy free ice cream"  # cream 12 > crackers 7 > creamer 5
    assert VOCAB.complete("ice crac") == "ice crackers"
    assert VOCAB.complete("ch") == "chai"  # equal counts: the alphabetically first, every time
    assert VOCAB.complete("ice, cr") == "ice, cream"  # only the last word changes; the rest is as typed


def test_whole_words_and_what_cannot_be_completed_are_left_as_typed() -> None:
    assert VOCAB.complete("ic") == "ice"
    assert VOCAB.complete("ice") == "ice"  # a whole word in use: "iced" is not 10x as frequent
    assert VOCAB.complete("creamer") == "creamer"  # a whole word nothing longer starts with
    # A whole word of one title under one WHOLE_WORD_RATIO times as frequent: the likelier meaning.
    assert VOCAB.complete("cr") == "cream"
    assert Completer({"cr": 2, "cream": 2 * WHOLE_WORD_RATIO}).complete("cr") == "cream"
    assert Completer({"cr": 2, "cream": 2 * WHOLE_WORD_RATIO - 1}).complete("cr") == "cr"
    for text in ("ice zq",  # no known word starts with it
                 "c",  # shorter than MIN_PREFIX_CHARS
                 "oz 12",  # digits: a quantity, not a word being spelled
                 "ice cr ", "ice cr.", "ice cr!",  # a space or punctuation ended the word
                 "ice " + "cr" * 30):  # no word: the analyzer drops 40+ characters
        assert VOCAB.complete(text) == text, text
    assert MIN_PREFIX_CHARS == 2


def test_case_accents_and_width_are_folded_as_the_lexical_index_folds_them() -> None:
    vocab = Completer.from_texts(["Crème Brûlée Yogurt", "Crème Fraîche", "Greek Yogurt Plain"])
    assert vocab.complete("CRÈ") == "creme"  # the vocabulary's words are lowercased, ASCII-folded
    assert vocab.complete("vanilla Brû") == "vanilla brulee"
    assert vocab.complete("greek ｙｏ") == "greek yogurt"  # fullwidth letters
    assert vocab.complete("GREEK") == "GREEK"  # whole: left exactly as typed


def test_empty_text_and_an_empty_vocabulary() -> None:
    assert VOCAB.complete("") == ""
    assert VOCAB.complete("   ") == "   "
    assert Completer.from_texts([]).complete("ice cr") == "ice cr"


def test_the_vocabulary_is_bounded_and_deterministic() -> None:
    texts = ["Organic Whole Milk", "Oat Milk", "Organic Oats", "Milky Way Minis"] * 3
    full = Completer.from_texts(texts)
    assert len(full) == 8
    # max_words keeps the most frequent words; equal counts kept by the word, whatever the input order
    small = Completer.from_texts(texts, max_words=2)
    assert len(small) == 2 and small.complete("mi") == "milk" and small.complete("or") == "organic"
    assert len(Completer.from_texts(reversed(texts), max_words=2)) == 2
    assert Completer.from_texts(reversed(texts), max_words=2).complete("wa") == "wa"  # "way": not kept
    table = pa.table({"id": ["a", "b"], "title": ["Oat Milk", "Organic Oats"], "brand": ["Oatly", ""]})
    assert Completer.from_table(table, ["title", "brand"]).complete("oatl") == "oatly"
    assert Completer.from_table(table, ["title"]).complete("oatl") == "oatl"
    assert Completer.from_table(table, ["missing"]).complete("oa") == "oa"


@pytest.mark.parametrize("on", [False, True])
def test_the_index_decides_what_is_embedded_and_a_swap_replaces_the_vocabulary(settings: Settings,
                                                                               tmp_path: Path, on: bool) -> None:
    s = settings.with_section("catalog", index_root=tmp_path / "idx", use_gpu=False, complete_last_word=on)
    publish_synthetic(s, catalog())
    idx = ProductIndex.from_settings(s.catalog, expected_model_id=MODEL)
    typed = ["oat mi", "chocolate ", "bana"]
    assert idx.embedding_texts(typed) == (["oat milk", "chocolate ", "bananas"] if on else typed)
    assert idx.embedding_texts(["bana"], max_chars=6) == ["bana"]  # "bananas" would be refused: as typed
    publish_synthetic(s, catalog([*TITLES[:7], *[("Banana Bread", "bakery", "bakery")] * 3]))  # no "bananas"
    newer = idx.reloaded()
    assert newer is not None and newer.embedding_texts(["bana"]) == (["banana"] if on else ["bana"])


def test_search_with_completion_embeds_the_completed_query(settings: Settings, onnx_backend: OnnxBackend,
                                                          tokenizer: QueryTokenizer, tmp_path: Path) -> None:
    root = tmp_path / "index"
    publish_real(settings, root, onnx_backend, tokenizer, PRODUCTS)
    s = sidecar_settings(settings, http_port=-1, index_dir=root).with_section("catalog", use_gpu=False,
                                                                               complete_last_word=True)
    with SidecarThread(s, backend=onnx_backend) as sc, Client(sc.grpc_target) as c:
        assert wait_for(lambda: sc.index.current() is not None)
        typed = c.search(["oat mi"], k=5)  # "mi": "milk" (2 titles) over "mix" (1)
        completed = c.search(["oat milk"], k=5)
        assert [(h.id, h.score) for h in typed.hits[0]] == [(h.id, h.score) for h in completed.hits[0]]
        # Cached under the text actually embedded: the completed query finds the typed one's vector.
        assert typed.cache_hits == [False] and completed.cache_hits == [True]
        many = c.search(["oat mi"] * 20, k=5)  # a batch over TOKENIZE_ON_LOOP_MAX is completed off the loop
        assert many.cache_hits == [True] * 20 and all(hits == completed.hits[0] for hits in many.hits)
        # The lexical leg still reads "mi" as a prefix: the salad "mix" (p8), which "milk" would not find.
        hybrid = c.search(["oat mi"], k=5, mode="hybrid")
        assert hybrid.hits[0][0].id == "p2"
        assert any(h.id == "p8" and "lexical" in h.legs for h in hybrid.hits[0])
        assert set(typed.timings_ns) == set(c.search(["chocolate"], k=5).timings_ns)  # same reply shape
