from __future__ import annotations

import numpy as np
import pytest

from inference.errors import Internal, InvalidInput
from inference.head import Dense, Head
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
    with pytest.raises(InvalidInput, match="unknown pooling mode 'weightedmean'"):
        pool(h, mask, "weightedmean")
    with pytest.raises(InvalidInput, match="needs hidden"):
        pool(h[0], mask)
    with pytest.raises(InvalidInput, match="needs input_ids"):
        pool(h, mask, "mean_excluding_special")


def test_cls_max_and_lasttoken_pick_what_sentence_transformers_picks() -> None:
    h, mask, _ = _hidden()
    np.testing.assert_allclose(pool(h, mask, "cls", normalize=False), [[10, 0], [10, 0]])
    # max over attended tokens only: the padding's 99s never win
    np.testing.assert_allclose(pool(h, mask, "max", normalize=False), [[10, 10], [10, 10]])
    # the last attended token: SEP of each row, whatever the padding after it
    np.testing.assert_allclose(pool(h, mask, "lasttoken", normalize=False), [[0, 10], [0, 10]])


def test_skip_leaves_a_prompt_out_of_the_pool() -> None:
    h, mask, _ = _hidden()
    # skip 2 ([CLS] + one prompt token): row 0 pools b and SEP, row 1 pools SEP only
    out = pool(h, mask, "mean", normalize=False, skip=2)
    np.testing.assert_allclose(out, np.array([[1.5, 6.5], [0.0, 10.0]], dtype=np.float32))


def test_a_nan_in_padding_does_not_spread_into_the_text() -> None:
    # fp16 local attention over a window of only padding gives NaN there (0 x NaN = NaN if multiplied)
    h, mask, ids = _hidden()
    h[1, 3:] = np.nan
    clean = _hidden()[0]
    for mode in ("mean", "max", "lasttoken", "cls", "mean_excluding_special"):
        got = pool(h, mask, mode, input_ids=ids, special_ids=(CLS, SEP, PAD))
        want = pool(clean, mask, mode, input_ids=ids, special_ids=(CLS, SEP, PAD))
        np.testing.assert_allclose(got, want, err_msg=mode)


def test_a_non_finite_embedding_is_an_error_not_an_answer() -> None:
    h, mask, _ = _hidden()
    h[0, 1] = np.nan  # inside the text: nothing to select away
    with pytest.raises(Internal, match="non-finite embedding for 1 of 2 texts"):
        Head("mean")(h, mask)


def test_head_runs_dense_then_normalises_as_configured() -> None:
    h, mask, _ = _hidden()
    w = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]], dtype=np.float32)
    b = np.array([0.0, 0.0, -1.0], dtype=np.float32)
    pooled = pool(h, mask, "mean", normalize=False)
    raw = Head("mean", dense=(Dense(w, b, "Tanh"),), normalize=False)(h, mask)
    np.testing.assert_allclose(raw, np.tanh(pooled @ w.T + b).astype(np.float32), rtol=1e-6)
    unit = Head("mean", dense=(Dense(w, b, "Identity"),))(h, mask)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-6)
    assert unit.shape == (2, 3)
