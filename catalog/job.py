"""The catalog batch job: products -> embeddings (same tokenizer, buckets, pooling and backend as
queries) -> a versioned FAISS index, published atomically. `build` reads as the stage list:

    read                  catalog/sources.py      products + bad rows (grocery, JSONL, CSV, Parquet)
    shard                 catalog/shards.py       this worker's share of `--shard i/n`
    compose text          catalog/sources.py      the chosen fields joined into one text
    tokenize, bucket/split, embed
                          catalog/embedding.py    throughput mode over inference.buckets.plan_calls
                          catalog/ray_engine.py   or the same chunks on a Ray Data actor pool (engine=ray)
    checkpoint            catalog/checkpoints.py  one file per chunk, resumable (catalog/lock.py: one worker)
    calibrate             catalog/calibration.py  query-like texts to tune an approximate index
    check, build index, publish
                          catalog/publish.py      publish checks (bad rows, item count vs the current version),
                                                  FAISS (catalog/index_build.py) -> version folder (catalog/store.py),
                                                  or a held one when the checks fail (not made current)
                          catalog/shards.py       or, with n > 1, this worker's share for `merge`
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from catalog import store
from catalog.calibration import calibration_queries
from catalog.checkpoints import WORK_DIR, Checkpoints
from catalog.embedding import ChunkedEmbedder
from catalog.filters import filter_fields, product_columns
from catalog.index_build import resolve_type
from catalog.lock import exclusive
from catalog.publish import PublishChecks, check_build, check_limits, check_same_catalog, publish_index
from catalog.settings import ENGINES, Settings
from catalog.shards import gather_shards, group_dir, publish_shard, select_shard
from catalog.sources import BadRow, Loaded, Product, compose_text, read_path
from catalog.spec import BuildSpec, content_hash, fingerprint
from inference.aio import run_sync
from inference.backends.base import Backend
from inference.backends.factory import make_backend
from inference.embedder import load_tokenizer
from inference.errors import FailedPrecondition, InvalidInput
from inference.manifest import load_manifest
from inference.tokenizer import QueryTokenizer

if TYPE_CHECKING:
    from catalog.ray_engine import RayEmbedder

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
MAX_BAD_IN_MANIFEST = 100


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
    checks: PublishChecks | None = None  # None for a shard (the merge checks the whole)

    def describe(self) -> str:
        where = self.version_dir or self.shard_dir
        resumed = f", resumed {self.resumed_chunks} chunks" if self.resumed_chunks else ""
        forced = ""
        if self.checks is not None and not self.checks.passed:
            forced = f" (published with --force despite: {'; '.join(self.checks.failures)})"
        return (f"{self.items} items embedded, {self.skipped} bad rows skipped, {self.seconds:.1f} s "
                f"({self.items_per_s:.0f} items/s embedding{resumed}) -> {where}{forced}")


def job_backend(settings: Settings, kind: str = "embedded") -> Backend:
    """The batch job's backend: the shared factory, with batches as large as the job sends."""
    return make_backend(settings, kind, max_batch=max(settings.catalog.batch_size, settings.model.max_texts_per_call),
                        batch_job=True)


