"""One loaded index version: the FAISS index, vectors, products and lexical index read from a
version folder and checked against each other, with its filters (catalog/filters.py) cached. Immutable
once published to searchers: catalog/index.py swaps a whole version by replacing one reference."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from catalog import filters as filtering
from catalog import store
from catalog.faiss_lib import faiss_module, ivf_of
from inference.errors import ModelError

if TYPE_CHECKING:
    from catalog.completion import Completer
    from catalog.lexical import LexicalIndex

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
_FILTER_CACHE = 256


@dataclass(slots=True)
class Snapshot:
    """One loaded version (`load_version`)."""

    path: Path
    manifest: dict[str, Any]
    index: Any
    vectors: F32
    table: Any  # pyarrow.Table, row i = vector i
    on_gpu: bool
    lexical: LexicalIndex | None  # None: a version built before lexical search
    completer: Completer | None = None  # the version's vocabulary, where complete_last_word is on
    filters: OrderedDict[filtering.Filters, tuple[I64, Any]] = field(default_factory=OrderedDict)
    filters_lock: threading.Lock = field(default_factory=threading.Lock)
    _values: dict[str, frozenset[str]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def filter_fields(self) -> tuple[str, ...]:
        """The columns this version filters on (older versions: department and aisle)."""
        return tuple(self.manifest.get("filter_fields", filtering.DEFAULT_FIELDS))

    def check_filters(self, requested: dict[str, str]) -> filtering.Filters:
        """A request's filters as this version's fields and values, or InvalidInput naming what it has."""
        if not requested:
            return ()
        fields = [f for f in self.filter_fields if f in self.table.column_names]
        return filtering.check(requested, fields, {f: self._field_values(f) for f in fields}, self.path.name)

    def _field_values(self, name: str) -> frozenset[str]:
        hit = self._values.get(name)
        if hit is None:  # ~ms at 50k rows, once per field and version
            hit = self._values[name] = frozenset(
                v for v in self._normalized(name).unique().to_pylist() if v)
        return hit

    def _normalized(self, name: str) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        return pc.utf8_lower(pc.utf8_trim_whitespace(self.table[name].cast(pa.string())))

    def filter_rows(self, key: filtering.Filters) -> tuple[I64, Any]:
        """Rows matching checked filters and a FAISS selector over them (cached)."""
        import pyarrow.compute as pc

        hit = self.filters.get(key)
        if hit is not None:
            return hit
        mask = np.ones(self.size, dtype=bool)
        for name, want in key:
            col = self._normalized(name)
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


def check_model(snap: Snapshot, expected: str | None) -> None:
    got = snap.manifest.get("model_id")
    if expected is not None and got != expected:
        raise other_model(snap.path, got, expected)


def other_model(path: Path, got: object, expected: str | None) -> ModelError:
    return ModelError(f"index {path.name} was built with model {got}, but the running model is "
                      f"{expected}: rebuild it with `embedcar catalog build`")


def load_version(path: Path, *, nprobe: int | None, ef_search: int | None, use_gpu: bool,
                 completion: bool = False) -> Snapshot:
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
        ivf_of(index).nprobe = nprobe or int(manifest["index"].get("nprobe", 16))
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
    return Snapshot(path, manifest, index, vectors, table, on_gpu, lexical, completer)
