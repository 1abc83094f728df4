"""Masked mean pooling + L2 normalisation: the one implementation every backend uses.

The Triton `pooling` model imports this module too, so embedded and Triton answers agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from inference.errors import InvalidInput

# `mean`: average over every attended token, [CLS]/[SEP] included (how all-MiniLM-L6-v2 and most
# sentence-transformers models were trained). `mean_excluding_special`: leaves structural tokens
# out, right only for models fine-tuned that way.
POOLING_MODES = ("mean", "mean_excluding_special")


def params_from_config(params: dict[str, str]) -> tuple[str, tuple[int, ...]]:
    """(mode, special ids) from a Triton model's `mode` / `special_ids` string parameters."""
    return check_mode(params.get("mode", "mean")), tuple(int(x) for x in params.get("special_ids", "").split(",") if x)


def check_mode(mode: str) -> str:
    if mode not in POOLING_MODES:
        raise InvalidInput(f"unknown pooling mode {mode!r}; expected one of {', '.join(POOLING_MODES)}")
    return mode


def pool(
    hidden: npt.NDArray[np.floating],
    attention_mask: npt.NDArray[np.integer],
    mode: str = "mean",
    *,
    input_ids: npt.NDArray[np.integer] | None = None,
    special_ids: Sequence[int] = (),
    normalize: bool = True,
) -> npt.NDArray[np.float32]:
    """[B, L, H] hidden states + [B, L] mask -> [B, H] float32, L2-normalised by default."""
    check_mode(mode)
    if hidden.ndim != 3 or attention_mask.shape != hidden.shape[:2]:
        raise InvalidInput(
            f"pooling needs hidden [B, L, H] and mask [B, L]; got {hidden.shape} and {attention_mask.shape}"
        )
    mask = attention_mask.astype(bool)
    if mode == "mean_excluding_special":
        if input_ids is None or input_ids.shape != attention_mask.shape:
            raise InvalidInput("mean_excluding_special pooling needs input_ids shaped like the mask")
        keep = mask & ~np.isin(input_ids, np.asarray(special_ids, dtype=input_ids.dtype))
        # A text made only of special tokens (an empty query) falls back to all attended tokens.
        empty = ~keep.any(axis=1)
        keep[empty] = mask[empty]
        mask = keep
    weights = mask.astype(np.float32)[:, :, None]
    summed = (hidden.astype(np.float32, copy=False) * weights).sum(axis=1)
    counts = np.maximum(weights.sum(axis=1), 1e-9)
    out = (summed / counts).astype(np.float32, copy=False)
    return l2_normalize(out) if normalize else out


def l2_normalize(x: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    out: npt.NDArray[np.float32] = (x / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
    return out
