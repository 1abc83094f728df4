"""Padding of one in-process forward pass: to its longest sequence, not to its bucket's ceiling.

Buckets exist for an inference server that batches only identical shapes (Triton, a TensorRT
engine). An in-process ONNX Runtime call takes any length, and on a CPU the padded tokens cost
as much as real ones: one 20-token query padded to 32 spends about a third of its forward pass on
padding. Columns that are padding in every row change no embedding (attention masks them, and
pooling reads only attended tokens), so they are cut before the call.
"""

from __future__ import annotations

import numpy as np

from inference.tokenizer import TokenBatch


def tight_length(attention_mask: np.ndarray, multiple: int = 1) -> int:
    """The batch's longest attended length (last attended column + 1), rounded up to `multiple`,
    never beyond the batch's own length."""
    width = int(attention_mask.shape[1])
    cols = np.flatnonzero(attention_mask.any(axis=0))
    longest = int(cols[-1]) + 1 if cols.size else 1
    step = max(1, multiple)
    return min(width, -(-longest // step) * step)


def trim(batch: TokenBatch, multiple: int = 1) -> TokenBatch:
    """`batch` without the trailing columns that are padding in every row (kept to a `multiple`)."""
    n = tight_length(batch.attention_mask, multiple)
    if n == batch.shape[1]:
        return batch
    types = None if batch.token_type_ids is None else np.ascontiguousarray(batch.token_type_ids[:, :n])
    return TokenBatch(np.ascontiguousarray(batch.input_ids[:, :n]), np.ascontiguousarray(batch.attention_mask[:, :n]),
                      types, batch.pool_skip)