async def build(settings: Settings, spec: BuildSpec, *, backend: Backend | None = None,
                backend_kind: str = "embedded", loaded: Loaded | None = None, progress: bool = True,
                on_chunk: Callable[[int], None] | None = None, force: bool = False,
                say: Callable[[str], None] | None = None) -> BuildSummary:
    """Embed `spec.source` and publish a new index version (or, with a shard n > 1, a shard).

    A version that fails its publish checks is written aside, not made current, and FailedPrecondition
    says why, unless `force`. `backend` is used as given (and left open); None = one of `backend_kind`,
    closed at the end. `on_chunk(k)` runs after chunk k is checkpointed (tests inject crashes there).
    `say`: a status line per phase after embedding (the CLI prints them: a big index takes seconds)."""
    t0 = time.perf_counter()
    started = _now()
    cs = settings.catalog
    check_limits(cs)
    loaded = loaded or _read(spec)
    if loaded.bad:
        log.warning("%s", loaded.summary())
    fields = filter_fields(cs.filter_fields, product_columns(loaded.products), loaded.source)
    check_same_catalog(settings, [p.id for p in loaded.products])
    i, n = spec.shard
    sel = select_shard(loaded.products, i, n)
    if not sel.products:
        raise InvalidInput(f"nothing to index: {loaded.summary()}")
    texts = [compose_text(p.fields, spec.text_fields) for p in sel.products]
    tokenizer = _tokenizer(settings)
    if cs.engine not in ENGINES:
        raise InvalidInput(f"unknown engine {cs.engine!r}: expected one of {', '.join(ENGINES)}")
    own = backend is None
    be = backend or job_backend(settings, backend_kind)
    try:
        model_id = be.version_id
        # The fingerprint names no engine: either engine resumes the other's checkpoints.
        checkpoints = Checkpoints(cs.index_root, fingerprint(
            model_id, spec.text_fields, content_hash(sel.products, texts), cs.chunk_items, cs.batch_size, f"{i}/{n}"))
        emb: ChunkedEmbedder | RayEmbedder
        if cs.engine == "ray":
            from catalog.ray_engine import RayEmbedder

            # Ray's actors build their own backends; this one starts only if calibration needs it.
            emb = RayEmbedder(settings, tokenizer, be, backend_kind=backend_kind, progress=progress,
                              on_chunk=on_chunk)
        else:
            emb = ChunkedEmbedder(tokenizer, await _started(be), batch_size=cs.batch_size, in_flight=cs.in_flight,
                                  chunk_items=cs.chunk_items, progress=progress, on_chunk=on_chunk)
        with exclusive(checkpoints.lock_path):  # two workers on one folder would overwrite each other's chunks
            vectors = await emb.run(texts, checkpoints)
        calibration = None
        if n == 1 and _approximate(settings, spec, len(texts)):
            if say is not None:
                say("embedding calibration queries for the approximate index")
            calibration = await calibration_queries(texts, _tokenizer(settings, "query"), await _started(be),
                                                    cs.batch_size)
    finally:
        if own:
            await be.close()
    meta = _meta(settings, spec, loaded, model_id, started, emb.embed_seconds, emb.embedded_items, fields)
    summary = BuildSummary(items=len(sel.products), skipped=len(loaded.bad), bad_rows=loaded.bad,
                           seconds=0.0, embed_seconds=emb.embed_seconds,
                           items_per_s=emb.embedded_items / max(emb.embed_seconds, 1e-9), model_id=model_id,
                           resumed_chunks=emb.resumed_chunks)
    if n == 1:
        summary.checks = check_build(settings, items=len(sel.products), bad=loaded.bad, model_id=model_id,
                                     force=force)
        summary.version_dir, summary.index = publish_index(settings, vectors, sel.products, meta,
                                                           index_type=spec.index_type, calibration=calibration,
                                                           checks=summary.checks, say=say)
        if not summary.checks.servable:  # the checkpoints stay, so the --force run resumes, not re-embeds
            raise FailedPrecondition(summary.checks.refusal(summary.version_dir, "rerun the build with --force "
                                                            "(it resumes from this run's embeddings)"))
    else:
        summary.shard_dir = publish_shard(group_dir(settings, spec, loaded, model_id), spec.shard, vectors, sel,
                                          meta)
    checkpoints.discard()
    summary.seconds = time.perf_counter() - t0
    return summary


def merge(settings: Settings, spec: BuildSpec, *, loaded: Loaded | None = None,
          model_id: str | None = None, force: bool = False, say: Callable[[str], None] | None = None) -> BuildSummary:
    """Concatenate the n shards of `spec.source` (in source order) and publish one index version,
    checked as `build` checks one (held and FailedPrecondition on failure, unless `force`)."""
    t0 = time.perf_counter()
    started = _now()
    check_limits(settings.catalog)
    loaded = loaded or _read(spec)
    fields = filter_fields(settings.catalog.filter_fields, product_columns(loaded.products), loaded.source)
    check_same_catalog(settings, [p.id for p in loaded.products])
    if model_id is None:
        model_id = _configured_model_id(settings)
    group = group_dir(settings, spec, loaded, model_id)
    shards = gather_shards(group, spec.shard[1], model_id)
    meta = _meta(settings, spec, loaded, model_id, started, shards.embed_seconds, len(shards.products), fields)
    calibration = None
    if _approximate(settings, spec, len(shards.products)):
        calibration = run_sync(_merge_calibration(settings, shards.products, spec.text_fields, model_id))
    checks = check_build(settings, items=len(shards.products), bad=loaded.bad, model_id=model_id, force=force)
    version, params = publish_index(settings, shards.vectors, shards.products, meta, index_type=spec.index_type,
                                    calibration=calibration, checks=checks, say=say)
    if not checks.servable:  # the shards stay, so the --force merge needs no shard rebuilt
        raise FailedPrecondition(checks.refusal(version, "rerun the merge with --force"))
    shutil.rmtree(group, ignore_errors=True)
    return BuildSummary(items=len(shards.products), skipped=len(loaded.bad), bad_rows=loaded.bad,
                        seconds=time.perf_counter() - t0, embed_seconds=shards.embed_seconds,
                        items_per_s=len(shards.products) / max(shards.embed_seconds, 1e-9), model_id=model_id,
                        version_dir=version, index=params, checks=checks)


