"""The FAISS product index: build (flat / HNSW / IVF / IVF-PQ) and a hot-reloading, filterable searcher.

Exact inner-product search is the default for small catalogs. Above `flat_max_items` the default
is HNSW up to `hnsw_max_items`: at the grocery catalog's 50k items it builds in ~6 s and answers in
~0.25 ms at recall@10 0.99 vs exact, where exact search costs ~3.5 ms of a 20 ms keystroke budget
(docs/benchmarks.md). Above that, compressed IVF-PQ: HNSW's build grew to ~6 min at 200k on 2 cores,
and uncompressed vectors stop fitting one machine (10M x 384 fp32 = 15 GB); IVF-PQ (4-bit fast-scan
codes, re-ranked on an fp16 copy) builds 1M items in under a minute and answered faster than IVF-Flat
at the same recall (docs/scale.md). nprobe is chosen at build time as the smallest that reaches the
recall target (plus a margin) against exact search on embedded text queries.

A version may also hold a lexical index (catalog/lexical.py, tantivy) over the same rows: `query`
searches either leg or both fused (catalog/fusion.py), on one loaded version, so a hot swap
replaces both together. Versions built before it existed load and serve semantic search.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import numpy.typing as npt

from catalog import store
from catalog.fusion import LEXICAL_LEG, SEMANTIC_LEG, Fusion, Ranked, SearchMode
from catalog.settings import CatalogSettings
from inference.errors import FailedPrecondition, Internal, InvalidInput, ModelError, NotFound, Unavailable

if TYPE_CHECKING:
    from catalog.completion import Completer
    from catalog.lexical import LexicalHits, LexicalIndex

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
INDEX_TYPES = ("auto", "flat", "hnsw", "ivf", "ivfpq")
FILTER_FIELDS = ("department", "aisle")
# ANN + a selective filter misses results (the few matching items sit in unprobed lists), so a
# filtered ANN search over up to this many matching items is done exactly on their vectors.
EXACT_SUBSET_MAX = 50_000
_FILTER_CACHE = 256


def faiss_module() -> Any:
    """FAISS, imported on first use (it is heavy) and typed loosely (its SWIG stubs are partial)."""
    # Its loader logs every CPU-variant probe at INFO: noise in every command's output.
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    import faiss

    return faiss


@dataclass(frozen=True, slots=True)
class Hit:
    id: str
    score: float
    fields: dict[str, str]
    legs: tuple[str, ...] = ()  # the search leg(s) that found it: "semantic", "lexical"


@dataclass(slots=True)
class Ranking:
    """`ProductIndex.rank`'s answer: one list per query, and each leg's time (ns) over all queries."""

    lists: list[Ranked]
    semantic_ns: int = 0
    lexical_ns: int = 0


# --- building --------------------------------------------------------------------------------
def resolve_type(index_type: str, n: int, cs: CatalogSettings) -> str:
    if index_type not in INDEX_TYPES:
        raise InvalidInput(f"unknown index type {index_type!r}; expected one of {', '.join(INDEX_TYPES)}")
    if index_type != "auto":
        return index_type
    if n <= cs.flat_max_items:
        return "flat"
    return "hnsw" if n <= cs.hnsw_max_items else "ivfpq"


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
    m = cs.ivfpq_m or d // 4
    if m < 1 or d % m or m % 2:
        raise InvalidInput(f"ivfpq_m {m} must be even and divide the dimension {d}")
    refine = {"fp16": "SQfp16", "sq8": "SQ8"}[cs.ivfpq_refine]
    return (f"IVF{nlist},PQ{m}x4fs,Refine({refine})",
            {"pq_m": m, "pq_bits": 4, "refine": cs.ivfpq_refine, "k_factor": cs.ivfpq_k_factor})


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
    kind = resolve_type(index_type or cs.index_type, n, cs)
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
        nlist = cs.ivf_nlist or auto_nlist(n)
        if nlist > n:
            raise InvalidInput(f"ivf_nlist {nlist} is more than the {n} items to index")
        factory, extra = ivf_factory(kind, d, nlist, cs)
        index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
        ivf = _ivf(index)
        ivf.cp.seed = seed
        rng = np.random.default_rng(seed)
        train = x if n <= 64 * nlist else x[np.sort(rng.choice(n, 64 * nlist, replace=False))]
        index.train(np.ascontiguousarray(train, dtype=np.float32))
        _add(index, x)
        if kind == "ivfpq":
            index.k_factor = cs.ivfpq_k_factor
        params.update(nlist=nlist, **extra)
        assert queries is not None
        if cs.ivf_nprobe > 0:
            ivf.nprobe = params["nprobe"] = min(cs.ivf_nprobe, nlist)
            params["build_recall_at_10"] = round(ann_recall(index, x, queries), 4)
            return index, params
        target = min(1.0, cs.ann_recall_target + cs.ann_recall_margin)
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
        index = faiss.IndexHNSWFlat(d, cs.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = cs.hnsw_ef_construction
        _add(index, x)
        index.hnsw.efSearch = cs.hnsw_ef_search
        params.update(m=cs.hnsw_m, ef_construction=cs.hnsw_ef_construction, ef_search=cs.hnsw_ef_search)
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
    ivf = _ivf(index)

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


# --- searching -------------------------------------------------------------------------------
@dataclass(slots=True)
class _Snapshot:
    """One loaded version; immutable once published to searchers (hot swap = replace the ref)."""

    path: Path
    manifest: dict[str, Any]
    index: Any
    vectors: F32
    table: Any  # pyarrow.Table, row i = vector i
    on_gpu: bool
    lexical: LexicalIndex | None  # None: a version built before lexical search
    completer: Completer | None = None  # the version's vocabulary, where complete_last_word is on
    filters: OrderedDict[tuple[str, str], tuple[I64, Any]] = field(default_factory=OrderedDict)
    filters_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def size(self) -> int:
        return int(self.vectors.shape[0])

    def filter_rows(self, department: str | None, aisle: str | None) -> tuple[I64, Any]:
        """Rows matching the filter (case-insensitive) and a FAISS selector over them (cached)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        key = ((department or "").strip().lower(), (aisle or "").strip().lower())
        hit = self.filters.get(key)
        if hit is not None:
            return hit
        mask = np.ones(self.size, dtype=bool)
        for name, want in zip(FILTER_FIELDS, key, strict=True):
            if not want:
                continue
            if name not in self.table.column_names:
                mask[:] = False
                break
            col = pc.utf8_lower(pc.utf8_trim_whitespace(self.table[name].cast(pa.string())))
            mask &= np.asarray(pc.fill_null(pc.equal(col, want), False).to_numpy(zero_copy_only=False))
        rows = np.flatnonzero(mask).astype(np.int64)
        faiss = faiss_module()
        bitmap = np.packbits(mask, bitorder="little")
        selector = faiss.IDSelectorBitmap(self.size, faiss.swig_ptr(bitmap))
        selector.bitmap_ref = bitmap  # the selector points into this array: keep it alive
        with self.filters_lock:
            self.filters[key] = (rows, selector)
            while len(self.filters) > _FILTER_CACHE:
                self.filters.popitem(last=False)
        return rows, selector


