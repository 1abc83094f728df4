"""Search quality with honest weak labels (no human relevance judgements ship offline).

(a) aisle-name queries: the aisle's name ("energy granola bars") is the query, every product of
    that aisle is relevant. Weak: a product of a neighbouring aisle may be a fine answer too.
(b) known-item queries: a contiguous fragment (~60% of the words) of a held-out product title is
    the query, that product (and any product with the identical title) is relevant.
recall@10 is capped (hits / min(|relevant|, 10)) so an aisle with 500 products can reach 1.0;
precision@10 is hits / 10 (a known item has one relevant product: at most 0.1); nDCG@10 uses
binary gains. ANN recall@10 compares an approximate index with exact search on the same real text
queries. Prefixes of these queries, searched by mode: catalog/prefix_quality.py.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog.calibration import calibration_queries, fragment
from catalog.index_build import ann_recall, build_faiss, exact_topk
from catalog.settings import Settings
from catalog.sources import Product, compose_text, read_grocery
from inference.backends.onnx import OnnxBackend
from inference.embedder import Embedder, load_tokenizer
from inference.errors import InvalidInput
from inference.manifest import load_manifest
from inference.pooling import check_mode

K = 10
ATTRIBUTE_QUERIES = Path(__file__).with_name("data") / "attribute_queries.csv"  # written for the grocery catalog


@dataclass(frozen=True, slots=True)
class QuerySet:
    name: str
    queries: list[str]
    relevant: list[set[int]]  # row numbers into the product list


@dataclass(frozen=True, slots=True)
class Score:
    recall_at_10: float
    ndcg_at_10: float
    queries: int
    precision_at_10: float = 0.0


def aisle_queries(products: Sequence[Product]) -> QuerySet:
    rows: dict[str, set[int]] = defaultdict(set)
    for i, p in enumerate(products):
        if a := p.fields.get("aisle", "").strip():
            rows[a].add(i)
    names = sorted(a for a in rows if a not in ("missing", "other"))  # placeholders, not aisles
    return QuerySet("aisle-name", names, [rows[a] for a in names])


def known_item_queries(products: Sequence[Product], n: int, *, seed: int = 0) -> QuerySet:
    rng = random.Random(seed)
    by_title: dict[str, set[int]] = defaultdict(set)
    for i, p in enumerate(products):
        by_title[p.fields.get("title", "")].add(i)
    candidates = list(range(len(products)))
    rng.shuffle(candidates)
    queries: list[str] = []
    relevant: list[set[int]] = []
    for i in candidates:
        if len(queries) >= n:
            break
        title = products[i].fields.get("title", "")
        q = fragment(title, rng)
        if q is not None:
            queries.append(q)
            relevant.append(by_title[title])
    return QuerySet("known-item", queries, relevant)


def attribute_queries(products: Sequence[Product], path: Path = ATTRIBUTE_QUERIES) -> list[QuerySet]:
    """Attribute queries ("dairy free ice cream"), twice: `attribute`, relevant = the products whose
    title has the attribute as a phrase and every other query word (singular or plural); and
    `attribute-carried`, relevant = every product carrying the attribute (its precision@10: the
    share of results that have what the shopper typed). Queries no product answers are left out."""
    from catalog.lexical import words

    titles = [words(p.fields.get("title", "")) for p in products]
    stems = [{_stem(w) for w in ws} for ws in titles]
    both, carried = QuerySet("attribute", [], []), QuerySet("attribute-carried", [], [])
    with path.open(encoding="utf-8") as f:
        for row in csv.DictReader(f):
            attr = words(row["attribute"])
            rest = [_stem(w) for w in words(row["query"]) if w not in attr]
            carriers = {i for i, ws in enumerate(titles) if _has_phrase(ws, attr)}
            rows = {i for i in carriers if all(w in stems[i] for w in rest)}
            if rows:
                for qs, rel in ((both, rows), (carried, carriers)):
                    qs.queries.append(row["query"])
                    qs.relevant.append(rel)
    return [both, carried] if both.queries else []


def _stem(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _has_phrase(ws: Sequence[str], phrase: Sequence[str]) -> bool:
    n = len(phrase)
    return any(list(ws[i:i + n]) == list(phrase) for i in range(len(ws) - n + 1))


def score(ranked: npt.NDArray[np.int64] | Sequence[Sequence[int]], relevant: Sequence[set[int]],
          k: int = K) -> Score:
    """Mean metrics of ranked rows (one list per query, best first; a list may be short or empty)."""
    if len(relevant) == 0:
        raise InvalidInput("no queries to score")
    recalls, ndcgs, precisions = [], [], []
    for row, rel in zip(ranked, relevant, strict=True):
        top = [int(r) for r in row[:k]]
        gains = [1.0 if r in rel else 0.0 for r in top]
        ideal = min(len(rel), k)
        recalls.append(sum(gains) / ideal)
        precisions.append(sum(gains) / k)
        dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains))
        idcg = sum(1.0 / math.log2(i + 2) for i in range(ideal))
        ndcgs.append(dcg / idcg)
    return Score(round(float(np.mean(recalls)), 4), round(float(np.mean(ndcgs)), 4), len(relevant),
                 round(float(np.mean(precisions)), 4))


async def embed_all(embedder: Embedder, texts: Sequence[str], batch: int) -> npt.NDArray[np.float32]:
    out = await embedder.embed(list(texts), check=False, backend_batch=batch)
    return out.embeddings


async def evaluate(settings: Settings, *, variant: str, pooling: str, limit: int | None = None,
                   known_items: int = 1000, seed: int = 0, ann_types: Sequence[str] = ("ivf", "hnsw"),
                   products: Sequence[Product] | None = None) -> dict[str, Any]:
    """Embed the catalog with one (variant, pooling) and score both query sets, exact and ANN."""
    check_mode(pooling)
    model_dir = settings.model.model_dir
    manifest = load_manifest(model_dir)
    if pooling != manifest.pooling:
        manifest = dataclasses.replace(manifest, pooling=pooling).with_version()
    products = list(products) if products is not None else read_grocery(limit).products
    texts = [compose_text(p.fields, settings.catalog.text_fields) for p in products]
    backend = OnnxBackend(model_dir, manifest, variant=variant, threads=settings.model.intra_op_threads,
                          max_batch=max(settings.catalog.batch_size, 1))
    embedder = Embedder(load_tokenizer(model_dir, manifest), backend, max_batch=len(texts))
    documents = Embedder(load_tokenizer(model_dir, manifest, role="document"), backend, max_batch=len(texts))
    sets = [aisle_queries(products), known_item_queries(products, known_items, seed=seed)]
    try:
        await backend.start()
        vectors = await embed_all(documents, texts, settings.catalog.batch_size)
        qvecs = [await embed_all(embedder, s.queries, settings.catalog.batch_size) for s in sets]
        # Tuned on other fragments (another seed) than the ones scored, as a build would be.
        calibration = await calibration_queries(texts, embedder.tokenizer, backend, settings.catalog.batch_size,
                                                seed=seed + 1000) if ann_types else None
    finally:
        await backend.close()
    result: dict[str, Any] = {"variant": variant, "pooling": pooling, "items": len(products),
                              "text_fields": list(settings.catalog.text_fields), "exact": {}, "ann": {}}
    for s, q in zip(sets, qvecs, strict=True):
        result["exact"][s.name] = dataclasses.asdict(score(exact_topk(vectors, q, K), s.relevant))
    for kind in ann_types:
        index, params = build_faiss(vectors, settings.catalog, index_type=kind, seed=seed, queries=calibration)
        entry: dict[str, Any] = {"params": params}
        for s, q in zip(sets, qvecs, strict=True):
            truth = exact_topk(vectors, q, K)
            _d, got = index.search(q, K)
            entry[s.name] = dataclasses.asdict(score(got, s.relevant)) | {
                "recall_vs_exact": round(ann_recall(index, vectors, q, K, truth), 4)}
        result["ann"][kind] = entry
    return result


def markdown(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| variant | pooling | index | query set | queries | recall@10 | nDCG@10 | recall@10 vs exact |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, sc in r["exact"].items():
            lines.append(f"| {r['variant']} | {r['pooling']} | flat (exact) | {name} | {sc['queries']} | "
                         f"{sc['recall_at_10']:.3f} | {sc['ndcg_at_10']:.3f} | 1.000 |")
        for kind, entry in r["ann"].items():
            p = entry["params"]
            desc = kind + "".join(f" {k}={p[k]}" for k in ("nlist", "nprobe", "m", "ef_search") if k in p)
            for name in r["exact"]:
                sc = entry[name]
                lines.append(f"| {r['variant']} | {r['pooling']} | {desc} | {name} | {sc['queries']} | "
                             f"{sc['recall_at_10']:.3f} | {sc['ndcg_at_10']:.3f} | {sc['recall_vs_exact']:.3f} |")
    return "\n".join(lines)
