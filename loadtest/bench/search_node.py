"""A stand-in for the search node on the sidecar's host (`bench neighbour`'s neighbour): one core's
worth of search-engine work.

The sidecar runs next to a search engine, and every core it burns is one the engine does not get.
`Neighbour` runs, in its own process and on one thread, what such an engine does per query: a
tantivy BM25 + prefix query over the grocery catalog's titles and an exact FAISS inner-product
search over 50k catalog vectors (faiss on one OpenMP thread, as the sidecar's Search runs it).
It counts its queries in shared memory, so a bench reads its queries/s over any window, alone or
beside a sidecar under load; `pause()` parks it (no CPU) between windows.

The data (`prepare_data`) is built once into a folder and reused: the lexical index of every
grocery title (catalog.lexical, seconds), the embeddings of the first `embedded` titles by the
model, and noisy copies of those up to `items` vectors (catalog vectors beyond the embedded ones
are synthetic, as in `bench catalog search`: a flat search costs the same on any values).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.errors import Unavailable

VECTORS = "vectors.npy"
QUERIES = "queries.json"
LEXICAL_ENTRY = "lexical.json"
META = "meta.json"  # what the data was built from: a folder built otherwise is rebuilt
_QUERY_VECTORS = 512


@dataclass(frozen=True, slots=True)
class NeighbourData:
    folder: Path
    items: int

    def built_from(self, meta: dict[str, Any]) -> bool:
        if not all((self.folder / f).exists() for f in (VECTORS, QUERIES, LEXICAL_ENTRY, META)):
            return False
        return bool(json.loads((self.folder / META).read_text()) == meta)


def prepare_data(folder: Path, model_dir: Path, variant: str, *, items: int = 50_000, embedded: int = 1024,
                 queries: int = 2000, seed: int = 0) -> NeighbourData:
    """The neighbour's indexes in `folder` (built once; a folder with all three files is reused)."""
    data = NeighbourData(folder, items)
    meta = {"items": items, "embedded": embedded, "queries": queries, "seed": seed, "variant": variant,
            "model": str(model_dir.resolve())}
    if data.built_from(meta):
        return data
    from catalog.lexical import build_lexical
    from catalog.sources import compose_text, read_grocery
    from inference.backends.onnx import OnnxBackend
    from inference.buckets import plan_calls
    from inference.embedder import load_tokenizer
    from inference.files import atomic_write_text
    from inference.manifest import load_manifest
    from loadtest.bench.catalog import scale_vectors

    folder.mkdir(parents=True, exist_ok=True)
    products = read_grocery().products
    texts = [compose_text(p.fields, ("title",)) for p in products]
    lexical = folder / "lexical"
    if lexical.exists():
        import shutil

        shutil.rmtree(lexical)
    entry = build_lexical(lexical, texts, products)
    manifest = load_manifest(model_dir)
    tokenizer = load_tokenizer(model_dir, manifest)
    backend = OnnxBackend(model_dir, manifest, variant=variant)
    sample = texts[:embedded]
    enc = tokenizer.encode(sample)
    base = np.empty((len(sample), manifest.dim), dtype=np.float32)
    for bucket, idx in plan_calls(enc.lengths, tokenizer.buckets, 64):
        base[idx] = backend.embed_sync(tokenizer.batch([enc.ids[i] for i in idx], length=bucket))
    np.save(folder / VECTORS, scale_vectors(base, items, seed=seed))
    # Shopper-like typed queries: a title's first words, the last one cut mid-word.
    rng = np.random.default_rng(seed)
    typed = []
    for t in rng.choice(texts, size=queries):
        words = t.split()[: int(rng.integers(1, 5))]
        words[-1] = words[-1][: max(1, int(rng.integers(1, len(words[-1]) + 1)))]
        typed.append(" ".join(words))
    atomic_write_text(folder / QUERIES, json.dumps(typed))
    atomic_write_text(folder / LEXICAL_ENTRY, json.dumps(entry))
    atomic_write_text(folder / META, json.dumps(meta))
    return data


def _serve(folder: str, count: Any, go: Any, stop: Any, ready: Any) -> None:
    """The neighbour's loop (in its own process): one lexical + one semantic query at a time."""
    import faiss

    from catalog.lexical import LexicalIndex

    faiss.omp_set_num_threads(1)
    root = Path(folder)
    x = np.load(root / VECTORS)
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    lexical = LexicalIndex.open(root, json.loads((root / LEXICAL_ENTRY).read_text()))
    texts = json.loads((root / QUERIES).read_text())
    rng = np.random.default_rng(1)
    q = x[rng.integers(0, x.shape[0], _QUERY_VECTORS)]
    q = q + rng.normal(0, 0.05, q.shape).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    ready.set()
    i = 0
    while not stop.is_set():
        if not go.wait(0.2):
            continue
        lexical.search(texts[i % len(texts)], 10)
        index.search(q[i % _QUERY_VECTORS: i % _QUERY_VECTORS + 1], 10)
        count.value += 1  # one writer: no lock needed for the reader's purpose
        i += 1


class Neighbour:
    """The neighbour process: `start()`, then `resume()`/`pause()` around windows, `queries()` counts."""

    def __init__(self, data: NeighbourData, *, startup_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")  # a clean interpreter: no threads or ORT state of the bench's
        self._count = ctx.Value("q", 0, lock=False)
        self._go, self._stop, self._ready = ctx.Event(), ctx.Event(), ctx.Event()
        self._proc = ctx.Process(target=_serve, args=(str(data.folder), self._count, self._go, self._stop,
                                                      self._ready), name="neighbour", daemon=True)
        self.startup_timeout_s = startup_timeout_s

    @property
    def pid(self) -> int:
        if self._proc.pid is None:
            raise Unavailable("the neighbour process is not running")
        return self._proc.pid

    def start(self) -> Neighbour:
        self._proc.start()
        if not self._ready.wait(self.startup_timeout_s):
            self.stop()
            raise Unavailable(f"the neighbour process did not load its indexes within {self.startup_timeout_s:g} s")
        return self

    def queries(self) -> int:
        return int(self._count.value)

    def resume(self) -> None:
        self._go.set()

    def pause(self) -> None:
        self._go.clear()
        time.sleep(0.01)  # the query in flight finishes

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def __enter__(self) -> Neighbour:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
