"""Search modes and the fusion of the two legs' ranked lists (reciprocal rank fusion).

RRF scores a product by its ranks alone, Σ_leg weight / (k + rank), so the legs' incomparable
scores (cosine, BM25) never meet; a product both legs found beats one found by one leg at the same
rank. k = 60 is the usual constant (Cormack et al., 2009); `Fusion` says why hybrid Search uses
tiers, leg weights and k = 10 instead.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass
from typing import SupportsFloat, SupportsInt

from inference.errors import InvalidInput

CARRIER_TIER = 0.5  # added to the fused score of a row carrying every typed attribute
SEMANTIC_LEG = "semantic"
LEXICAL_LEG = "lexical"


class SearchMode(enum.StrEnum):
    SEMANTIC = "semantic"
    LEXICAL = "lexical"
    HYBRID = "hybrid"


def parse_mode(value: str | SearchMode) -> SearchMode:
    """A mode from its name (any case), InvalidInput for anything else."""
    if isinstance(value, SearchMode):
        return value
    try:
        return SearchMode(str(value).strip().lower())
    except ValueError:
        raise InvalidInput(f"unknown search mode {str(value)[:40]!r}; expected one of "
                           f"{', '.join(m.value for m in SearchMode)}") from None


@dataclass(frozen=True, slots=True)
class Ranked:
    """One query's result list, best first: rows of the version, their scores, the leg(s) behind each."""

    rows: list[int]
    scores: list[float]
    legs: list[tuple[str, ...]]

    @classmethod
    def single(cls, leg: str, rows: Iterable[SupportsInt], scores: Iterable[SupportsFloat]) -> Ranked:
        rs = [int(r) for r in rows]
        return cls(rs, [float(s) for s in scores], [(leg,)] * len(rs))


def rrf(lists: Mapping[str, Sequence[int]], *, k: float, limit: int,
        weights: Mapping[str, float] | None = None) -> Ranked:
    """Fuse ranked row lists (leg name -> rows, best first) into the best `limit` rows.

    Ties (equal fused scores) keep the order in which the rows were first met, legs in the order
    given: deterministic, and the first leg breaks ties. A row twice in one leg counts once, at its
    best rank."""
    ranks = {leg: _ranks(rows) for leg, rows in lists.items()}
    w = weights or {}
    scores = {r: sum(w.get(leg, 1.0) / (k + rk[r]) for leg, rk in ranks.items() if r in rk)
              for rows in lists.values() for r in rows}
    return _top(scores, ranks, limit)


