"""The catalog section (batch job, FAISS and lexical indexes, hybrid fusion) and the catalog layer's `Settings`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from inference import settings as inference
from inference.settings import setting

ENGINES = ("local", "ray")  # catalog/job.py (local) and catalog/ray_engine.py


@dataclass(frozen=True, slots=True)
class CatalogSettings:
    """What an operator sets for the batch job and the index. The index's sizing and calibration
    (type thresholds, IVF lists, recall target, PQ codes, HNSW graph) are constants in
    catalog/index_build.py and the hybrid fusion's weights in catalog/fusion.py: each was measured
    (docs/scale.md, docs/benchmarks.md), none is a per-deployment choice."""

    index_root: Path = setting(Path("indexes/grocery"), "Folder of versioned index directories; relative: under "
                               "the data home (EMBEDCAR_HOME). `catalog build` left without it builds each catalog "
                               "into its own folder beside this one: indexes/<--name, else the file's name>.",
                               home=True)
    index_type: str = setting("auto", "auto (exact up to 20k items, HNSW up to 200k, IVF-PQ above), flat (exact), "
                              "hnsw, ivf, or ivfpq (IVF-PQ + a re-rank copy: compressed).")
    text_fields: tuple[str, ...] = setting(
        ("title",), "Product fields joined (with ' | ') into the embedded text.")
    filter_fields: tuple[str, ...] = setting(
        (), "Columns Search may filter on (matched to the file's columns case-insensitively; a name no column "
        "has is refused with a did-you-mean); none = department and aisle where the catalog has them.")
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
    min_id_overlap: float = setting(
        0.1, "A build sharing fewer than this share of its ids (of the smaller catalog) with the current version "
        "is another catalog: refused before embedding, --force or not; build it into its own index root "
        "(--name or --index-root). 0 = off.", min=0, max=1)
    engine: str = setting("local", "Batch job engine: local (this process) or ray (a Ray Data actor pool, same "
                          "vectors and checkpoints).", choices=ENGINES)
    ray_address: str = setting("", "engine=ray: a running Ray cluster's address; empty = a local Ray sized to "
                               "this machine, shut down after the build.")
    ray_actors: int = setting(0, "engine=ray: embedding actors; 0 = as many as the cluster's CPUs hold.", min=0,
                              advanced=True)
    batch_size: int = setting(128, "Texts per backend call in the batch job.", min=1, advanced=True)
    in_flight: int = setting(2, "Backend calls in flight in the batch job.", min=1, advanced=True)
    chunk_items: int = setting(4096, "Batch job checkpoint granularity: items per chunk file.", min=1, advanced=True)
    ivfpq_refine: str = setting(
        "fp16", "ivfpq: the copy of each vector that re-ranks PQ's candidates: fp16 (2 bytes per dimension) or "
        "sq8 (1 byte; recall measured ~0.02 lower at the same nprobe).", choices=("fp16", "sq8"), advanced=True)
    ivf_nprobe: int = setting(0, "IVF lists probed per query; 0 = the value measured at build time.", min=0,
                              advanced=True)
    hnsw_ef_search: int = setting(64, "HNSW search breadth (recorded at build time; the sidecar searches with "
                                  "this one).", min=1, advanced=True)
    search_threads: int = setting(1, "FAISS OpenMP threads (1 is fastest for single queries).", min=1, max=1024,
                                  advanced=True)
    use_gpu: bool = setting(True, "Move the index to the GPU when faiss has GPUs.", advanced=True)
    complete_last_word: bool = setting(
        True, "Search (semantic and hybrid): embed the query with its half-typed last word completed to the "
        "index version's most frequent word starting with it ('ice cr' -> 'ice cream'; catalog/completion.py); "
        "the lexical leg keeps the typed text. Semantic recall@10 at 25 % of a query's characters measured "
        "0.141 -> 0.245 (aisle names); hybrid at most 0.003 lower at any cut (docs/benchmarks.md).",
        advanced=True)


@dataclass(frozen=True, slots=True)
class Settings(inference.Settings):
    """model, triton and catalog: what the batch job and the index read."""

    catalog: CatalogSettings = field(default_factory=CatalogSettings)
