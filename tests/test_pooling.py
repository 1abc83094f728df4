from __future__ import annotations

import numpy as np
import pytest

from inference.errors import InvalidInput
from inference.pooling import pool

CLS, SEP, PAD = 101, 102, 0


def _hidden() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Two rows: [CLS a b SEP PAD] and [CLS c SEP PAD PAD], 2-d hidden states chosen by hand.
    h = np.array(
        [
            [[10, 0], [1, 1], [3, 3], [0, 10], [99, 99]],
            [[10, 0], [2, 4], [0, 10], [99, 99], [99, 99]],
        ],
        dtype=np.float32,
    )
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    ids = np.array([[CLS, 7, 8, SEP, PAD], [CLS, 9, SEP, PAD, PAD]])
    return h, mask, ids


def test_mean_over_attended_tokens_including_special() -> None:
    h, mask, _ids = _hidden()
    out = pool(h, mask, "mean", normalize=False)
    np.testing.assert_allclose(out[0], [(10 + 1 + 3 + 0) / 4, (0 + 1 + 3 + 10) / 4])
    np.testing.assert_allclose(out[1], [(10 + 2 + 0) / 3, (0 + 4 + 10) / 3])


def test_mean_excluding_special_leaves_cls_sep_out() -> None:
    h, mask, ids = _hidden()
    out = pool(h, mask, "mean_excluding_special", input_ids=ids, special_ids=(CLS, SEP, PAD),
               normalize=False)
    np.testing.assert_allclose(out[0], [2, 2])
    np.testing.assert_allclose(out[1], [2, 4])


def test_only_special_tokens_falls_back_to_all_attended() -> None:
    h = np.array([[[4, 0], [0, 2]]], dtype=np.float32)
    out = pool(h, np.array([[1, 1]]), "mean_excluding_special", input_ids=np.array([[CLS, SEP]]),
               special_ids=(CLS, SEP), normalize=False)
    np.testing.assert_allclose(out[0], [2, 1])


def test_padding_values_never_leak() -> None:
    h, mask, _ = _hidden()
    h2 = h.copy()
    h2[mask == 0] = -1e6
    np.testing.assert_allclose(pool(h, mask), pool(h2, mask))


def test_l2_normalised() -> None:
    h, mask, _ = _hidden()
    np.testing.assert_allclose(np.linalg.norm(pool(h, mask), axis=1), 1.0, rtol=1e-6)


def test_unknown_mode_and_bad_shapes_rejected() -> None:
    h, mask, _ = _hidden()
    with pytest.raises(InvalidInput, match="unknown pooling mode 'max'"):
        pool(h, mask, "max")
    with pytest.raises(InvalidInput, match="needs hidden"):
        pool(h[0], mask)
    with pytest.raises(InvalidInput, match="needs input_ids"):
        pool(h, mask, "mean_excluding_special")
