"""The held-out gate: products (and logged queries) set aside before training, scored base vs tuned.

The split is by a seeded hash of the product id (and of the logged query), so it is the same on a
resumed run and never depends on file order. Query sets, each searched in a corpus made of the
held-out products (plus the products of held-out logged queries), at 25/50/75/100 % of the query's
characters as a typeahead sends them (catalog/prefix_quality.cut):
- aisle:      the narrowest category value -> the held-out products in it (products never trained on)
- attribute:  "dairy free" + aisle -> held-out products with both (where titles carry attributes)
- noun:       a product noun shoppers type ("frozen dessert sandwiches": a title's last words) -> the
              held-out products of the aisles that noun lives in (aisle precision, as shopper queries
              labelled by aisle are scored)
- known-item: a fragment of a held-out title -> that product, searched among the held-out products
              and up to `distractors` trained-on ones (a catalog-sized haystack: tuning that blurs
              products of one aisle together shows here, as it does in a full index)
- logged:     a held-out logged query -> the products it led to (with --pairs)
- judged:     a team's labelled queries (--judgements; catalog/judgements.py) -> the products they name and
              the held-out products of the categories they name; never trained on
Metrics: nDCG@10, recall@10 and precision@10 (catalog/quality.score). `gate` refuses a tuned model that is worse
than its base on any set, cut and metric by more than the tolerance.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog.calibration import fragment
from catalog.index_build import exact_topk
from catalog.prefix_quality import CUTS, cut
from catalog.quality import K, QuerySet, score
from catalog.sources import Product, compose_text
from catalog.tuning.catalog_pairs import aisle_of, attributes, head_words, taxonomy_fields
from catalog.tuning.query_log import LoggedPair

Encode = Callable[[list[str], str], npt.NDArray[np.float32]]  # (texts, "query" | "document") -> unit rows
WIDE = ("known-item",)  # sets searched among the distractors too (their relevance is exact: one product)
GATED = (("ndcg_at_10", "nDCG@10"), ("recall_at_10", "recall@10"), ("precision_at_10", "P@10"))
NOUN_MIN_PRODUCTS = 5  # a noun shared by fewer products is a title, not something shoppers type
NOUN_AISLE_SHARE = 0.1  # the aisles holding at least this share of a noun's products are its aisles


def _unit(seed: int, key: str) -> float:
    """A stable number in [0, 1) for `key`: the same split on every run and machine."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True, slots=True)
class Split:
    train: list[Product]
    held: list[Product]
    train_logged: list[LoggedPair]
    held_logged: list[LoggedPair]


def split(products: Sequence[Product], logged: Sequence[LoggedPair], *, share: float, max_held: int,
          seed: int) -> Split:
    """`share` of the products (at most `max_held`) and of the logged queries held out."""
    order = sorted(products, key=lambda p: _unit(seed, p.id))
    n_held = min(max_held, max(1, round(len(products) * share)))
    held_ids = {p.id for p in order[:n_held]}
    held_queries = {q for q in {lp.query.casefold() for lp in logged} if _unit(seed, "q:" + q) < share}
    return Split(train=[p for p in products if p.id not in held_ids], held=[p for p in products if p.id in held_ids],
                 train_logged=[lp for lp in logged if lp.query.casefold() not in held_queries],
                 held_logged=[lp for lp in logged if lp.query.casefold() in held_queries])


@dataclass(frozen=True, slots=True)
class HeldOut:
    documents: list[str]  # the corpus, as the catalog job embeds it
    sets: list[QuerySet]  # relevant rows index `documents`
    distractors: list[str] = dataclasses.field(default_factory=list)  # trained-on products, for WIDE sets


@dataclass(frozen=True, slots=True)
class Judged:
    """Labelled queries (catalog/judgements.py) by product id: what each query finds relevant, and
    the products named one by one (they join the corpus, as the products of held-out logged queries do)."""
    queries: list[str]
    relevant: list[set[str]]
    named: set[str]


