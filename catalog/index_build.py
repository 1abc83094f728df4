"""Building a FAISS product index: choosing its type (flat / HNSW / IVF / IVF-PQ), training it,
and measuring its recall against exact search. catalog/publish.py writes the result into a version;
catalog/index.py (the reader the sidecar imports) loads and searches it.

Exact inner-product search is the default for small catalogs. Above `FLAT_MAX_ITEMS` the default
is HNSW up to `HNSW_MAX_ITEMS`: at the grocery catalog's 50k items it builds in ~6 s and answers in
~0.25 ms at recall@10 0.99 vs exact, where exact search costs ~3.5 ms of a 20 ms keystroke budget
(docs/benchmarks.md). Above that, compressed IVF-PQ: HNSW's build grew to ~6 min at 200k on 2 cores,
and uncompressed vectors stop fitting one machine (10M x 384 fp32 = 15 GB); IVF-PQ (4-bit fast-scan
codes, re-ranked on an fp16 copy) builds 1M items in under a minute and answered faster than IVF-Flat
at the same recall (docs/scale.md). nprobe is chosen at build time as the smallest that reaches the
recall target (plus a margin) against exact search on embedded text queries.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog.faiss_lib import faiss_module, ivf_of
from catalog.settings import CatalogSettings
from inference.errors import InvalidInput

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
INDEX_TYPES = ("auto", "flat", "hnsw", "ivf", "ivfpq")

# The index's sizing and calibration: measured, not per-deployment settings.
# index_type=auto: exact up to FLAT_MAX_ITEMS, HNSW up to HNSW_MAX_ITEMS, compressed IVF-PQ above
# (docs/benchmarks.md levers, "HNSW for 20k-200k items": 50k P95 4.98 -> 0.74 ms at recall@10 0.988;
# docs/scale.md: HNSW's build took ~6 min at 200k on 2 cores).
FLAT_MAX_ITEMS = 20_000
HNSW_MAX_ITEMS = 200_000
# HNSW graph degree and build breadth: docs/scale.md's 50k row (M 32, efC 80: built in 5.7 s, recall@10 0.988).
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80
# Build-time nprobe choice: the smallest reaching ANN_RECALL_TARGET + ANN_RECALL_MARGIN recall@10 vs exact
# on the calibration queries; fresh queries scored ~0.001-0.01 lower (0.949 at 1M calibrated to exactly
# 0.95), hence the margin (docs/scale.md, "Recall@10 >= 0.95 at 1M and at 10M").
ANN_RECALL_TARGET = 0.95
ANN_RECALL_MARGIN = 0.01
# ivfpq: 4-bit PQ sub-quantizers per vector, 0 = dim / 4 (48 bytes of codes at 384-d), and PQ candidates
# re-ranked per result (k x IVFPQ_K_FACTOR, doubled at build up to _MAX_K_FACTOR where recall needs it):
# fp16 re-rank at k_factor 8 reached 0.963 at P95 0.89 ms on 1M items (docs/scale.md, "Why this structure").
IVFPQ_M = 0
IVFPQ_K_FACTOR = 8


def resolve_type(index_type: str, n: int) -> str:
    if index_type not in INDEX_TYPES:
        raise InvalidInput(f"unknown index type {index_type!r}; expected one of {', '.join(INDEX_TYPES)}")
    if index_type != "auto":
        return index_type
    if n <= FLAT_MAX_ITEMS:
        return "flat"
    return "hnsw" if n <= HNSW_MAX_ITEMS else "ivfpq"


def auto_nlist(n: int) -> int:
    # ~sqrt(n) lists; FAISS wants >= 39 training points per list.
    return max(1, min(round(math.sqrt(n)), n // 39))


def ivf_factory(kind: str, d: int, nlist: int, cs: CatalogSettings) -> tuple[str, dict[str, Any]]:
    """The FAISS factory string for an IVF type, and what the manifest records about it.

    ivfpq is 4-bit PQ in fast-scan layout (SIMD over blocks of codes: ~5x faster to scan than 8-bit
    PQ of the same size, measured at 1M items) whose candidates are re-ranked on an fp16 or SQ8 copy
    of each vector: the PQ codes only have to put the true neighbours among k x k_factor candidates."""
    if kind == "ivf":
        return f"IVF{nlist},Flat", {}
    m = IVFPQ_M or d // 4
    if m < 1 or d % m or m % 2:
        raise InvalidInput(f"ivfpq: {m} PQ sub-quantizers must be even and divide the dimension {d}")
    refine = {"fp16": "SQfp16", "sq8": "SQ8"}[cs.ivfpq_refine]
    return (f"IVF{nlist},PQ{m}x4fs,Refine({refine})",
            {"pq_m": m, "pq_bits": 4, "refine": cs.ivfpq_refine, "k_factor": IVFPQ_K_FACTOR})


def build_faiss(vectors: F32, cs: CatalogSettings, *, index_type: str | None = None, seed: int = 0,
                queries: F32 | None = None) -> tuple[Any, dict[str, Any]]:
    """(faiss index, params for the manifest). `vectors` are L2-normalised [n, dim] float32; a
    memory-mapped array is read in chunks, so only the index itself has to fit in memory.

    `queries` calibrate the approximate types (nprobe choice, recorded recall): embedded query-like
    texts are best; None falls back to synthetic ones, which measured easier than real queries."""
    faiss = faiss_module()

    mapped = isinstance(vectors, np.memmap) and vectors.dtype == np.float32
    x = vectors if mapped else np.ascontiguousarray(vectors, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        raise InvalidInput(f"cannot index an empty or non-2-D array {x.shape}")
    n, d = x.shape
    kind = resolve_type(index_type or cs.index_type, n)
    params: dict[str, Any] = {"type": kind}
    index: Any
    if kind != "flat":
        params["calibration"] = "synthetic" if queries is None else f"{len(queries)} embedded text queries"
        queries = sample_queries(x, seed) if queries is None else np.ascontiguousarray(queries, np.float32)
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
        _add(index, x)
        return index, params
    if kind in ("ivf", "ivfpq"):
        nlist = auto_nlist(n)
        factory, extra = ivf_factory(kind, d, nlist, cs)
        index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
        ivf = ivf_of(index)
        ivf.cp.seed = seed
        rng = np.random.default_rng(seed)
        train = x if n <= 64 * nlist else x[np.sort(rng.choice(n, 64 * nlist, replace=False))]
        index.train(np.ascontiguousarray(train, dtype=np.float32))
        _add(index, x)
        if kind == "ivfpq":
            index.k_factor = IVFPQ_K_FACTOR
        params.update(nlist=nlist, **extra)
        assert queries is not None
        if cs.ivf_nprobe > 0:
            ivf.nprobe = params["nprobe"] = min(cs.ivf_nprobe, nlist)
            params["build_recall_at_10"] = round(ann_recall(index, x, queries), 4)
            return index, params
        target = min(1.0, ANN_RECALL_TARGET + ANN_RECALL_MARGIN)
        truth = exact_topk(x, queries, min(10, n))
        params["nprobe"], params["build_recall_at_10"] = _choose_nprobe(index, x, queries, target, truth)
        # Codes too coarse for the data to reach the target even probing every list: re-rank more
        # of PQ's candidates (cheap next to scanning), doubling up to _MAX_K_FACTOR.
        while kind == "ivfpq" and params["build_recall_at_10"] < target and index.k_factor < _MAX_K_FACTOR:
            index.k_factor = params["k_factor"] = min(int(index.k_factor) * 2, _MAX_K_FACTOR)
            params["nprobe"], params["build_recall_at_10"] = _choose_nprobe(index, x, queries, target, truth)
        ivf.nprobe = params["nprobe"]
        if params["build_recall_at_10"] < target:
            log.warning("%s index: recall@10 %.4f at every list probed, under the %.3f target", kind,
                        params["build_recall_at_10"], target)
        return index, params
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        _add(index, x)
        index.hnsw.efSearch = cs.hnsw_ef_search
        params.update(m=HNSW_M, ef_construction=HNSW_EF_CONSTRUCTION, ef_search=cs.hnsw_ef_search)
        assert queries is not None
        params["build_recall_at_10"] = round(ann_recall(index, x, queries), 4)
        return index, params
    raise InvalidInput(f"unknown index type {kind!r}")  # unreachable: resolve_type checked it


_ADD_ROWS = 262_144
_MAX_K_FACTOR = 64


def _add(index: Any, x: F32) -> None:
    # In slices: a memory-mapped input is paged in a slice at a time, never copied whole.
    for s in range(0, x.shape[0], _ADD_ROWS):
        index.add(np.ascontiguousarray(x[s : s + _ADD_ROWS], dtype=np.float32))


def sample_queries(x: F32, seed: int, n: int = 256) -> F32:
    """Stand-in queries: normalised midpoints of two random stored vectors. They fall between
    clusters like real queries do, but still measured easier for IVF than embedded text
    queries on the grocery catalog (prefer `queries=` from real text where there is a model)."""
    rng = np.random.default_rng(seed + 1)
    mid = x[rng.integers(0, x.shape[0], n)] + x[rng.integers(0, x.shape[0], n)]
    norms = np.maximum(np.linalg.norm(mid, axis=1, keepdims=True), 1e-12)
    out: F32 = (mid / norms).astype(np.float32)
    return out


def exact_topk(x: F32, q: F32, k: int) -> I64:
    faiss = faiss_module()

    q = np.ascontiguousarray(q, dtype=np.float32)
    if x.shape[0] <= _ADD_ROWS:
        _d, ids = faiss.knn(q, np.ascontiguousarray(x), k, metric=faiss.METRIC_INNER_PRODUCT)
        return np.asarray(ids, dtype=np.int64)
    # In slices, merged (large or memory-mapped inputs): never a second copy of the vectors.
    best_s = np.full((q.shape[0], k), -np.inf, np.float32)
    best_i = np.full((q.shape[0], k), -1, np.int64)
    for s in range(0, x.shape[0], _ADD_ROWS):
        part = np.ascontiguousarray(x[s : s + _ADD_ROWS], dtype=np.float32)
        ds, di = faiss.knn(q, part, min(k, part.shape[0]), metric=faiss.METRIC_INNER_PRODUCT)
        cs_, ci = np.concatenate([best_s, ds], axis=1), np.concatenate([best_i, di + s], axis=1)
        top = np.argsort(-cs_, axis=1, kind="stable")[:, :k]
        best_s, best_i = np.take_along_axis(cs_, top, axis=1), np.take_along_axis(ci, top, axis=1)
    return best_i


def ann_recall(index: Any, x: F32, q: F32, k: int = 10, truth: I64 | None = None) -> float:
    """Mean |ANN top-k ∩ exact top-k| / k."""
    k = min(k, x.shape[0])
    truth = exact_topk(x, q, k) if truth is None else truth
    _d, got = index.search(q, k)
    return float(np.mean([len(set(g) & set(t)) / k for g, t in zip(got, truth, strict=True)]))


def _choose_nprobe(index: Any, x: F32, q: F32, target: float, truth: I64) -> tuple[int, float]:
    """The smallest nprobe whose recall@10 on `q` (exact answers `truth`) reaches `target` (all
    lists if none does): doubling to bracket it, then bisection (recall grows with nprobe)."""
    ivf = ivf_of(index)

    def recall(nprobe: int) -> float:
        ivf.nprobe = nprobe
        return ann_recall(index, x, q, truth=truth)

    lo, hi, r = 0, 1, recall(1)  # lo fails (0 = nothing probed), hi is being tried
    while r < target and hi < ivf.nlist:
        lo, hi = hi, min(hi * 2, ivf.nlist)
        r = recall(hi)
    if r < target:
        return hi, round(r, 4)
    best = r
    while hi - lo > 1:
        mid = (lo + hi) // 2
        rm = recall(mid)
        if rm >= target:
            hi, best = mid, rm
        else:
            lo = mid
    return hi, round(best, 4)