class ProductIndex:
    """Search the newest complete index version under `index_root`; thread-safe, hot-swappable."""

    def __init__(self, index_root: Path, snapshot: _Snapshot, *, expected_model_id: str | None,
                 nprobe: int | None, ef_search: int | None, use_gpu: bool, search_threads: int = 1,
                 fusion: Fusion | None = None, complete_last_word: bool = False) -> None:
        self.index_root = index_root
        self.fusion = fusion or Fusion()
        self.complete_last_word = complete_last_word
        self._search_threads = max(1, search_threads)
        self._snap = snapshot
        self._expected = expected_model_id
        self._nprobe = nprobe
        self._ef = ef_search
        self._use_gpu = use_gpu
        self._reload_lock = threading.Lock()

    @classmethod
    def open(cls, index_root: Path, *, expected_model_id: str | None, search_threads: int = 1,
             nprobe: int | None = None, ef_search: int | None = None, use_gpu: bool = True,
             fusion: Fusion | None = None, complete_last_word: bool = False) -> Self:
        """Load the newest complete version. nprobe/ef None = the values recorded at build time;
        complete_last_word: `embedding_texts` completes a half-typed last word (catalog/completion.py)."""
        faiss = faiss_module()

        faiss.omp_set_num_threads(max(1, search_threads))
        # The newest version of the running model: while a catalog moves to another model (e.g. the
        # int8 default), sidecars of either one serve their own versions from one root.
        path = store.newest_version(index_root, model_id=expected_model_id)
        if path is None:
            other = store.newest_version(index_root)
            if other is None:
                raise Unavailable(f"no complete index under {index_root}: run `embedcar catalog build`")
            raise _other_model(other, store.read_manifest(other).get("model_id"), expected_model_id)
        snap = _load(path, nprobe=nprobe, ef_search=ef_search, use_gpu=use_gpu, completion=complete_last_word)
        _check_model(snap, expected_model_id)
        return cls(index_root, snap, expected_model_id=expected_model_id, nprobe=nprobe, search_threads=search_threads,
                   ef_search=ef_search, use_gpu=use_gpu, fusion=fusion, complete_last_word=complete_last_word)

    @classmethod
    def from_settings(cls, cs: CatalogSettings, *, expected_model_id: str | None,
                      index_root: Path | None = None) -> Self:
        return cls.open(index_root or cs.index_root, expected_model_id=expected_model_id,
                        search_threads=cs.search_threads, nprobe=cs.ivf_nprobe or None,
                        ef_search=cs.hnsw_ef_search, use_gpu=cs.use_gpu, fusion=Fusion.from_settings(cs),
                        complete_last_word=cs.complete_last_word)

    # --- properties of the version being served ------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        return dict(self._snap.manifest)

    @property
    def version(self) -> str:
        return self._snap.path.name

    @property
    def size(self) -> int:
        return self._snap.size

    @property
    def model_id(self) -> str:
        return str(self._snap.manifest["model_id"])

    @property
    def dim(self) -> int:
        return int(self._snap.vectors.shape[1])

    @property
    def has_lexical(self) -> bool:
        return self._snap.lexical is not None

    # --- hot reload ---------------------------------------------------------------------------
    def maybe_reload(self) -> bool:
        """Swap in a newer complete version if there is one; in-flight searches keep the old one.

        `version` then names the new one at once, even to a caller whose search ran on the old
        one: a caller that reports which version answered swaps objects with `reloaded()`."""
        with self._reload_lock:
            snap = self._newer_snapshot()
            if snap is None:
                return False
            self._snap = snap  # one reference assignment: atomic for concurrent readers
            log.info("index swapped to %s (%d items)", snap.path.name, snap.size)
            return True

    def reloaded(self) -> Self | None:
        """A new ProductIndex on a newer complete version, or None; this one stays on its version,
        so a search through it and the `version` it reports always belong together."""
        with self._reload_lock:
            snap = self._newer_snapshot()
        if snap is None:
            return None
        log.info("index %s loaded (%d items)", snap.path.name, snap.size)
        return type(self)(self.index_root, snap, expected_model_id=self._expected, nprobe=self._nprobe,
                          ef_search=self._ef, use_gpu=self._use_gpu, search_threads=self._search_threads,
                          fusion=self.fusion, complete_last_word=self.complete_last_word)

    def _newer_snapshot(self) -> _Snapshot | None:
        path = store.newest_version(self.index_root, model_id=self._expected)
        if path is None or path.name <= self._snap.path.name:
            return None
        try:
            snap = _load(path, nprobe=self._nprobe, ef_search=self._ef, use_gpu=self._use_gpu,
                         completion=self.complete_last_word)
            _check_model(snap, self._expected)
        except (ModelError, NotFound, Unavailable, Internal) as exc:  # pruned/broken: keep serving
            log.warning("not swapping to index %s: %s", path.name, exc.message)
            return None
        return snap

    # --- search -------------------------------------------------------------------------------
    def embedding_texts(self, texts: Sequence[str], *, max_chars: int | None = None) -> list[str]:
        """What the semantic leg embeds for these query texts: the one place that decides it (the
        sidecar's Search and `catalog quality --prefixes` both call it). With complete_last_word, a
        half-typed last word completed from this version's vocabulary (catalog/completion.py); the
        lexical leg keeps the typed text (it reads the last word as a prefix). A completion longer
        than `max_chars` (what the embedder accepts) is not made: the typed text must not be refused."""
        completer = self._snap.completer
        if completer is None:
            return list(texts)
        out = []
        for t in texts:
            done = completer.complete(t)
            out.append(t if max_chars is not None and len(done) > max_chars else done)
        return out

    def search(self, queries: npt.NDArray[np.floating], k: int = 10, *, department: str | None = None,
               aisle: str | None = None) -> list[list[Hit]]:
        """Semantic search: the nearest products to each query vector."""
        snap = self._snap  # every step below uses this one version, even if a swap happens now
        return _hits(snap, self._semantic(snap, _vectors(snap, queries), k, department, aisle))

    def query(self, texts: Sequence[str], queries: npt.NDArray[np.floating] | None, k: int = 10, *,
              mode: SearchMode = SearchMode.SEMANTIC, department: str | None = None,
              aisle: str | None = None) -> tuple[list[list[Hit]], Ranking]:
        """Search by `mode` (queries: the texts' embeddings; None for LEXICAL), on one version."""
        snap = self._snap
        ranking = self._rank(snap, texts, queries, k, mode, department, aisle)
        return _hits(snap, ranking.lists), ranking

    def rank(self, texts: Sequence[str], queries: npt.NDArray[np.floating] | None, k: int = 10, *,
             mode: SearchMode = SearchMode.SEMANTIC, department: str | None = None, aisle: str | None = None,
             fusion: Fusion | None = None) -> Ranking:
        """As `query`, rows instead of hits (quality evaluation); `fusion` overrides the configured one."""
        return self._rank(self._snap, texts, queries, k, mode, department, aisle, fusion)

    def _rank(self, snap: _Snapshot, texts: Sequence[str], queries: npt.NDArray[np.floating] | None, k: int,
              mode: SearchMode, department: str | None, aisle: str | None,
              fusion: Fusion | None = None) -> Ranking:
        if snap.lexical is None and mode == SearchMode.LEXICAL:
            raise FailedPrecondition(f"index version {snap.path.name} has no lexical index (built before lexical "
                                     "search existed): rebuild it with `embedcar catalog build`")
        if k < 1:
            raise InvalidInput(f"k must be at least 1, got {k}")
        fusion = fusion or self.fusion
        semantic = mode != SearchMode.LEXICAL
        lexical = mode != SearchMode.SEMANTIC and snap.lexical is not None  # an older version: semantic only
        # Fusing needs more than k from each leg: a product ranked 15th by both should beat one 9th by one.
        depth = max(k, fusion.depth) if semantic and lexical else k
        out = Ranking([])
        sem: list[Ranked] = []
        if semantic:
            if queries is None:
                raise InvalidInput(f"{mode.value} search needs the query embeddings")
            q = _vectors(snap, queries)
            if q.shape[0] != len(texts):
                raise InvalidInput(f"{len(texts)} texts but {q.shape[0]} query vectors")
            t0 = time.perf_counter_ns()
            sem = self._semantic(snap, q, depth, department, aisle)
            out.semantic_ns = time.perf_counter_ns() - t0
        lex: list[LexicalHits] = []
        if lexical:
            assert snap.lexical is not None
            t0 = time.perf_counter_ns()
            lex = [snap.lexical.search(t, depth, department=department, aisle=aisle) for t in texts]
            out.lexical_ns = time.perf_counter_ns() - t0
        if semantic and lexical:
            out.lists = [fusion.fuse(s, Ranked.single(LEXICAL_LEG, x.rows, x.scores), x.complete, k,
                                     single_word=x.terms == 1) for s, x in zip(sem, lex, strict=True)]
        elif lexical:
            out.lists = [Ranked.single(LEXICAL_LEG, x.rows, x.scores) for x in lex]
        else:
            out.lists = sem
        return out

    def _semantic(self, snap: _Snapshot, q: F32, k: int, department: str | None, aisle: str | None) -> list[Ranked]:
        if k < 1:
            raise InvalidInput(f"k must be at least 1, got {k}")
        if q.shape[0] == 0:
            return []
        k = min(k, snap.size)
        # OpenMP's thread count is per calling thread: set it in the thread that searches (a
        # worker thread in the sidecar), or FAISS starts its default team of one per core, which
        # costs a single query ~3x (measured: 2.8 ms with 1 thread vs 8 ms with 2 at 50k items).
        faiss_module().omp_set_num_threads(self._search_threads)
        try:
            if department or aisle:
                scores, rows = self._search_filtered(snap, q, k, department, aisle)
            else:
                scores, rows = snap.index.search(q, k)
        except InvalidInput:
            raise
        except Exception as exc:  # FAISS raises RuntimeError for its own failures
            raise Internal(f"FAISS search failed: {exc}") from exc
        # FAISS pads with -1 when fewer than k results exist.
        return [Ranked.single(SEMANTIC_LEG, r[r >= 0], s[r >= 0])
                for s, r in zip(np.asarray(scores), np.asarray(rows), strict=True)]

    def _search_filtered(self, snap: _Snapshot, q: F32, k: int, department: str | None,
                         aisle: str | None) -> tuple[Any, Any]:
        faiss = faiss_module()

        rows, selector = snap.filter_rows(department, aisle)
        if rows.size == 0:
            return np.zeros((q.shape[0], 0), np.float32), np.zeros((q.shape[0], 0), np.int64)
        kind = snap.manifest["index"]["type"]
        if kind == "flat" and not snap.on_gpu:
            found: tuple[Any, Any] = snap.index.search(q, min(k, rows.size),
                                                       params=faiss.SearchParameters(sel=selector))
            return found
        if rows.size <= EXACT_SUBSET_MAX or snap.on_gpu:
            sub = snap.vectors[rows]
            kk = min(k, rows.size)
            scores = q @ sub.T
            top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
            part = np.take_along_axis(scores, top, axis=1)
            order = np.argsort(-part, axis=1, kind="stable")
            return np.take_along_axis(part, order, axis=1), rows[np.take_along_axis(top, order, axis=1)]
        params: Any
        if kind in ("ivf", "ivfpq"):
            params = faiss.SearchParametersIVF(sel=selector, nprobe=int(_ivf(snap.index).nprobe))
            if kind == "ivfpq":  # the selector filters PQ's candidates; the re-rank keeps its k_factor
                params = faiss.IndexRefineSearchParameters(k_factor=float(snap.index.k_factor),
                                                           base_index_params=params)
        else:
            params = faiss.SearchParametersHNSW(sel=selector, efSearch=int(snap.index.hnsw.efSearch))
        found = snap.index.search(q, k, params=params)
        return found