def held_out(s: Split, products_by_id: dict[str, Product], text_fields: Sequence[str], *, seed: int,
             max_queries: int = 500, distractors: int = 0, judged: Judged | None = None) -> HeldOut:
    """The corpus and the query sets (see the module's docstring)."""
    rng = random.Random(seed)
    corpus = list(s.held)
    seen = {p.id for p in corpus}
    named = [lp.product_id for lp in s.held_logged] + sorted(judged.named if judged else ())
    for pid in named:
        if pid not in seen and pid in products_by_id:
            corpus.append(products_by_id[pid])
            seen.add(pid)
    row = {p.id: i for i, p in enumerate(corpus)}
    docs = [compose_text(p.fields, text_fields) for p in corpus]
    sets: list[QuerySet] = []
    taxonomy = taxonomy_fields(s.held)
    by_aisle: dict[str, set[int]] = defaultdict(set)
    by_attr: dict[str, set[int]] = defaultdict(set)
    for i, p in enumerate(s.held):
        if aisle := aisle_of(p, taxonomy):
            by_aisle[aisle].add(i)
            for a in attributes(p.fields.get("title", "")):
                by_attr[f"{a} {aisle}"].add(i)
    for name, groups in (("aisle", by_aisle), ("attribute", by_attr)):
        keys = sorted(groups)
        if len(keys) > max_queries:
            keys = sorted(rng.sample(keys, max_queries))
        if keys:
            sets.append(QuerySet(name, keys, [groups[k] for k in keys]))
    if taxonomy and (nouns := _noun_queries(s, taxonomy, max_queries, rng)):
        sets.append(nouns)
    by_title: dict[str, set[int]] = defaultdict(set)
    for i, p in enumerate(s.held):
        by_title[p.fields.get("title", "")].add(i)
    known: list[tuple[str, set[int]]] = []
    for i in rng.sample(range(len(s.held)), len(s.held)):
        title = s.held[i].fields.get("title", "")
        if (q := fragment(title, rng)) is not None:
            known.append((q, by_title[title]))
        if len(known) >= max_queries:
            break
    if known:
        sets.append(QuerySet("known-item", [q for q, _ in known], [r for _, r in known]))
    logged: dict[str, set[int]] = defaultdict(set)
    for lp in s.held_logged:
        if lp.product_id in row:
            logged[lp.query].add(row[lp.product_id])
    if logged:
        keys = sorted(logged)
        if len(keys) > max_queries:
            keys = sorted(rng.sample(keys, max_queries))
        sets.append(QuerySet("logged", keys, [logged[k] for k in keys]))
    if judged is not None:
        pairs = [(q, rows) for q, ids in zip(judged.queries, judged.relevant, strict=True)
                 if (rows := {row[i] for i in ids if i in row})]
        if pairs:
            sets.append(QuerySet("judged", [q for q, _ in pairs], [r for _, r in pairs]))
    extra = rng.sample(s.train, min(distractors, len(s.train)))
    return HeldOut(docs, sets, [compose_text(p.fields, text_fields) for p in extra])


def _noun_queries(s: Split, taxonomy: Sequence[str], max_queries: int, rng: random.Random) -> QuerySet | None:
    aisles_of: dict[str, Counter[str]] = defaultdict(Counter)
    for p in (*s.train, *s.held):
        if (noun := head_words(p.fields.get("title", ""), 2)) and (aisle := aisle_of(p, taxonomy)):
            aisles_of[noun][aisle] += 1
    held_in: dict[str, set[int]] = defaultdict(set)
    for i, p in enumerate(s.held):
        held_in[aisle_of(p, taxonomy)].add(i)
    queries, relevant = [], []
    for noun in sorted(aisles_of):
        counts = aisles_of[noun]
        total = sum(counts.values())
        if total < NOUN_MIN_PRODUCTS:
            continue
        rows = set().union(*(held_in[a] for a, n in counts.items() if n >= NOUN_AISLE_SHARE * total))
        if rows:
            queries.append(noun)
            relevant.append(rows)
    if len(queries) > max_queries:
        pick = sorted(rng.sample(range(len(queries)), max_queries))
        queries, relevant = [queries[i] for i in pick], [relevant[i] for i in pick]
    return QuerySet("noun", queries, relevant) if queries else None


def workload(held: HeldOut, cuts: Sequence[int] = CUTS) -> tuple[int, int]:
    """What `evaluate` encodes for one model: (documents, queries), each query once per cut."""
    return len(held.documents) + len(held.distractors), sum(len(qs.queries) for qs in held.sets) * len(cuts)


def evaluate(encode: Encode, held: HeldOut, cuts: Sequence[int] = CUTS) -> dict[str, dict[str, dict[str, float]]]:
    """{set: {cut: {metric: value, "queries": n}}} for one model."""
    wide = encode(held.documents + held.distractors, "document")
    narrow = wide[: len(held.documents)]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for qs in held.sets:
        out[qs.name] = {}
        doc_vecs = wide if qs.name in WIDE else narrow
        for pct in cuts:
            q_vecs = encode([cut(q, pct) for q in qs.queries], "query")
            out[qs.name][str(pct)] = dataclasses.asdict(score(exact_topk(doc_vecs, q_vecs, K), qs.relevant))
    return out


def gate(base: dict[str, Any], tuned: dict[str, Any], tolerance: float) -> list[str]:
    """Every (set, cut, metric) where the tuned model is worse than its base by more than `tolerance`."""
    misses = []
    for name, per_cut in base.items():
        for pct, sc in per_cut.items():
            for key, label in GATED:
                b, t = sc[key], tuned[name][pct][key]
                if t < b - tolerance:
                    misses.append(f"{name} {pct} % {label} {b:.3f} -> {t:.3f}")
    return misses


def table(base: dict[str, Any], tuned: dict[str, Any] | None = None) -> str:
    """Markdown: one row per set and cut, base (and tuned with the change) per gated metric."""
    head = ["set", "cut", "queries"]
    for _key, label in GATED:
        head += [f"{label} base"] + ([f"{label} tuned", "change"] if tuned else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, per_cut in base.items():
        for pct, sc in per_cut.items():
            cells = [name, f"{pct} %", str(sc["queries"])]
            for key, _label in GATED:
                cells.append(f"{sc[key]:.3f}")
                if tuned:
                    t = tuned[name][pct][key]
                    cells += [f"{t:.3f}", f"{t - sc[key]:+.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
