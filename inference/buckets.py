"""Fixed-length sequence buckets: pad each sequence only up to its bucket's ceiling.

A 20-token query is padded to 32, not to 128 or 512: attention cost grows with the padded length,
and an inference server batches only requests of identical shape, so few shapes is what makes
dynamic batching work.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from inference.errors import InvalidInput

DEFAULT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)


def buckets_for_max_length(max_length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The default buckets cut at the first one that covers `max_length`."""
    kept = [b for b in sorted(buckets) if b < max_length]
    return (*kept, max_length)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= length. Lengths over the largest bucket are an error (truncate first)."""
    if length < 0:
        raise InvalidInput(f"negative sequence length {length}")
    i = bisect.bisect_left(buckets, length)
    if i == len(buckets):
        raise InvalidInput(f"sequence of {length} tokens exceeds the largest bucket {buckets[-1]}")
    return int(buckets[i])


def group_by_bucket(lengths: Sequence[int], buckets: Sequence[int]) -> dict[int, list[int]]:
    """Map bucket -> indices of the sequences that fall in it, in input order."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(bucket_for(n, buckets), []).append(i)
    return groups


def split_batches(indices: Sequence[int], max_batch: int) -> list[list[int]]:
    """Cut one bucket's indices into chunks of at most `max_batch`."""
    if max_batch <= 0:
        raise InvalidInput(f"max_batch must be positive, got {max_batch}")
    return [list(indices[i : i + max_batch]) for i in range(0, len(indices), max_batch)]


def plan_calls(lengths: Sequence[int], buckets: Sequence[int], max_items: int) -> list[tuple[int, list[int]]]:
    """The backend calls for sequences of `lengths`: (bucket, indices) per call, buckets ascending,
    at most `max_items` indices each. The one bucket/split plan of the sidecar and the catalog job."""
    return [(bucket, chunk)
            for bucket, idx in sorted(group_by_bucket(lengths, buckets).items())
            for chunk in split_batches(idx, max_items)]
