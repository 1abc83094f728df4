"""HF `tokenizers` with truncation at the manifest's max length, no fixed padding, and bucketing.

The shipped tokenizer.json of all-MiniLM-L6-v2 pads every input to 128: we switch that off, or
every query would cost 128 tokens. A model with a prompt for its texts' role (E5's "query: ")
gets it put before each text here, as sentence-transformers does, so callers never send it.
A BERT-style tokenizer's common query (printable ASCII) skips the library's pipeline for the same ids
(inference.wordpiece).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from inference.buckets import bucket_for, group_by_bucket
from inference.wordpiece import AsciiWordPiece

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """One backend call: same-shape [B, L] arrays, L a bucket length."""

    input_ids: IntArray
    attention_mask: IntArray
    token_type_ids: IntArray | None
    # Leading positions the pooling leaves out: the prompt, for a model that pools without it.
    pool_skip: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        b, n = self.input_ids.shape
        return int(b), int(n)

    def arrays(self) -> dict[str, IntArray]:
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids
        return out


@dataclass(frozen=True, slots=True)
class Encoded:
    """Token ids per text (unpadded) and whether each text was cut."""

    ids: list[list[int]]
    truncated: list[bool]

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.ids]


class QueryTokenizer:
    def __init__(
        self,
        tokenizer_file: Path,
        *,
        max_length: int,
        buckets: Sequence[int],
        pad_id: int,
        with_token_type_ids: bool,
        max_text_chars: int = 20_000,
        prompt: str = "",
        pool_skip: int = 0,
    ) -> None:
        self._tok = Tokenizer.from_file(str(tokenizer_file))
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=max_length)
        self.max_length = max_length
        self.buckets = tuple(buckets)
        self.pad_id = pad_id
        self.with_token_type_ids = with_token_type_ids
        self.max_text_chars = max_text_chars
        self.prompt = prompt
        self.pool_skip = pool_skip
        self._ascii = AsciiWordPiece.from_tokenizer(self._tok)  # None: every text through the library

    def encode(self, texts: Sequence[str]) -> Encoded:
        cut = [len(t) > self.max_text_chars for t in texts]
        if any(cut):
            texts = [t[: self.max_text_chars] for t in texts]
        if self.prompt:
            texts = [self.prompt + t for t in texts]
        shortcut = self._ascii
        ids = [shortcut.encode(t) for t in texts] if shortcut is not None else [None] * len(texts)
        truncated = list(cut)  # the shortcut answers only texts the truncation leaves whole
        rest = [i for i, x in enumerate(ids) if x is None]
        if rest:
            tok = self._tok
            encs = tok.encode_batch([texts[i] for i in rest]) if len(rest) > 1 else [tok.encode(texts[rest[0]])]
            for i, e in zip(rest, encs, strict=True):
                ids[i] = e.ids
                truncated[i] = truncated[i] or bool(e.overflowing)
        return Encoded(ids=cast(list[list[int]], ids), truncated=truncated)

    def batch(self, ids: Sequence[Sequence[int]], length: int | None = None) -> TokenBatch:
        """Pad `ids` to `length` (default: the bucket of the longest) as one [B, L] batch."""
        longest = max(len(x) for x in ids)
        n = bucket_for(longest, self.buckets) if length is None else length
        input_ids = np.full((len(ids), n), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(ids), n), dtype=np.int64)
        for row, seq in enumerate(ids):
            input_ids[row, : len(seq)] = seq
            mask[row, : len(seq)] = 1
        types = np.zeros_like(input_ids) if self.with_token_type_ids else None
        return TokenBatch(input_ids, mask, types, self.pool_skip)

    def bucketed(self, encoded: Encoded) -> list[tuple[list[int], TokenBatch]]:
        """One (original indices, batch) pair per bucket present in `encoded`."""
        groups = group_by_bucket(encoded.lengths, self.buckets)
        return [
            (idx, self.batch([encoded.ids[i] for i in idx], length=b))
            for b, idx in sorted(groups.items())
        ]
