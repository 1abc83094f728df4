"""Hybrid fusion fitted to a team's judgements (`embedcar catalog quality --prefixes --judgements FILE --fit`).

The fusion's weights (catalog/fusion.py `Fusion`) were calibrated on the project's weak-label sets; a
team's own labelled queries may want others. Each judged query, cut to every --cuts percentage,
is searched once per leg (`ProductIndex.legs`); the legs are then fused again under each point of
GRID, separately per query shape (`query_shape`: one word, two, longer, an attribute typed), and a
shape keeps the point with the best mean nDCG@10 when it beats the default by MIN_GAIN on at least
MIN_CASES query cuts; other shapes keep the default.

Honest figures: the before/after table is scored on a held-out half of the judged queries (split by
a hash of the query text) with weights fitted on the other half; the weights stored are then fitted
on all of them. They are stored by publishing the version again (its files hard-linked, nothing
re-embedded) with the weights in its manifest's `fusion` entry and the version they were fitted on
in `fitted_from`: sidecars swap to it as to any new version, and Search uses the fitted fusion per
query shape from then on. The next `catalog build` starts from the defaults again (fit it again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import shutil
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from catalog import store
from catalog.fusion import SHAPES, FittedFusion, Fusion
from catalog.index import Legs, ProductIndex, fuse
from catalog.quality import K, QuerySet, embed_all

GRID: dict[str, tuple[float, ...]] = {
    "k": (5.0, 10.0, 20.0),
    "complete_weight": (2.0, 4.0, 8.0, 16.0),
    "partial_weight": (0.1, 0.25, 0.5, 1.0),
    "single_word_weight": (0.25, 0.5, 1.0, 2.0),
}
# The weights that act on each shape (a one-word query has no partial tier; longer ones no one-word tier)
ACTING = {"one-word": ("k", "single_word_weight")}
DEFAULT_ACTING = ("k", "complete_weight", "partial_weight")
MIN_CASES = 20  # query cuts of a shape: fewer keep the default (too few to tell a weight from noise)
MIN_GAIN = 0.005  # mean nDCG@10 over the default on the fitting cases: less keeps the default


@dataclass(frozen=True, slots=True)
class Case:
    """One judged query at one cut: its legs and what is relevant."""

    query: str
    cut: int
    legs: Legs
    relevant: frozenset[int]


async def cases(index: ProductIndex, embedder: Any, qs: QuerySet, cuts: Sequence[int], batch: int) -> list[Case]:
    from catalog.prefix_quality import cut as cut_text

    out: list[Case] = []
    for pct in cuts:
        texts = [cut_text(q, pct) for q in qs.queries]
        vectors = await embed_all(embedder, index.embedding_texts(texts), batch)
        out += [Case(q, pct, legs, frozenset(rel))
                for q, legs, rel in zip(qs.queries, index.legs(texts, vectors), qs.relevant, strict=True)]
    return out


def ndcg(rows: Sequence[int], relevant: frozenset[int], k: int = K) -> float:
    dcg = sum(1.0 / math.log2(i + 2) for i, r in enumerate(rows[:k]) if r in relevant)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(relevant), k)))
    return dcg / ideal if ideal else 0.0


def mean_ndcg(cs: Sequence[Case], fusion_of: Any) -> float:
    """Mean nDCG@10 of `cs` fused by `fusion_of(case)`."""
    if not cs:
        return 0.0
    return sum(ndcg(fuse(fusion_of(c), c.legs.semantic, c.legs.lexical, K, c.legs.carriers).rows, c.relevant)
               for c in cs) / len(cs)


def fit(cs: Sequence[Case], default: Fusion) -> dict[str, Fusion]:
    """The best GRID point per query shape, kept where it beats `default` by MIN_GAIN on at least
    MIN_CASES cases and is no worse on either half of them (a point that wins on one half only fits
    those queries, not the shape)."""
    by_shape: dict[str, list[Case]] = defaultdict(list)
    for c in cs:
        by_shape[c.legs.shape].append(c)
    out: dict[str, Fusion] = {}
    for shape in SHAPES:
        group = by_shape.get(shape, [])
        if len(group) < MIN_CASES:
            continue
        names = ACTING.get(shape, DEFAULT_ACTING)
        points = [Fusion(**{**dataclasses.asdict(default), **dict(zip(names, values, strict=True))})
                  for values in itertools.product(*(GRID[n] for n in names))]
        base = mean_ndcg(group, lambda _c: default)
        best, best_score = default, base
        for f in points:
            score = mean_ndcg(group, lambda _c, f=f: f)
            if score > best_score:
                best, best_score = f, score
        halves = [[c for c in group if _half(c.query) == h] for h in (0, 1)]
        steady = all(mean_ndcg(h, lambda _c, f=best: f) >= mean_ndcg(h, lambda _c: default) for h in halves)
        if best_score >= base + MIN_GAIN and steady:
            out[shape] = best
    return out


def _half(query: str) -> int:
    return hashlib.sha256(query.encode()).digest()[1] % 2


def held_out(query: str) -> bool:
    """Half the judged queries, the same half every run: scored with weights fitted on the other half."""
    return hashlib.sha256(query.encode()).digest()[0] % 2 == 1


def report(cs: Sequence[Case], before: Fusion, after: FittedFusion, cuts: Sequence[int]) -> list[dict[str, Any]]:
    """nDCG@10 before and after per cut (and per shape fitted), on `cs`."""
    rows = []
    for pct in cuts:
        at = [c for c in cs if c.cut == pct]
        rows.append({"cut": pct, "queries": len(at), "before": round(mean_ndcg(at, lambda _c: before), 4),
                     "after": round(mean_ndcg(at, lambda c: after.for_shape(c.legs.shape)), 4)})
    return rows


def entry(fitted: dict[str, Fusion], default: Fusion, judgements: str, held: list[dict[str, Any]],
          n_queries: int) -> dict[str, Any]:
    """The manifest's `fusion` entry: the weights per shape (only those that differ from the default)."""
    base = dataclasses.asdict(default)
    return {"shapes": {s: {k: v for k, v in dataclasses.asdict(f).items() if v != base[k]} for s, f in fitted.items()},
            "default": base, "judgements": judgements, "queries": n_queries, "held_out": held,
            "fitted": datetime.now(UTC).isoformat(timespec="seconds")}


def publish_fitted(root: Path, version: Path, fusion: dict[str, Any], *, keep: int) -> Path:
    """`version` published again under a new name with `fusion` in its manifest: its files hard-linked
    (copied where links cannot be made), the manifest rewritten; then old versions pruned."""
    manifest = store.read_manifest(version)
    name = store.new_version_name()

    def write(tmp: Path) -> None:
        for src in version.rglob("*"):
            dst = tmp / src.relative_to(version)
            if src.is_dir():
                dst.mkdir(exist_ok=True)
            elif src.name != store.MANIFEST_FILE or src.parent != version:
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)
        doc = manifest | {"version": name, "fusion": fusion, "fitted_from": version.name}
        (tmp / store.MANIFEST_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True))

    out = store.publish(root, write, name=name)
    store.prune(root, keep=keep)
    return out
