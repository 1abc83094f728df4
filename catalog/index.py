"""The FAISS product index the sidecar searches: the newest complete version under an index root,
hot-reloadable and filterable (catalog/index_version.py loads one; catalog/index_build.py builds them).

A version may also hold a lexical index (catalog/lexical.py, tantivy) over the same rows: `query`
searches either leg or both fused (catalog/fusion.py), on one loaded version, so a hot swap
replaces both together. Versions built before it existed load and serve semantic search.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import numpy.typing as npt

from catalog import store
from catalog.faiss_lib import faiss_module, ivf_of
from catalog.filters import Filters, merged
from catalog.fusion import LEXICAL_LEG, SEMANTIC_LEG, FittedFusion, Fusion, Ranked, SearchMode, query_shape
from catalog.index_version import Snapshot, check_model, load_version, other_model
from catalog.settings import CatalogSettings
from embedcar_client.results import SearchHit as Hit  # one hit type: the index's is a client's
from inference.errors import FailedPrecondition, Internal, InvalidInput, ModelError, NotFound, Unavailable

if TYPE_CHECKING:
    from catalog.lexical import LexicalHits

log = logging.getLogger(__name__)
__all__ = ["EXACT_SUBSET_MAX", "Hit", "Legs", "ProductIndex", "Ranking", "fuse"]

F32 = npt.NDArray[np.float32]
# ANN + a selective filter misses results (the few matching items sit in unprobed lists), so a
# filtered ANN search over up to this many matching items is done exactly on their vectors.
EXACT_SUBSET_MAX = 50_000


@dataclass(frozen=True, slots=True)
class Legs:
    """One query's candidates from each leg (`ProductIndex.legs`), and the rows carrying its typed attributes."""

    semantic: Ranked
    lexical: LexicalHits
    carriers: frozenset[int] | None

    @property
    def shape(self) -> str:
        return query_shape(self.lexical.terms, len(self.lexical.attributes))


def fuse(fusion: Fusion, semantic: Ranked, lexical: LexicalHits, k: int, carriers: frozenset[int] | None) -> Ranked:
    """Hybrid's best `k` of one query's two legs."""
    return fusion.fuse(semantic, Ranked.single(LEXICAL_LEG, lexical.rows, lexical.scores), lexical.complete, k,
                       single_word=lexical.terms == 1, carriers=carriers)


@dataclass(slots=True)
class Ranking:
    """`ProductIndex.rank`'s answer: one list per query, and each leg's time (ns) over all queries."""

    lists: list[Ranked]
    semantic_ns: int = 0
    lexical_ns: int = 0
    attributes: list[tuple[str, ...]] = field(default_factory=list)  # typed in full, per query (if any)