def _ivf(index: Any) -> Any:
    faiss = faiss_module()

    return faiss.extract_index_ivf(index)


def _vectors(snap: _Snapshot, queries: npt.NDArray[np.floating]) -> F32:
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2 or q.shape[1] != snap.vectors.shape[1]:
        raise InvalidInput(f"queries must be [n, {snap.vectors.shape[1]}], got {list(q.shape)}")
    if not np.isfinite(q).all():
        raise InvalidInput("queries contain NaN or infinite values")
    return q


def _hits(snap: _Snapshot, lists: list[Ranked]) -> list[list[Hit]]:
    import pyarrow as pa

    flat = [r for ranked in lists for r in ranked.rows]
    records = snap.table.take(pa.array(flat, type=pa.int64())).to_pylist() if flat else []
    it = iter(records)
    out: list[list[Hit]] = []
    for ranked in lists:
        hits = []
        for s, legs in zip(ranked.scores, ranked.legs, strict=True):
            rec = next(it)
            pid = str(rec.pop("id"))
            hits.append(Hit(pid, s, {kk: str(v) for kk, v in rec.items() if v is not None and v != ""}, legs))
        out.append(hits)
    return out


def _check_model(snap: _Snapshot, expected: str | None) -> None:
    got = snap.manifest.get("model_id")
    if expected is not None and got != expected:
        raise _other_model(snap.path, got, expected)