def ensure_index(settings: Settings, spec: BuildSpec, *, backend: Backend | None = None,
                 progress: bool = True) -> Path:
    """The newest complete version of the current model under settings.catalog.index_root, or,
    when there is none, `spec` built now (minutes on CPU for a full catalog)."""
    model_id = backend.version_id if backend is not None else _configured_model_id(settings)
    root = settings.catalog.index_root
    existing = store.newest_version(root, model_id=model_id)
    if existing is not None:
        return existing
    # Two processes (demo + load test) may both find none: the second waits for the first's build.
    with exclusive(root / WORK_DIR / "ensure.lock", wait=True):
        existing = store.newest_version(root, model_id=model_id)
        if existing is not None:
            return existing
        summary = run_sync(build(settings, spec, backend=backend, progress=progress))
    log.info("%s", summary.describe())
    assert summary.version_dir is not None
    return summary.version_dir


async def _started(backend: Backend) -> Backend:
    if not backend.ready():
        await backend.start()
    return backend


def _read(spec: BuildSpec) -> Loaded:
    return read_path(spec.source, id_field=spec.id_field, text_fields=spec.text_fields, limit=spec.limit,
                     delimiter=spec.delimiter)


def _tokenizer(settings: Settings, role: str = "document") -> QueryTokenizer:
    """Products are documents, calibration fragments queries: each gets the model's prompt for it."""
    model_dir = settings.model.model_dir
    return load_tokenizer(model_dir, load_manifest(model_dir), max_text_chars=settings.model.truncate_text_chars,
                          role=role)


def _configured_model_id(settings: Settings) -> str:
    return load_manifest(settings.model.model_dir).variant_id(settings.model.variant)


def _approximate(settings: Settings, spec: BuildSpec, n: int) -> bool:
    """Whether the index will be approximate, so tuning it needs calibration queries."""
    return resolve_type(spec.index_type or settings.catalog.index_type, n) != "flat"


async def _merge_calibration(settings: Settings, products: list[Product], text_fields: tuple[str, ...],
                             model_id: str) -> F32 | None:
    backend = job_backend(settings)
    if backend.version_id != model_id:  # shards came from another variant: fall back to synthetic
        return None
    try:
        await backend.start()
        return await calibration_queries([compose_text(p.fields, text_fields) for p in products],
                                         _tokenizer(settings, "query"), backend, settings.catalog.batch_size)
    finally:
        await backend.close()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _meta(settings: Settings, spec: BuildSpec, loaded: Loaded, model_id: str, started: str,
          embed_seconds: float, embedded_items: int, fields: tuple[str, ...]) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "text_fields": list(spec.text_fields),
        "filter_fields": list(fields),
        "source": loaded.source,
        "id_type": loaded.id_type,
        "build": {
            "started": started,
            "finished": _now(),
            "embed_seconds": round(embed_seconds, 3),
            "items_per_s": round(embedded_items / max(embed_seconds, 1e-9), 1),
            "batch_size": settings.catalog.batch_size,
            "in_flight": settings.catalog.in_flight,
            "shards": spec.shard[1],
        },
        "skipped": len(loaded.bad),
        "bad_rows": [{"line": b.line, "reason": b.reason} for b in loaded.bad[:MAX_BAD_IN_MANIFEST]],
    }
