"""Typeahead quality: the three search modes on query prefixes (`embedcar catalog quality --prefixes`).

A typeahead query is nearly always a prefix cut mid-word. Each weak-label query of catalog/quality.py
(aisle names; known-item title fragments), and each labelled query of a judgements file when given
(catalog/judgements.py), is cut to 25/50/75/100 % of its characters and searched
semantic, lexical and hybrid on the newest published index version, the one the sidecar serves
(its FAISS index as built, HNSW for the grocery catalog, and its lexical index), through
`ProductIndex.rank`, the code behind Search; the cut queries are embedded by the job's backend,
as Search embeds them (`ProductIndex.embedding_texts`: catalog.complete_last_word completes the
last word for the semantic leg).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from catalog import store
from catalog.fusion import FittedFusion, Fusion, SearchMode
from catalog.index import ProductIndex
from catalog.job import job_backend
from catalog.judgements import read_judgements
from catalog.product_table import read_products
from catalog.quality import K, QuerySet, aisle_queries, attribute_queries, embed_all, known_item_queries, score
from catalog.settings import Settings
from inference.embedder import Embedder, load_tokenizer
from inference.errors import InvalidInput, ModelError
from inference.manifest import load_manifest

CUTS = (25, 50, 75, 100)
METRICS = (("recall_at_10", "recall@10"), ("precision_at_10", "precision@10"), ("ndcg_at_10", "nDCG@10"))


def cut(text: str, percent: int) -> str:
    """The first `percent` % of the characters (at least one), as the demo sends it: stripped."""
    if not 0 < percent <= 100:
        raise InvalidInput(f"a cut is a percentage in 1..100, got {percent}")
    return text[: max(1, math.ceil(len(text) * percent / 100))].strip()


async def evaluate_prefixes(settings: Settings, *, known_items: int = 1000, seed: int = 0,
                            cuts: Sequence[int] = CUTS, modes: Sequence[SearchMode] = tuple(SearchMode),
                            fusion: Fusion | None = None, judgements: str | Path | None = None) -> dict[str, Any]:
    backend = job_backend(settings)
    index = ProductIndex.from_settings(settings.catalog, expected_model_id=backend.version_id)
    if not index.has_lexical and set(modes) - {SearchMode.SEMANTIC}:
        raise ModelError(f"index version {index.version} has no lexical index: rebuild it with "
                         "`embedcar catalog build`")
    products, _rows = read_products(settings.catalog.index_root / index.version / store.PRODUCTS_FILE)
    sets = [aisle_queries(products), known_item_queries(products, known_items, seed=seed)]
    sets += attribute_queries(products)  # the grocery catalog's attribute queries
    if judgements is not None:  # a team's labelled queries (catalog/judgements.py)
        sets.append(read_judgements(judgements, products).queries)
    model_dir = settings.model.model_dir
    embedder = Embedder(load_tokenizer(model_dir, load_manifest(model_dir)), backend,
                        max_batch=max(len(s.queries) for s in sets))
    result: dict[str, Any] = {"index_version": index.version, "items": index.size, "model_id": index.model_id,
                              "faiss": index.manifest["index"],
                              "fusion": dataclasses.asdict(fusion or index.fusion) if fusion or not index.fitted
                              else {"fitted per query shape": index.manifest["fusion"]["shapes"]},
                              "complete_last_word": index.complete_last_word,
                              "cuts": list(cuts), "modes": [m.value for m in modes], "sets": {}}
    try:
        await backend.start()
        for qs in sets:
            result["sets"][qs.name] = await _score_set(index, embedder, qs, cuts, modes, fusion,
                                                       settings.catalog.batch_size)
            # precision@10 can reach at most this (a known item has one relevant product: 0.1)
            result.setdefault("precision_ceiling", {})[qs.name] = round(
                sum(min(len(r), K) for r in qs.relevant) / (K * len(qs.relevant)), 4)
    finally:
        await backend.close()
    return result


async def _score_set(index: ProductIndex, embedder: Embedder, qs: QuerySet, cuts: Sequence[int],
                     modes: Sequence[SearchMode], fusion: Fusion | None, batch: int) -> dict[str, Any]:
    """`fusion` None: the version's own (fitted per query shape where `--fit` fitted it)."""
    out: dict[str, Any] = {}
    for pct in cuts:
        texts = [cut(q, pct) for q in qs.queries]
        # What Search embeds (ProductIndex.embedding_texts: the completed last word where that is on)
        vectors = await embed_all(embedder, index.embedding_texts(texts), batch)
        out[str(pct)] = {
            m.value: dataclasses.asdict(score([r.rows for r in index.rank(texts, vectors, K, mode=m,
                                                                          fusion=fusion).lists], qs.relevant))
            for m in modes}
    return out


