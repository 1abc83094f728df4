from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference.buckets import (
    DEFAULT_BUCKETS,
    bucket_for,
    buckets_for_max_length,
    group_by_bucket,
    split_batches,
)
from inference.errors import InvalidInput

lengths = st.integers(min_value=0, max_value=512)


@given(lengths)
def test_bucket_is_smallest_ceiling(n: int) -> None:
    b = bucket_for(n, DEFAULT_BUCKETS)
    assert b >= n
    smaller = [x for x in DEFAULT_BUCKETS if x < b]
    assert all(x < n for x in smaller)


def test_twenty_tokens_pad_to_32_not_128() -> None:
    assert bucket_for(20, DEFAULT_BUCKETS) == 32
    assert bucket_for(16, DEFAULT_BUCKETS) == 16
    assert bucket_for(17, DEFAULT_BUCKETS) == 32


def test_over_largest_bucket_is_an_error() -> None:
    with pytest.raises(InvalidInput, match="exceeds the largest bucket"):
        bucket_for(513, DEFAULT_BUCKETS)


@given(st.lists(lengths, max_size=200))
def test_grouping_is_a_partition_in_order(ls: list[int]) -> None:
    groups = group_by_bucket(ls, DEFAULT_BUCKETS)
    flat = sorted(i for idx in groups.values() for i in idx)
    assert flat == list(range(len(ls)))
    for b, idx in groups.items():
        assert idx == sorted(idx)
        assert all(bucket_for(ls[i], DEFAULT_BUCKETS) == b for i in idx)


@given(st.lists(st.integers(), max_size=100), st.integers(min_value=1, max_value=17))
def test_split_batches_bounded_and_complete(idx: list[int], size: int) -> None:
    chunks = split_batches(idx, size)
    assert all(0 < len(c) <= size for c in chunks)
    assert [i for c in chunks for i in c] == idx


def test_buckets_for_max_length_cut_at_model_limit() -> None:
    assert buckets_for_max_length(256) == (16, 32, 64, 128, 256)
    assert buckets_for_max_length(100) == (16, 32, 64, 100)
