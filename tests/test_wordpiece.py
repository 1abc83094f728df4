"""The ASCII WordPiece shortcut gives the `tokenizers` library's ids, or leaves the text to it.

Held to the library on generated texts for two tokenizers: the shipped model's (30k words: most
words whole) and a tiny one trained in the test (160 words: most words split into pieces or
[UNK]), with the same truncation and padding settings the sidecar gives them.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from inference.tokenizer import QueryTokenizer
from inference.wordpiece import AsciiWordPiece
from tests.fixtures_models import CORPUS, tokenizer_files

# Printable ASCII, words the vocabularies know, the added tokens, and what the shortcut leaves alone.
WORDS = ["organic", "milk", "gluten", "free", "running", "shoes", "pasta", "x" * 101, "[CLS]", "[mask]", "[SEP]"]
texts = st.lists(
    st.one_of(
        st.text(alphabet=string.printable[:95], max_size=12),
        st.sampled_from(WORDS + [w.upper() for w in WORDS]),
        st.sampled_from(["é", "\t", "\n", "\x00", "\x7f", "牛奶", "🍓", " ", "  "]),
    ),
    max_size=40,
).map("".join)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> QueryTokenizer:
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer_files(folder)
    return QueryTokenizer(folder / "tokenizer.json", max_length=32, buckets=(16, 32), pad_id=0,
                          with_token_type_ids=True)


def library_ids(tok: QueryTokenizer, text: str) -> tuple[list[int], bool]:
    enc = tok._tok.encode(text)
    return enc.ids, bool(enc.overflowing)


@pytest.mark.parametrize("name", ["shipped", "tiny"])
def test_common_queries_take_the_shortcut(name: str, tokenizer: QueryTokenizer, tiny: QueryTokenizer) -> None:
    tok = tokenizer if name == "shipped" else tiny
    shortcut = tok._ascii
    assert shortcut is not None
    for text in ["organic gluten-free pasta, 2 x 500g", "Running Shoes size 10!", *CORPUS[:20]]:
        assert shortcut.encode(text) == library_ids(tok, text)[0], text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_same_ids_as_the_library(text: str, tokenizer: QueryTokenizer, tiny: QueryTokenizer) -> None:
    for tok in (tokenizer, tiny):
        assert tok._ascii is not None
        ids, cut = library_ids(tok, text)
        fast = tok._ascii.encode(text)
        if fast is not None:
            assert fast == ids
            assert not cut
        enc = tok.encode([text])
        assert enc.ids == [ids] and enc.truncated == [cut]


def test_what_only_the_library_answers(tiny: QueryTokenizer) -> None:
    shortcut = tiny._ascii
    assert shortcut is not None
    for text in ["café au lait", "milk\tbread", "milk [MASK] bread", "milk [cls]", "word " * 40, "a\x00b"]:
        assert shortcut.encode(text) is None, text
    mixed = ["milk bread", "café", "word " * 40, "tea"]
    enc = tiny.encode(mixed)  # answered in order, mixed
    for i, text in enumerate(mixed):
        assert enc.ids[i] == library_ids(tiny, text)[0]
    assert enc.truncated == [False, False, True, False]


def test_other_pipelines_get_no_shortcut(tmp_path: Path) -> None:
    tokenizer_files(tmp_path)
    base = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert AsciiWordPiece.from_tokenizer(base) is not None

    other_normalizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    other_normalizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    other_split = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    other_split.pre_tokenizer = pre_tokenizers.Whitespace()
    padded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    padded.enable_padding(length=16)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.normalizer = normalizers.BertNormalizer()
    bpe.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    for tok in (other_normalizer, other_split, padded, bpe):
        assert AsciiWordPiece.from_tokenizer(tok) is None