def _ranks(rows: Sequence[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for rank, row in enumerate(rows, start=1):
        out.setdefault(int(row), rank)
    return out


def _top(scores: dict[int, float], ranks: Mapping[str, dict[int, int]], limit: int) -> Ranked:
    order = sorted(scores, key=lambda r: -scores[r])[:limit]  # stable: the first met wins a tie
    return Ranked(order, [scores[r] for r in order], [tuple(leg for leg, rk in ranks.items() if r in rk)
                                                      for r in order])


@dataclass(frozen=True, slots=True)
class Fusion:
    """How HYBRID fuses the two legs: tiered, weighted reciprocal rank fusion.

    Tier 1: the products the lexical leg matched on every typed word and the prefix, ordered by
    RRF with the lexical leg weighted `complete_weight`: lexical order, the semantic rank breaking
    near-ties. A query of one word (or one half-typed prefix) is the exception: every lexical hit
    then "matches every word", so the tier is only "the lexical leg found it" and its lexical
    weight is `single_word_weight`, below 1: the semantic rank orders the lexical hits. Tier 2:
    the rest, by RRF with the legs weighted 1:1, or with the lexical leg at `partial_weight` when
    no product matched every word (the lexical leg then only saw some of the words: weak evidence,
    the semantic leg leads). Tier-1 scores are 1 + their RRF score, so scores fall along the list.

    Measured on the weak-label prefix sets (`embedcar catalog quality --prefixes`, docs/benchmarks.md):
    plain RRF at k = 60 fell below the better single leg at 7 of 8 cuts (below lexical on short
    prefixes and known items, below semantic on whole aisle names), and no constant leg weight
    fixed both ends; these tiers and weights met "hybrid >= the better leg" at every cut, also on a
    second, held-out draw of known-item queries. With catalog.complete_last_word the semantic leg
    got far better on short prefixes and the one-word tier in lexical order (weight 8) fell below
    semantic on aisle names at 25 / 50 %; `single_word_weight` 0.5 was chosen on a small grid with
    the other weights kept (docs/benchmarks.md, "Fusion with completion").

    The defaults are those calibrated values, what the sidecar always uses (not settings: the build
    neither calibrates nor records them); `embedcar catalog quality --prefixes` takes flags to try others.
    """

    # docs/benchmarks.md "Fusion with completion": k in {5, 10, 20, 60} x complete weight in
    # {0.5 .. 16}, depth in {50, 100} x partial in {0.1 .. 1}, one-word weight in {0 .. 8}.
    k: float = 10.0
    depth: int = 50  # candidates per leg; 100 added 0.0006 to the mean for twice the work
    complete_weight: float = 8.0
    partial_weight: float = 0.25  # 1 fell 0.04 below semantic on aisle names
    single_word_weight: float = 0.5  # 8 (= complete_weight) fell below semantic on aisle names at 25 / 50 %

    def fuse(self, semantic: Ranked, lexical: Ranked, complete: AbstractSet[int], limit: int, *,
             single_word: bool = False, carriers: AbstractSet[int] | None = None) -> Ranked:
        """The best `limit` of both legs' rows; `complete`: the rows matching every typed word;
        `single_word`: the query was one word or prefix (every lexical hit is then complete);
        `carriers`: with attributes typed (catalog/attributes.py), the rows carrying them all, which
        rank above the rows that do not (tier 2a, between the complete rows and the rest)."""
        k = self.k
        tier_weight = self.single_word_weight if single_word else self.complete_weight
        ranks = {SEMANTIC_LEG: _ranks(semantic.rows), LEXICAL_LEG: _ranks(lexical.rows)}
        sem, lex = ranks[SEMANTIC_LEG], ranks[LEXICAL_LEG]
        rest_weight = 1.0 if complete else self.partial_weight
        scores: dict[int, float] = {}
        for r in (*semantic.rows, *lexical.rows):
            if r in scores:
                continue
            s = 1.0 / (k + sem[r]) if r in sem else 0.0
            x = 1.0 / (k + lex[r]) if r in lex else 0.0
            if r in complete:
                scores[r] = 1.0 + s + tier_weight * x
            else:  # < 1 + ... (RRF terms are at most 1/(k+1) each): below every complete row
                scores[r] = s + rest_weight * x + (CARRIER_TIER if carriers is not None and r in carriers else 0.0)
        return _top(scores, ranks, limit)


# --- fusion fitted per query shape (catalog/fusion_fit.py) -------------------------------------------
SHAPES = ("one-word", "two-words", "longer", "attribute")


def query_shape(terms: int, attributes: int) -> str:
    """A query's shape for the fusion: an attribute typed, else how many words (the prefix one)."""
    if attributes:
        return "attribute"
    return "one-word" if terms <= 1 else "two-words" if terms == 2 else "longer"


@dataclass(frozen=True, slots=True)
class FittedFusion:
    """The fusion per query shape that `catalog quality --fit` learnt on a team's judgements and
    recorded in an index version's manifest (`fusion`); shapes it did not fit use `default`."""

    default: Fusion
    shapes: Mapping[str, Fusion]

    def for_shape(self, shape: str) -> Fusion:
        return self.shapes.get(shape, self.default)

    @classmethod
    def from_manifest(cls, entry: object, default: Fusion) -> FittedFusion | None:
        """The manifest's `fusion` entry (None: none, or one this code cannot read: the default)."""
        if not isinstance(entry, dict) or not isinstance(entry.get("shapes"), dict):
            return None
        names = {f for f in Fusion.__dataclass_fields__}
        shapes = {}
        for shape, params in entry["shapes"].items():
            if shape in SHAPES and isinstance(params, dict) and set(params) <= names:
                shapes[shape] = Fusion(**{**asdict(default), **params})
        return cls(default, shapes)
