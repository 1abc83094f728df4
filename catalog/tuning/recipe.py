"""What `embedcar model tune` trains with: one frozen dataclass, its defaults the measured winners
(docs/models.md, "Tuning to the catalog"), every lever a flag so it can be measured again."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from inference.errors import InvalidInput

PAIR_KINDS = ("taxonomy", "head", "attribute", "brand", "prefix", "title", "logged")
LOSSES = ("mnrl", "cached")


def _default_mix() -> dict[str, float]:
    # pairs per product of each kind (per logged pair for `logged`), on average
    return {"taxonomy": 1.0, "head": 1.0, "attribute": 1.0, "brand": 0.5, "prefix": 1.0, "title": 0.5,
            "logged": 2.0}


@dataclass(frozen=True, slots=True)
class Recipe:
    mix: dict[str, float] = field(default_factory=_default_mix)
    learning_rate: float = 1e-4  # 5e-5 and 2e-4 measured (docs/benchmarks.md, "the recipe's levers")
    batch_size: int = 64
    max_seq_length: int = 32
    scale: float = 20.0  # MultipleNegativesRankingLoss's similarity scale (its default)
    loss: str = "mnrl"  # cached: CachedMultipleNegativesRankingLoss (a bigger batch in the same memory)
    mini_batch_size: int = 32  # the cached loss's chunk
    matryoshka: tuple[int, ...] = ()  # MatryoshkaLoss dimensions (empty: off)
    hard_negatives: bool = True  # a negative product per pair (catalog_pairs.add_negatives): measured, kept
    word_negatives: bool = False  # taxonomy/head/brand negatives share the anchor's words (add_negatives)
    freeze_layers: int = 0  # the embeddings and this many lower encoder layers stay as they are
    warmup_ratio: float = 0.1
    held_share: float = 0.1
    max_held: int = 5000
    distractors: int = 10_000  # trained-on products the held-out known items are searched among
    tolerance: float = 0.005  # how much worse than the base a (set, cut, metric) may get
    # base + a·(tuned − base) for each a, scored on the gate; the best that passes is published
    # (catalog/tuning/interpolate.py). (1.0,) = the tuned model as trained, or refused.
    mixes: tuple[float, ...] = (1.0, 0.7, 0.5)

    def __post_init__(self) -> None:
        problems = []
        if unknown := sorted(set(self.mix) - set(PAIR_KINDS)):
            problems.append(f"unknown pair kinds {', '.join(unknown)} (kinds: {', '.join(PAIR_KINDS)})")
        if any(w < 0 for w in self.mix.values()) or not any(self.mix.values()):
            problems.append("pair weights are >= 0 and at least one is positive")
        if not 0 < self.learning_rate < 1:
            problems.append(f"learning rate {self.learning_rate} is not in (0, 1)")
        if self.batch_size < 2:
            problems.append("batch size is at least 2 (in-batch negatives)")
        if not 4 <= self.max_seq_length <= 8192:
            problems.append(f"max sequence length {self.max_seq_length} is not in 4..8192")
        if self.loss not in LOSSES:
            problems.append(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if not 0 < self.held_share < 0.5:
            problems.append(f"held-out share {self.held_share} is not in (0, 0.5)")
        if not self.mixes or any(not 0 < m <= 1 for m in self.mixes):
            problems.append(f"mixes {list(self.mixes)} are shares of the tuning kept, in (0, 1]")
        if self.freeze_layers < 0 or self.tolerance < 0 or self.distractors < 0:
            problems.append("frozen layers, tolerance and distractors are >= 0")
        if problems:
            raise InvalidInput("recipe: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # type: ignore[no-any-return]


def parse_mix(text: str, base: Mapping[str, float] | None = None) -> dict[str, float]:
    """'taxonomy=1,prefix=0.5' over the defaults; a kind left out keeps its default."""
    mix = dict(base or _default_mix())
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError
            mix[kind.strip()] = float(value)
        except ValueError:
            raise InvalidInput(f"--mix takes kind=weight pairs separated by commas, got {part!r}") from None
    return mix
