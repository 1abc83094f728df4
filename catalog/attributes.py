"""The catalog's attribute vocabulary: modifiers a shopper types and a product either has or has not.

Mined from the catalog's own titles at build time (no list per catalog), by the shapes attributes
take in product titles, on the lexical index's words (lowercased, ASCII-folded):

    negations      "<word> free", "no <word>", "non <word>"  (dairy free, no salt, non gmo)
    qualifiers     "low|reduced|zero|high <word>"              (low sodium, reduced fat, zero sugar)
    un-words       "un<word>" where <word> is a catalog word  (unsweetened, unsalted, uncured)

each kept when at least MIN_PRODUCTS products carry it. The version's manifest records the vocabulary;
the lexical index stores each product's attributes as terms (catalog/lexical.py).

At query time the attributes typed in full are found among the query's whole words. A phrase is
then matched as one term, never by its words apart, so "dairy free" is not matched by "dairy", and
"low sodium" not by "low" in one place and "sodium" in another; hybrid Search ranks the products
that carry every typed attribute above those that do not (catalog/fusion.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NEGATION_AFTER = ("free",)  # "<word> free"
NEGATION_BEFORE = ("no", "non")  # "no <word>", "non <word>"
QUALIFIERS = ("low", "reduced", "zero", "high")  # "<qualifier> <word>"
MIN_PRODUCTS = 3  # a phrase fewer products carry is a title's accident, not an attribute
MIN_WORD_CHARS = 3  # "no 2" or "un" + "it" are not attributes
MAX_ATTRIBUTES = 2000  # the most frequent; a catalog's real attribute vocabulary is far smaller


def candidates(words: Sequence[str], vocabulary: frozenset[str] | None = None) -> list[str]:
    """The attribute shapes in one title's words (each once, in order). `vocabulary`: the catalog's
    words, for un-words (None: none are taken)."""
    out: dict[str, None] = {}
    for a, b in itertools.pairwise(words):
        negated_after = b in NEGATION_AFTER and a not in NEGATION_AFTER and len(a) >= MIN_WORD_CHARS and a.isalpha()
        qualified = (a in NEGATION_BEFORE or a in QUALIFIERS) and len(b) >= MIN_WORD_CHARS and b.isalpha()
        if negated_after or qualified:
            out[f"{a} {b}"] = None
    if vocabulary is not None:
        for w in words:
            if w.startswith("un") and len(w) >= 2 + MIN_WORD_CHARS + 2 and w[2:] in vocabulary:
                out[w] = None
    return list(out)


def mine(titles: Iterable[Sequence[str]]) -> dict[str, int]:
    """The attribute vocabulary of a catalog's analysed titles: attribute -> products carrying it."""
    docs = [list(ws) for ws in titles]
    vocabulary = frozenset(w for ws in docs for w in ws)
    counts: Counter[str] = Counter()
    for ws in docs:
        counts.update(candidates(ws, vocabulary))
    kept = [(a, n) for a, n in counts.most_common(MAX_ATTRIBUTES) if n >= MIN_PRODUCTS]
    return dict(sorted(kept))


@dataclass(frozen=True, slots=True)
class Typed:
    """What a query's whole words say about attributes: those typed in full, and the words left to
    match as words (an attribute's own words are matched only as the attribute)."""

    attributes: tuple[str, ...]
    words: tuple[str, ...]
    prefix: str | None = None  # the half-typed last word, unless it completed an attribute


class Vocabulary:
    """One version's attributes, to find them in query words."""

    def __init__(self, attributes: Iterable[str]) -> None:
        self.attributes = frozenset(attributes)
        self._phrases = {tuple(a.split(" ")) for a in self.attributes if " " in a}

    def __bool__(self) -> bool:
        return bool(self.attributes)

    def typed(self, words: Sequence[str], prefix: str | None = None) -> Typed:
        """The attributes among `words` (whole words, in the order typed) and the other words. A
        last word typed up to its end (`prefix` equal to an attribute's last word: "gluten free")
        completes the attribute, as the full query is sent without a trailing space."""
        if prefix is not None and self._complete(words, prefix):
            words, prefix = [*words, prefix], None
        found: dict[str, None] = {}
        rest: list[str] = []
        i = 0
        while i < len(words):
            pair = tuple(words[i:i + 2])
            if len(pair) == 2 and pair in self._phrases:
                found[" ".join(pair)] = None
                i += 2
                continue
            if words[i] in self.attributes:
                found[words[i]] = None
            else:
                rest.append(words[i])
            i += 1
        return Typed(tuple(found), tuple(rest), prefix)

    def _complete(self, words: Sequence[str], prefix: str) -> bool:
        return prefix in self.attributes or (bool(words) and (words[-1], prefix) in self._phrases)

    def carried(self, words: Sequence[str]) -> list[str]:
        """The attributes a product's analysed text carries (what its lexical document indexes)."""
        out = dict.fromkeys(a for a in candidates(words) if a in self.attributes)
        out.update(dict.fromkeys(w for w in words if w in self.attributes))
        return list(out)
