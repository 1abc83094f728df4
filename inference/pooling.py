"""Pooling of token states into one vector per text: the one implementation every backend uses.

The Triton encoder and `pooling` models import this module too (through inference/head.py), so
embedded and Triton answers agree. Modes follow sentence-transformers' `1_Pooling/config.json`:

    mean                    average over every attended token, [CLS]/[SEP] included (how
                            all-MiniLM-L6-v2 and most sentence-transformers models were trained)
    cls                     the first token's state (the BGE family)
    max                     elementwise maximum over attended tokens
    lasttoken               the last attended token's state (decoder-style embedders; right padding)
    mean_excluding_special  the reference design's mean that leaves structural tokens out: right
                            only for a model fine-tuned that way (it differs from `mean`)

NaN-safe: masked-out positions are selected away (`np.where`), never multiplied by 0, so a NaN in a
padded row (fp16 local attention over an all-padding window) cannot spread into a text's vector.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from inference.errors import Internal, InvalidInput

POOLING_MODES = ("mean", "cls", "max", "lasttoken", "mean_excluding_special")


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
    skip: int = 0,
) -> npt.NDArray[np.float32]:
    """[B, L, H] hidden states + [B, L] mask -> [B, H] float32, L2-normalised by default.

    `skip`: leading positions left out of the pool (a prompt whose model pools without it:
    sentence-transformers' `include_prompt: false` drops [CLS] and the prompt's tokens).
    """
    check_mode(mode)
    if hidden.ndim != 3 or attention_mask.shape != hidden.shape[:2]:
        raise InvalidInput(
            f"pooling needs hidden [B, L, H] and mask [B, L]; got {hidden.shape} and {attention_mask.shape}"
        )
    mask = attention_mask.astype(bool)
    if skip > 0:
        mask = mask.copy()
        mask[:, :skip] = False
    h = hidden.astype(np.float32, copy=False)
    if mode == "cls":
        out = h[:, 0, :].copy()
    elif mode == "lasttoken":
        last = np.where(mask.any(axis=1), hidden.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1), hidden.shape[1] - 1)
        out = h[np.arange(h.shape[0]), last, :].copy()
    else:
        if mode == "mean_excluding_special":
            if input_ids is None or input_ids.shape != attention_mask.shape:
                raise InvalidInput("mean_excluding_special pooling needs input_ids shaped like the mask")
            keep = mask & ~np.isin(input_ids, np.asarray(special_ids, dtype=input_ids.dtype))
            # A text made only of special tokens (an empty query) falls back to all attended tokens.
            empty = ~keep.any(axis=1)
            keep[empty] = mask[empty]
            mask = keep
        sel = mask[:, :, None]
        if mode == "max":
            # sentence-transformers puts -1e9 at masked positions; the same for a row with none kept.
            out = np.where(sel, h, np.float32(-1e9)).max(axis=1)
        else:
            summed = np.where(sel, h, np.float32(0)).sum(axis=1)
            counts = np.maximum(mask.sum(axis=1, dtype=np.float32)[:, None], 1e-9)
            out = summed / counts
    out = out.astype(np.float32, copy=False)
    return l2_normalize(out) if normalize else out


def l2_normalize(x: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    out: npt.NDArray[np.float32] = (x / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
    return out


def check_finite(emb: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """`emb` unchanged, or Internal when any value is NaN/inf: a bad vector is never an answer."""
    if not np.isfinite(emb).all():
        rows = np.flatnonzero(~np.isfinite(emb).all(axis=1))
        raise Internal(f"the model produced a non-finite embedding for {rows.size} of {emb.shape[0]} "
                       f"texts (rows {rows[:8].tolist()}): refusing to answer with it")
    return emb
