"""The common shopper query tokenized without the `tokenizers` pipeline, with the same ids.

`tokenizers` builds a whole Encoding per text (the normalised string's alignments, offsets, the
tokens' strings), and in the sidecar each query meets that code with cold caches: ~120 µs of a
Triton-backend query's ~0.9 ms of sidecar CPU. For a BERT-style tokenizer (BertNormalizer,
BertPreTokenizer, WordPiece, a fixed template such as `[CLS] $A [SEP]`) and a text of printable
ASCII, what the pipeline does reduces to: lowercase, split into runs of letters and digits and single
punctuation characters, look each word up (WordPiece's greedy longest match where it is not a
word of the vocabulary), add the template's tokens. That is what `AsciiWordPiece` does, in a few
dictionary look-ups (docs/benchmarks.md, levers: −0.105 ms of CPU per embedded unary query).

It answers only where the answer is certainly the library's and says None otherwise, for the
library to answer: a character outside printable ASCII (accents, other scripts, tabs and other
whitespace, control characters the normaliser would drop), an added token's text anywhere in it
(the library matches those before normalising), or more tokens than the truncation keeps. A
tokenizer of any other shape gets none (`from_tokenizer`). The tests hold it to the library's ids
on generated texts.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

# Printable ASCII apart from letters, digits and the space is punctuation to BertPreTokenizer
# (Rust's is_ascii_punctuation): each such character is a word of its own.
_WORDS = {True: re.compile(r"[a-z0-9]+|[^a-z0-9 ]"), False: re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 ]")}


class AsciiWordPiece:
    def __init__(self, vocab: dict[str, int], *, unk: int, prefix: str, max_word_chars: int, lowercase: bool,
                 head: list[int], tail: list[int], added: list[str], max_length: int | None) -> None:
        self._vocab = vocab
        self._pieces = {token[len(prefix):]: i for token, i in vocab.items() if token.startswith(prefix)}
        self._unk = unk
        self._max_word_chars = max_word_chars
        self._lowercase = lowercase
        self._words = _WORDS[lowercase]
        self._head = head
        self._tail = tail
        # Added tokens are matched in the raw text, case aside: a text with one goes to the library.
        self._added = re.compile("|".join(map(re.escape, added)), re.IGNORECASE) if added else None
        self._max_length = max_length  # the truncation's: a longer text goes to the library, which cuts it

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> AsciiWordPiece | None:
        """The shortcut for `tokenizer` as configured (no padding; its truncation kept), or None where
        its pipeline is not exactly the BERT shape this reproduces."""
        spec: dict[str, Any] = json.loads(tokenizer.to_str())
        normalizer, pre, model = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}, spec["model"]
        if (normalizer.get("type") != "BertNormalizer" or pre.get("type") != "BertPreTokenizer"
                or model.get("type") != "WordPiece" or spec.get("padding") is not None):
            return None
        ends = _template_ends(spec.get("post_processor"))
        if ends is None:
            return None
        vocab: dict[str, int] = model["vocab"]
        unk = vocab.get(model["unk_token"])
        if unk is None:
            return None
        truncation = spec.get("truncation")
        return cls(vocab, unk=unk, prefix=model["continuing_subword_prefix"],
                   max_word_chars=model["max_input_chars_per_word"], lowercase=bool(normalizer.get("lowercase")),
                   head=ends[0], tail=ends[1], added=[t["content"] for t in spec.get("added_tokens") or []],
                   max_length=truncation["max_length"] if truncation else None)

    def encode(self, text: str) -> list[int] | None:
        """The library's ids for `text` (special tokens included), or None where only it can say."""
        if not (text.isascii() and text.isprintable()) or (self._added is not None and self._added.search(text)):
            return None
        ids = list(self._head)
        vocab = self._vocab
        for word in self._words.findall(text.lower() if self._lowercase else text):
            whole = vocab.get(word)
            if whole is not None and len(word) <= self._max_word_chars:
                ids.append(whole)
            else:
                ids.extend(self._split(word))
        ids.extend(self._tail)
        return ids if self._max_length is None or len(ids) <= self._max_length else None

    def _split(self, word: str) -> list[int]:
        """WordPiece's greedy longest-match-first split of a word not in the vocabulary; [UNK] for the
        whole word where a part matches nothing or the word is too long."""
        if len(word) > self._max_word_chars:
            return [self._unk]
        out: list[int] = []
        start, n, table = 0, len(word), self._vocab
        while start < n:
            end = n
            while end > start and word[start:end] not in table:
                end -= 1
            if end == start:
                return [self._unk]
            out.append(table[word[start:end]])
            start, table = end, self._pieces
        return out


def _template_ends(post: dict[str, Any] | None) -> tuple[list[int], list[int]] | None:
    """The ids a single text's template puts before and after it, or None for another shape."""
    if post is None:
        return [], []
    if post.get("type") == "BertProcessing":
        return [post["cls"][1]], [post["sep"][1]]
    if post.get("type") != "TemplateProcessing":
        return None
    specials = post.get("special_tokens", {})
    ends: tuple[list[int], list[int]] = ([], [])
    seen = 0
    for piece in post["single"]:
        if "Sequence" in piece:
            if piece["Sequence"]["id"] != "A" or seen:
                return None
            seen = 1
        elif "SpecialToken" in piece:
            ends[seen].extend(specials[piece["SpecialToken"]["id"]]["ids"])
        else:
            return None
    return ends if seen else None
