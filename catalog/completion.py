"""Completing a typeahead query's half-typed last word before it is embedded.

A shopper's "dairy free ice cr" ends in a fragment the embedding model does not understand, and
semantic search on short prefixes scored far below lexical (`embedcar catalog quality --prefixes`).
The lexical leg already reads the last word as a prefix; the semantic leg instead embeds the text
with that word completed to the catalog's most frequent word starting with it: "ice cr" ->
"ice cream". Nothing is trained: the vocabulary is the words of one index version's product
texts, analysed exactly as the lexical index analyses them (catalog.lexical.words: lowercased,
ASCII-folded), built once when the version is loaded and swapped with it.

The last word is left as typed when it is a whole known word (the shopper may mean just that) and
no longer word starting with it is WHOLE_WORD_RATIO times as frequent; when it is shorter than
MIN_PREFIX_CHARS (one letter says too little) or all digits (a quantity, not a word being spelled);
when anything but a letter or digit follows it (a trailing space or punctuation ends the word, as
the lexical leg's Terms has it); or when no known word starts with it.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog.lexical import words

MIN_PREFIX_CHARS = 2
# A whole word met a few times in the catalog does not stop the completion of a far more frequent one:
# in the grocery titles "cr" (1 title) / "cream" (1,285), "choc" (8) / "chocolate" (2,448), "org" (3) /
# "organic" (5,030); a whole word in common use ("bar" 1,001 / "bars") is kept. 10: chosen, not tuned.
WHOLE_WORD_RATIO = 10
# Bounded memory: the most frequent words only (a huge catalog's long tail is SKU codes and typos);
# the grocery catalog has ~11k distinct words.
MAX_WORDS = 200_000
# The analyzer drops words of 40+ characters (lexical.ANALYZER's remove_long(40)): a longer run at
# the end is no word, and the scan for it stops there whatever the text's length.
_MAX_WORD_CHARS = 39
_CHUNK_ROWS = 4096  # texts analysed per analyzer call: one call per text cost ~1.5x more at 50k titles
_LAST = chr(0x10FFFF)  # sorts after every character a word can hold: [p, p + _LAST) = the words starting with p


class Completer:
    """The vocabulary of one index version: sorted words, their counts, the best completion of a prefix."""

    def __init__(self, counts: Mapping[str, int], *, max_words: int = MAX_WORDS) -> None:
        kept: Iterable[str] = counts
        if len(counts) > max_words:  # ties broken by the word: the same catalog always keeps the same words
            kept = sorted(counts, key=lambda w: (-counts[w], w))[:max_words]
        self._words: list[str] = sorted(kept)
        self._counts: npt.NDArray[np.int64] = np.array([counts[w] for w in self._words], dtype=np.int64)

    @classmethod
    def from_texts(cls, texts: Iterable[str], *, max_words: int = MAX_WORDS) -> Completer:
        counts: Counter[str] = Counter()
        chunk: list[str] = []
        for t in texts:
            chunk.append(t)
            if len(chunk) == _CHUNK_ROWS:
                counts.update(words("\n".join(chunk)))
                chunk.clear()
        if chunk:
            counts.update(words("\n".join(chunk)))
        return cls(counts, max_words=max_words)

    @classmethod
    def from_table(cls, table: Any, text_fields: Sequence[str], *, max_words: int = MAX_WORDS) -> Completer:
        """From a version's products table (pyarrow): the fields its texts were composed of, read a slice
        at a time so a large catalog is never held as Python strings at once."""
        return cls.from_texts(_field_values(table, text_fields), max_words=max_words)

    def __len__(self) -> int:
        return len(self._words)

    def word(self, prefix: str) -> str | None:
        """The most frequent known word that `prefix` (an analysed word) begins and is not, or None
        (see the module doc). Equal counts: the alphabetically first, so answers are deterministic."""
        if len(prefix) < MIN_PREFIX_CHARS or prefix.isdigit():
            return None
        ws = self._words
        lo = bisect.bisect_left(ws, prefix)
        whole = int(self._counts[lo]) if lo < len(ws) and ws[lo] == prefix else 0
        first = lo + 1 if whole else lo  # the words strictly longer than the prefix start here
        hi = bisect.bisect_left(ws, prefix + _LAST, first)
        if first >= hi:
            return None  # no longer word starts with it
        best = first + int(np.argmax(self._counts[first:hi]))  # argmax: the first of equal counts
        return ws[best] if int(self._counts[best]) >= WHOLE_WORD_RATIO * whole else None

    def complete(self, text: str) -> str:
        """`text` with its last word completed (see the module doc); otherwise `text` unchanged."""
        start = len(text)
        while start > 0 and text[start - 1].isalnum():
            start -= 1
            if len(text) - start > _MAX_WORD_CHARS:
                return text
        tail = words(text[start:])
        if len(tail) != 1:
            return text
        # Python's isalnum and the analyzer's tokenizer (Rust's is_alphanumeric) may differ on a rare
        # character: the tail is only the last word if the character before it still splits it off.
        if start > 0 and words(text[start - 1:]) != tail:
            return text
        done = self.word(tail[0])
        return text if done is None else text[:start] + done


def _field_values(table: Any, text_fields: Sequence[str]) -> Iterable[str]:
    names = [f for f in text_fields if f in table.column_names]
    if not names:
        return
    for batch in table.select(names).to_batches(max_chunksize=_CHUNK_ROWS):
        columns = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
        for values in zip(*columns, strict=True):
            # A product's fields as compose_text joins them: a separator between fields.
            yield " | ".join(v for v in values if v)
