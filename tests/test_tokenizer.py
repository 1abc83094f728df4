from __future__ import annotations

import numpy as np

from inference.manifest import Manifest
from inference.tokenizer import QueryTokenizer


def test_no_fixed_padding_and_model_max_length(tokenizer: QueryTokenizer, manifest: Manifest) -> None:
    enc = tokenizer.encode(["running shoes", "word " * 1000])
    assert enc.lengths[0] == 4  # [CLS] running shoes [SEP], not 128
    assert enc.lengths[1] == manifest.max_length == 256
    assert enc.truncated == [False, True]


def test_batch_padded_to_bucket_ceiling(tokenizer: QueryTokenizer, manifest: Manifest) -> None:
    q = "organic gluten free pasta sauce under 5 dollars family size with fresh basil and garlic"
    enc = tokenizer.encode([q, "tea"])
    batch = tokenizer.batch(enc.ids)
    assert 16 < enc.lengths[0] <= 32
    assert batch.shape == (2, 32)
    assert batch.attention_mask[1].sum() == enc.lengths[1]
    assert (batch.input_ids[1, enc.lengths[1]:] == manifest.pad_id).all()
    assert batch.token_type_ids is not None and not batch.token_type_ids.any()


def test_bucketed_groups_by_length(tokenizer: QueryTokenizer) -> None:
    texts = ["tea", "x " * 20, "milk", "y " * 40]
    groups = tokenizer.bucketed(tokenizer.encode(texts))
    shapes = {tuple(idx): b.shape for idx, b in groups}
    assert shapes == {(0, 2): (2, 16), (1,): (1, 32), (3,): (1, 64)}


def test_very_long_text_is_cut_before_tokenizing(tokenizer: QueryTokenizer) -> None:
    enc = tokenizer.encode(["a" * 100_000])
    assert enc.truncated == [True]
    assert enc.lengths[0] <= 256


def test_emoji_and_other_scripts(tokenizer: QueryTokenizer) -> None:
    enc = tokenizer.encode(["🍓🍓", "молоко", "牛奶", "حليب"])
    assert all(n >= 3 for n in enc.lengths)
    assert np.all([ids[0] == 101 and ids[-1] == 102 for ids in enc.ids])
