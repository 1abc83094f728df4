"""The catalog section (batch job, FAISS and lexical indexes, hybrid fusion) and the catalog layer's `Settings`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from inference import settings as inference
from inference.settings import setting

ENGINES = ("local", "ray")  # catalog/job.py (local) and catalog/ray_engine.py


@dataclass(frozen=True, slots=True)
class CatalogSettings:
    index_root: Path = setting(Path("indexes/grocery"), "Folder of versioned index directories; relative: under "
                               "the data home (EMBEDCAR_HOME).", home=True)
    index_type: str = setting("auto", "auto, flat (exact), hnsw, ivf, or ivfpq (IVF-PQ + a re-rank copy: compressed).")
    ivf_nprobe: int = setting(0, "IVF lists probed per query; 0 = the value measured at build time.", min=0)
    hnsw_m: int = setting(32, "HNSW graph degree.", min=2)
    hnsw_ef_search: int = setting(64, "HNSW search breadth.", min=1)
    batch_size: int = setting(128, "Texts per backend call in the batch job.", min=1)
    in_flight: int = setting(2, "Backend calls in flight in the batch job.", min=1)
    search_threads: int = setting(1, "FAISS OpenMP threads (1 is fastest for single queries).", min=1, max=1024)
    text_fields: tuple[str, ...] = setting(
        ("title",), "Product fields joined (with ' | ') into the embedded text.")
    flat_max_items: int = setting(20_000, "auto index type: exact search up to this many items.", min=0)
    hnsw_max_items: int = setting(
        200_000, "auto index type: HNSW above flat_max_items up to this many items (its build grows fast), "
        "compressed IVF-PQ above.", min=0
    )
    ivf_nlist: int = setting(0, "IVF lists; 0 = about sqrt(items).", min=0)
    ann_recall_target: float = setting(0.95, "Build-time nprobe choice: smallest reaching this recall@10 vs exact.",
                                       min=0, max=1)
    ann_recall_margin: float = setting(
        0.01, "Build-time nprobe choice aims this far above the target: it is chosen on calibration queries, "
        "and fresh queries scored a little lower (0.949 at 1M items when calibrated to exactly 0.95).", min=0, max=1)
    ivfpq_m: int = setting(0, "ivfpq: 4-bit PQ sub-quantizers per vector (fast-scan); 0 = dim / 4 (48 bytes at 384-d).",
                            min=0)
    ivfpq_refine: str = setting(
        "fp16", "ivfpq: the copy of each vector that re-ranks PQ's candidates: fp16 (2 bytes per dimension) or "
        "sq8 (1 byte; recall measured ~0.02 lower at the same nprobe).", choices=("fp16", "sq8"))
    ivfpq_k_factor: int = setting(8, "ivfpq: PQ candidates re-ranked per result (k x this many).", min=1)
    hnsw_ef_construction: int = setting(80, "HNSW build breadth (slow on CPU: ~6 min for 200k items on 2 cores).",
                                         min=1)
    chunk_items: int = setting(4096, "Batch job checkpoint granularity: items per chunk file.", min=1)
    # Publish checks (catalog/publish.py): a build failing one is written aside, not made current.
    max_bad_share: float = setting(
        0.01, "Publish check: a build whose bad rows (skipped) are more than this share of the rows read, and "
        "more than max_bad_rows, is held back (written aside, not published; --force publishes it).", min=0, max=1)
    max_bad_rows: int = setting(
        10, "Publish check: bad rows a build may always skip whatever their share (a small file's few broken "
        "rows); 0 with max_bad_share 0 = none.", min=0)
    min_count_share: float = setting(
        0.5, "Publish check: a build with fewer items than this share of the current version's is held back "
        "(a catalog does not halve overnight; a truncated or misread file does). 0 = off.", min=0, max=1)
    engine: str = setting("local", "Batch job engine: local (this process) or ray (a Ray Data actor pool, same "
                          "vectors and checkpoints).", choices=ENGINES)
    ray_address: str = setting("", "engine=ray: a running Ray cluster's address; empty = a local Ray sized to "
                               "this machine, shut down after the build.")
    ray_actors: int = setting(0, "engine=ray: embedding actors; 0 = as many as the cluster's CPUs hold.", min=0)
    use_gpu: bool = setting(True, "Move the index to the GPU when faiss has GPUs.")
    # Hybrid fusion (catalog/fusion.py, Fusion): the defaults are what measured best on the prefix sets.
    rrf_k: float = setting(10.0, "Hybrid Search: reciprocal rank fusion constant (a hit scores sum of w / (k + rank)).",
                           min=0)
    fusion_depth: int = setting(50, "Hybrid Search: candidates read from each leg (semantic, lexical) before fusing.",
                                min=1)
    fusion_complete_weight: float = setting(
        8.0, "Hybrid Search: lexical leg weight when ordering the products that match every typed word of a query of "
        "two or more words (ranked first).", min=0)
    fusion_partial_weight: float = setting(
        0.25, "Hybrid Search: lexical leg weight when no product matches every typed word (the semantic leg leads).",
        min=0)
    fusion_single_word_weight: float = setting(
        0.5, "Hybrid Search: lexical leg weight when ordering the products ranked first for a one-word query "
        "(every lexical hit then matches every typed word; below 1, the semantic rank orders them). 8 (as "
        "fusion_complete_weight) scored below semantic on aisle names at 25 / 50 % with complete_last_word; "
        "0.5 at least the better leg at every cut (all-MiniLM-L6-v2; not yet with a model tuned on the aisle names: "
        "docs/benchmarks.md, issue 45).", min=0)
    complete_last_word: bool = setting(
        True, "Search (semantic and hybrid): embed the query with its half-typed last word completed to the "
        "index version's most frequent word starting with it ('ice cr' -> 'ice cream'; catalog/completion.py); "
        "the lexical leg keeps the typed text. Semantic recall@10 at 25 % of a query's characters measured "
        "0.141 -> 0.245 (aisle names); hybrid at most 0.003 lower at any cut (docs/benchmarks.md, issue 45).")


@dataclass(frozen=True, slots=True)
class Settings(inference.Settings):
    """model, triton and catalog: what the batch job and the index read."""

    catalog: CatalogSettings = field(default_factory=CatalogSettings)
