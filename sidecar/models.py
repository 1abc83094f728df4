"""The models a sidecar serves: one `ServedModel` per model, looked up by the name a request gives.

A ServedModel is everything one model's requests go through: its backend (and the embedded fallback
for Triton), tokenizer (with the model's query prompt), cache, admission, scheduler, pipeline and
its product index. A request resolves its model once and uses that object to the end, so a Search
reply's query vector and the index it searched always come from the same model version, also while
a rollout replaces the model (sidecar/rollout.py swaps whole ServedModels, never their parts).

    models = ModelSet([build_model(settings, "a", metrics), build_model(settings, "b", metrics)])
    models.get(None)        # the first: the default
    models.get("b")         # by name, version id or variant id; UnknownModel lists the served ones
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inference.backends.base import Backend
from inference.backends.factory import make_backend
from inference.embedder import load_tokenizer
from inference.errors import FailedPrecondition, UnknownModel
from inference.manifest import Manifest, load_manifest
from inference.tokenizer import QueryTokenizer, TokenBatch
from sidecar.admission import Admission
from sidecar.batcher import MicroBatcher
from sidecar.cache import EmbeddingCache
from sidecar.metrics import Metrics, ModelMetrics
from sidecar.pipeline import EmbedPipeline
from sidecar.scheduler import BackendHealth, DirectScheduler, FallbackScheduler, Scheduler
from sidecar.search_index import IndexHolder
from sidecar.settings import Settings

if TYPE_CHECKING:
    from catalog.index import ProductIndex

FALLBACK = "embedded-fallback"  # how replies and metrics name the fallback when it answered
# Admission: batches that may wait behind the running one (with sidecar.max_rows_per_pass, the queue's size).
MAX_PENDING_BATCHES = 2
# Embedded micro-batcher: the longest wait to fill a batch once a queue forms (a sparse query runs at once).
BATCH_WAIT_US = 500
# A forward pass runs on the event loop itself while arrivals are sparse and nothing waits: ~0.3-0.5 ms
# less CPU per query on 2 vCPUs (docs/benchmarks.md, "the forward pass on the event loop only while sparse").
INLINE_FORWARD = True
CACHE_TTL_S = 3600.0  # a hot-query cache entry's lifetime; a new model version gets a new cache anyway


@dataclass(eq=False)
class ServedModel:
    name: str  # the model directory's name: what a request's `model` field names
    manifest: Manifest
    backend: Backend
    tokenizer: QueryTokenizer
    cache: EmbeddingCache
    admission: Admission
    health: BackendHealth
    scheduler: FallbackScheduler
    index: IndexHolder
    pipeline: EmbedPipeline
    owns_backend: bool
    max_rows_per_pass: int
    metrics: ModelMetrics  # this version's series

    @property
    def version_id(self) -> str:
        """The served variant's id (model, weights, tokenizer, head and variant): replies carry it."""
        return self.backend.version_id

    @property
    def fallback(self) -> Backend | None:
        f = self.scheduler.fallback
        return f.backend if f is not None else None

    @property
    def can_answer(self) -> bool:
        """The backend is up, or the embedded fallback stands in for it."""
        return self.health.up or self.scheduler.fallback is not None

    def probe_batch(self) -> TokenBatch:
        return self.tokenizer.batch(self.tokenizer.encode(["health probe"]).ids)

    async def start(self) -> None:
        """Backend loaded and warm, admission calibrated, fallback warm, index opened (if any)."""
        if not self.backend.ready():
            await self.backend.start()
        await self._calibrate()
        if self.fallback is not None:
            await self.fallback.start()  # loaded and warm before it is needed
        self.scheduler.start()
        await self.index.start()

    async def close(self) -> None:
        await self.scheduler.close()
        if self.fallback is not None:
            await self.fallback.close()
        await self.index.close()
        if self.owns_backend:
            await self.backend.close()
        self.metrics.retire()

    async def _calibrate(self) -> None:
        """Seed the admission cost model with two timed calls, so the first requests are judged fairly."""
        probe = self.probe_batch()
        rows = min(8, self.max_rows_per_pass, self.backend.max_batch)
        length = self.tokenizer.buckets[min(2, len(self.tokenizer.buckets) - 1)]
        large = self.tokenizer.batch(probe.input_ids[:1, :3].tolist() * rows, length=length)
        samples = []
        for batch in (probe, large):
            best = float("inf")
            for _ in range(3):  # the first call of a new shape pays for ORT's allocations
                t0 = time.perf_counter()
                await self.backend.embed(batch, timeout_s=30.0)
                best = min(best, time.perf_counter() - t0)
            samples.append((int(batch.input_ids.size), best))
        self.admission.calibrate(samples[0], samples[1])