def _other_model(path: Path, got: object, expected: str | None) -> ModelError:
    return ModelError(f"index {path.name} was built with model {got}, but the running model is "
                      f"{expected}: rebuild it with `embedcar catalog build`")


def _load(path: Path, *, nprobe: int | None, ef_search: int | None, use_gpu: bool,
          completion: bool = False) -> _Snapshot:
    import pyarrow.parquet as pq

    faiss = faiss_module()

    manifest = store.read_manifest(path)
    try:
        index = faiss.read_index(str(path / store.INDEX_FILE))
        vectors = np.load(path / store.VECTORS_FILE, mmap_mode="r")
        table = pq.read_table(path / store.PRODUCTS_FILE)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ModelError(f"index version {path.name} is unreadable: {exc}") from exc
    if not (index.ntotal == vectors.shape[0] == table.num_rows == manifest.get("count")):
        raise ModelError(f"index version {path.name} is inconsistent: index {index.ntotal}, "
                         f"vectors {vectors.shape[0]}, products {table.num_rows}, manifest {manifest.get('count')}")
    kind = manifest["index"]["type"]
    if kind in ("ivf", "ivfpq"):
        _ivf(index).nprobe = nprobe or int(manifest["index"].get("nprobe", 16))
        if kind == "ivfpq":
            index.k_factor = float(manifest["index"]["k_factor"])  # every ivfpq build records it
    elif kind == "hnsw":
        index.hnsw.efSearch = ef_search or int(manifest["index"].get("ef_search", 64))
    lexical = None
    if "lexical" in manifest:
        from catalog.lexical import LexicalIndex

        lexical = LexicalIndex.open(path, manifest["lexical"])
        if lexical.docs != table.num_rows:
            raise ModelError(f"index version {path.name} is inconsistent: lexical index {lexical.docs} "
                             f"documents, products {table.num_rows}")
    completer = None
    if completion:  # built with the version (~0.1 s at 50k titles), so a swap replaces it too
        from catalog.completion import Completer

        completer = Completer.from_table(table, manifest.get("text_fields") or ("title",))
    on_gpu = False
    if use_gpu and hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0 and kind in ("flat", "ivf"):
        # Same interface on the GPU; FAISS has no GPU HNSW, fast-scan PQ or re-rank wrapper: CPU.
        index = faiss.index_cpu_to_all_gpus(index)
        on_gpu = True
    return _Snapshot(path, manifest, index, vectors, table, on_gpu, lexical, completer)