async def fit_prefixes(settings: Settings, judgements: str | Path, cuts: Sequence[int] = CUTS) -> dict[str, Any]:
    """Fit the hybrid fusion per query shape on `judgements` (catalog/fusion_fit.py) and publish the
    newest version again with it; the before/after per cut on the held-out half of the queries."""
    from catalog import fusion_fit
    from catalog.publish import KEEP_VERSIONS

    backend = job_backend(settings)
    index = ProductIndex.from_settings(settings.catalog, expected_model_id=backend.version_id)
    if not index.has_lexical:
        raise ModelError(f"index version {index.version} has no lexical index: rebuild it with "
                         "`embedcar catalog build`")
    products, _rows = read_products(settings.catalog.index_root / index.version / store.PRODUCTS_FILE)
    judged = read_judgements(judgements, products).queries
    model_dir = settings.model.model_dir
    embedder = Embedder(load_tokenizer(model_dir, load_manifest(model_dir)), backend, max_batch=len(judged.queries))
    try:
        await backend.start()
        cases = await fusion_fit.cases(index, embedder, judged, cuts, settings.catalog.batch_size)
    finally:
        await backend.close()
    default = index.fusion
    fitting = [c for c in cases if not fusion_fit.held_out(c.query)]
    scored = [c for c in cases if fusion_fit.held_out(c.query)]
    half = FittedFusion(default, fusion_fit.fit(fitting, default))
    held = fusion_fit.report(scored, default, half, cuts)
    fitted = fusion_fit.fit(cases, default)
    entry = fusion_fit.entry(fitted, default, str(judgements), held, len(judged.queries))
    version = fusion_fit.publish_fitted(settings.catalog.index_root, settings.catalog.index_root / index.version,
                                        entry, keep=KEEP_VERSIONS)
    return {"fitted_from": index.version, "version": version.name, "shapes": entry["shapes"],
            "held_out_shapes": sorted(half.shapes), "held_out": held}


def fit_markdown(fit: dict[str, Any]) -> str:
    lines = ["| cut | held-out queries | nDCG@10 default fusion | nDCG@10 fitted (on the other half) |",
             "|---|---|---|---|"]
    lines += [f"| {r['cut']} % | {r['queries']} | {r['before']:.3f} | {r['after']:.3f} |" for r in fit["held_out"]]
    return "\n".join(lines)


def verdict(result: dict[str, Any], *, margin: float = 0.05, margin_cuts: Sequence[int] = (25, 50)) -> list[str]:
    """The issue's targets, per set and metric: hybrid >= the better single mode at every cut, and
    hybrid >= semantic + margin at the short cuts."""
    lines = []
    for name, per_cut in result["sets"].items():
        for key, label in METRICS:
            ceiling = result.get("precision_ceiling", {}).get(name, 1.0) if key == "precision_at_10" else 1.0
            need = min(margin, margin * ceiling)  # +0.05 of a metric that cannot pass 0.1 is half its range
            misses, short = [], []
            for pct, sc in per_cut.items():
                if "hybrid" not in sc:
                    continue
                best = max(sc[m][key] for m in sc if m != "hybrid")
                if sc["hybrid"][key] < best:
                    misses.append(f"{pct} % ({sc['hybrid'][key]:.3f} < {best:.3f})")
                if int(pct) in margin_cuts and "semantic" in sc:
                    gain = sc["hybrid"][key] - sc["semantic"][key]
                    short.append(f"{pct} %: {gain:+.3f}{'' if gain >= need else f' (short of +{need:.3f})'}")
            if short or misses:
                lines.append(f"{name} {label}: hybrid >= best single mode at every cut: "
                             f"{'yes' if not misses else 'no, ' + ', '.join(misses)}; vs semantic {'; '.join(short)}")
    return lines


def markdown(result: dict[str, Any]) -> str:
    modes: list[str] = result["modes"]
    head = ["query set", "cut", "queries"] + [f"{label} {m}" for _k, label in METRICS for m in modes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, per_cut in result["sets"].items():
        for pct, sc in per_cut.items():
            cells = [name, f"{pct} %", str(next(iter(sc.values()))["queries"])]
            for key, _label in METRICS:
                best = max(sc[m][key] for m in modes)
                cells += [f"**{sc[m][key]:.3f}**" if sc[m][key] == best and len(modes) > 1 else f"{sc[m][key]:.3f}"
                          for m in modes]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