def model_settings(settings: Settings, name: str) -> Settings:
    """`settings` with model.name set to `name` (each served model reads its own directory)."""
    return dataclasses.replace(settings, model=dataclasses.replace(settings.model, name=name))


def served_names(settings: Settings) -> tuple[str, ...]:
    """sidecar.models, or model.name alone; FailedPrecondition for a model named twice. On the Triton
    backend each model calls its own version's ensemble: the pool's repository must hold them all."""
    names = settings.sidecar.models or (settings.model.name,)
    if len(set(names)) != len(names):
        raise FailedPrecondition(f"sidecar.models names a model twice: {', '.join(names)}")
    return names


def build_model(settings: Settings, name: str, metrics: Metrics, *, backend: Backend | None = None,
                index: ProductIndex | None = None, on_index_load: Callable[[], None] | None = None) -> ServedModel:
    """Everything model `name` needs, built without I/O beyond reading its manifest and tokenizer."""
    s = settings.sidecar
    settings = model_settings(settings, name)
    model_dir = settings.model.model_dir
    manifest = load_manifest(model_dir)
    owns = backend is None
    backend = backend if backend is not None else make_backend(settings, s.backend)
    tokenizer = load_tokenizer(model_dir, manifest, max_text_chars=settings.model.truncate_text_chars)
    hosts = max(1, len(settings.triton.urls)) if backend.batches_itself else 1
    admission = Admission(max_outstanding_items=(MAX_PENDING_BATCHES + 1) * s.max_rows_per_pass * hosts,
                          budget_s=s.admission_budget_ms / 1e3, lanes=backend.lanes)
    mm = metrics.for_model(name, backend.version_id)
    health = BackendHealth(mm)

    def scheduler_for(b: Backend, label: str | None = None) -> Scheduler:
        # Triton batches itself: straight through. The embedded model does not: the micro-batcher.
        if b.batches_itself:
            return DirectScheduler(b, tokenizer, mm)
        return MicroBatcher(b, tokenizer, max_items=s.max_rows_per_pass, wait_us=BATCH_WAIT_US,
                            admission=admission, metrics=mm, label=label, inline=INLINE_FORWARD)

    fallback: Scheduler | None = None
    if backend.batches_itself and s.embedded_fallback and _model_file_present(settings, manifest):
        # While Triton is down the sidecar still holds the model: answer with it rather than fail.
        fallback = scheduler_for(make_backend(settings, "embedded"), FALLBACK)
    scheduler = FallbackScheduler(scheduler_for(backend), fallback, health)
    # sidecar.poll_s 0 stops model rollouts only: an index is always looked for.
    holder = IndexHolder(index, index_root=s.index_dir, expected_model_id=backend.version_id, poll_s=s.poll_s or 5.0,
                         catalog=settings.catalog, on_load=on_index_load)
    cache = EmbeddingCache(backend.version_id, s.cache_entries, CACHE_TTL_S, s.cache_max_bytes)
    pipeline = EmbedPipeline(
        tokenizer=tokenizer, lowercase=manifest.lowercase, cache=cache, admission=admission, scheduler=scheduler,
        metrics=mm, dim=backend.dim,
        max_batch=min(settings.model.max_texts_per_call, backend.max_batch if backend.max_batch > 0 else 256),
        max_chars=s.max_text_chars, max_items_per_call=s.max_rows_per_pass)
    return ServedModel(name, manifest, backend, tokenizer, cache, admission, health, scheduler, holder, pipeline,
                       owns, s.max_rows_per_pass, mm)


def _model_file_present(settings: Settings, manifest: Manifest) -> bool:
    m = settings.model
    try:
        return (m.model_dir / manifest.variant(m.variant).file).is_file()
    except Exception:  # an unknown variant: the backend itself reports it
        return False


class ModelSet:
    """The served models in order (the first is the default); `replace` swaps one whole model."""

    def __init__(self, models: list[ServedModel]) -> None:
        if not models:
            raise FailedPrecondition("a sidecar serves at least one model")
        self._models = {m.name: m for m in models}

    @property
    def default(self) -> ServedModel:
        return next(iter(self._models.values()))

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    def get(self, name: str | None) -> ServedModel:
        """The model `name` names: its directory name, version id or variant id; the default for none."""
        if not name:
            return self.default
        found = self._models.get(name)
        if found is not None:
            return found
        for m in self._models.values():
            if name in (m.version_id, m.manifest.version_id):
                return m
        raise UnknownModel(f"model {name[:200]!r} is not served here; served: {', '.join(self._models)}")

    def replace(self, new: ServedModel) -> ServedModel:
        """Serve `new` in place of the model of the same name; returns the one it replaced."""
        old = self._models[new.name]
        self._models[new.name] = new
        return old