class ProductIndex:
    """Search the newest complete index version under `index_root`; thread-safe, hot-swappable."""

    def __init__(self, index_root: Path, snapshot: Snapshot, *, expected_model_id: str | None,
                 nprobe: int | None, ef_search: int | None, use_gpu: bool, search_threads: int = 1,
                 fusion: Fusion | None = None, complete_last_word: bool = False) -> None:
        self.index_root = index_root
        self.fusion = fusion or Fusion()
        # The fusion fitted on a team's judgements for this version, per query shape (catalog/fusion_fit.py)
        self.fitted = FittedFusion.from_manifest(snapshot.manifest.get("fusion"), self.fusion)
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
            raise other_model(other, store.read_manifest(other).get("model_id"), expected_model_id)
        snap = load_version(path, nprobe=nprobe, ef_search=ef_search, use_gpu=use_gpu,
                            completion=complete_last_word)
        check_model(snap, expected_model_id)
        return cls(index_root, snap, expected_model_id=expected_model_id, nprobe=nprobe, search_threads=search_threads,
                   ef_search=ef_search, use_gpu=use_gpu, fusion=fusion, complete_last_word=complete_last_word)

    @classmethod
    def from_settings(cls, cs: CatalogSettings, *, expected_model_id: str | None,
                      index_root: Path | None = None) -> Self:
        return cls.open(index_root or cs.index_root, expected_model_id=expected_model_id,
                        search_threads=cs.search_threads, nprobe=cs.ivf_nprobe or None,
                        ef_search=cs.hnsw_ef_search, use_gpu=cs.use_gpu, complete_last_word=cs.complete_last_word)

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

    def _newer_snapshot(self) -> Snapshot | None:
        path = store.newest_version(self.index_root, model_id=self._expected)
        if path is None or path.name <= self._snap.path.name:
            return None
        try:
            snap = load_version(path, nprobe=self._nprobe, ef_search=self._ef, use_gpu=self._use_gpu,
                                completion=self.complete_last_word)
            check_model(snap, self._expected)
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

    # Filters: `filters` (a field of the version's filter fields -> value, case-insensitive), with
    # `department` / `aisle` as shorthands; a field or value the version lacks is InvalidInput.
    def search(self, queries: npt.NDArray[np.floating], k: int = 10, *, department: str | None = None,
               aisle: str | None = None, filters: Mapping[str, str] | None = None) -> list[list[Hit]]:
        """Semantic search: the nearest products to each query vector."""
        snap = self._snap  # every step below uses this one version, even if a swap happens now
        key = snap.check_filters(merged(filters, department=department, aisle=aisle))
        return _hits(snap, self._semantic(snap, _vectors(snap, queries), k, key))

    def query(self, texts: Sequence[str], queries: npt.NDArray[np.floating] | None, k: int = 10, *,
              mode: SearchMode = SearchMode.SEMANTIC, department: str | None = None,
              aisle: str | None = None, filters: Mapping[str, str] | None = None) -> tuple[list[list[Hit]], Ranking]:
        """Search by `mode` (queries: the texts' embeddings; None for LEXICAL), on one version."""
        snap = self._snap
        key = snap.check_filters(merged(filters, department=department, aisle=aisle))
        ranking = self._rank(snap, texts, queries, k, mode, key)
        return _hits(snap, ranking.lists, ranking.attributes), ranking

    def rank(self, texts: Sequence[str], queries: npt.NDArray[np.floating] | None, k: int = 10, *,
             mode: SearchMode = SearchMode.SEMANTIC, department: str | None = None, aisle: str | None = None,
             fusion: Fusion | None = None) -> Ranking:
        """As `query`, rows instead of hits (quality evaluation); `fusion` overrides the configured one."""
        snap = self._snap
        key = snap.check_filters(merged(department=department, aisle=aisle))
        return self._rank(snap, texts, queries, k, mode, key, fusion)

    @property
    def filter_fields(self) -> tuple[str, ...]:
        return self._snap.filter_fields

    def _rank(self, snap: Snapshot, texts: Sequence[str], queries: npt.NDArray[np.floating] | None, k: int,
              mode: SearchMode, filters: Filters, fusion: Fusion | None = None) -> Ranking:
        if snap.lexical is None and mode == SearchMode.LEXICAL:
            raise FailedPrecondition(f"index version {snap.path.name} has no lexical index (built before lexical "
                                     "search existed): rebuild it with `embedcar catalog build`")
        if k < 1:
            raise InvalidInput(f"k must be at least 1, got {k}")
        semantic = mode != SearchMode.LEXICAL
        lexical = mode != SearchMode.SEMANTIC and snap.lexical is not None  # an older version: semantic only
        # Fusing needs more than k from each leg: a product ranked 15th by both should beat one 9th by one.
        depth = max(k, (fusion or self.fusion).depth) if semantic and lexical else k
        out = Ranking([])
        sem: list[Ranked] = []
        if semantic:
            if queries is None:
                raise InvalidInput(f"{mode.value} search needs the query embeddings")
            q = _vectors(snap, queries)
            if q.shape[0] != len(texts):
                raise InvalidInput(f"{len(texts)} texts but {q.shape[0]} query vectors")
            t0 = time.perf_counter_ns()
            sem = self._semantic(snap, q, depth, filters)
            out.semantic_ns = time.perf_counter_ns() - t0
        lex: list[LexicalHits] = []
        if lexical:
            assert snap.lexical is not None
            t0 = time.perf_counter_ns()
            lex = [snap.lexical.search(t, depth, filters=filters) for t in texts]
            out.lexical_ns = time.perf_counter_ns() - t0
        if snap.lexical is not None:
            from catalog.lexical import Terms  # tantivy: loaded with the version's lexical index

            out.attributes = ([x.attributes for x in lex] if lexical else
                              [snap.lexical.typed(Terms.of(t)).attributes for t in texts])
        if semantic and lexical:
            assert snap.lexical is not None
            out.lists = [fuse(fusion or self.fusion_for(x), s, x, k, snap.lexical.carrying(x.attributes))
                         for s, x in zip(sem, lex, strict=True)]
        elif lexical:
            out.lists = [Ranked.single(LEXICAL_LEG, x.rows, x.scores) for x in lex]
        else:
            out.lists = sem
        return out

    def fusion_for(self, hits: LexicalHits) -> Fusion:
        """The fusion for a query's shape: fitted on the team's judgements, else the default."""
        if self.fitted is None:
            return self.fusion
        return self.fitted.for_shape(query_shape(hits.terms, len(hits.attributes)))

    def legs(self, texts: Sequence[str], queries: npt.NDArray[np.floating]) -> list[Legs]:
        """Both legs' candidates per query at the fusion's depth, to fuse again under other weights
        (catalog/fusion_fit.py); the version must have a lexical index."""
        snap = self._snap
        if snap.lexical is None:
            raise FailedPrecondition(f"index version {snap.path.name} has no lexical index")
        depth = self.fusion.depth
        sem = self._semantic(snap, _vectors(snap, queries), depth, ())
        lex = [snap.lexical.search(t, depth) for t in texts]
        return [Legs(s, x, snap.lexical.carrying(x.attributes)) for s, x in zip(sem, lex, strict=True)]

    def _semantic(self, snap: Snapshot, q: F32, k: int, filters: Filters) -> list[Ranked]:
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
            if filters:
                scores, rows = self._search_filtered(snap, q, k, filters)
            else:
                scores, rows = snap.index.search(q, k)
        except InvalidInput:
            raise
        except Exception as exc:  # FAISS raises RuntimeError for its own failures
            raise Internal(f"FAISS search failed: {exc}") from exc
        # FAISS pads with -1 when fewer than k results exist.
        return [Ranked.single(SEMANTIC_LEG, r[r >= 0], s[r >= 0])
                for s, r in zip(np.asarray(scores), np.asarray(rows), strict=True)]

    def _search_filtered(self, snap: Snapshot, q: F32, k: int, filters: Filters) -> tuple[Any, Any]:
        faiss = faiss_module()

        rows, selector = snap.filter_rows(filters)
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
            params = faiss.SearchParametersIVF(sel=selector, nprobe=int(ivf_of(snap.index).nprobe))
            if kind == "ivfpq":  # the selector filters PQ's candidates; the re-rank keeps its k_factor
                params = faiss.IndexRefineSearchParameters(k_factor=float(snap.index.k_factor),
                                                           base_index_params=params)
        else:
            params = faiss.SearchParametersHNSW(sel=selector, efSearch=int(snap.index.hnsw.efSearch))
        found = snap.index.search(q, k, params=params)
        return found



def _vectors(snap: Snapshot, queries: npt.NDArray[np.floating]) -> F32:
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2 or q.shape[1] != snap.vectors.shape[1]:
        raise InvalidInput(f"queries must be [n, {snap.vectors.shape[1]}], got {list(q.shape)}")
    if not np.isfinite(q).all():
        raise InvalidInput("queries contain NaN or infinite values")
    return q


def _hits(snap: Snapshot, lists: list[Ranked], attributes: Sequence[tuple[str, ...]] = ()) -> list[list[Hit]]:
    import pyarrow as pa

    flat = [r for ranked in lists for r in ranked.rows]
    records = snap.table.take(pa.array(flat, type=pa.int64())).to_pylist() if flat else []
    it = iter(records)
    out: list[list[Hit]] = []
    for i, ranked in enumerate(lists):
        typed = attributes[i] if i < len(attributes) else ()
        hits = []
        for row, s, legs in zip(ranked.rows, ranked.scores, ranked.legs, strict=True):
            rec = next(it)
            pid = _text(rec.pop("id"))
            matched = tuple(a for a in typed if snap.lexical is not None and row in snap.lexical.carriers(a))
            hits.append(Hit(pid, s, {kk: _text(v) for kk, v in rec.items() if v is not None and v != ""}, legs,
                            matched))
        out.append(hits)
    return out


def _text(value: object) -> str:
    """A stored value as a reply's text field: JSON's spelling for booleans, lists and objects."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)

