"""The batch job's Ray engine (`catalog build --engine ray`): the local engine's chunks, embedded by a
Ray Data actor pool, each actor holding its own backend from the shared factory.

    plan        driver   catalog/embedding.py plan_chunks: tokenize, sort by length, fixed chunks
    resume      driver   catalog/checkpoints.py: chunks already on disk are not sent again
    embed       actors   map_batches over one row per chunk; each actor runs embedding.embed_chunk
                         (plan_calls, bucket padding) on make_backend(settings, kind)
    checkpoint  driver   each chunk as it comes back, into the local engine's very files

A row is a whole chunk, not a text, so an actor forms exactly the padded batches the local engine
forms: the vectors are bit-equal, and a build resumes from either engine's checkpoints. This is the
one module that imports ray (lazily), so the local engine and the sidecar never load it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog.checkpoints import Checkpoints
from catalog.embedding import ChunkPlan, embed_chunk, keep_chunk, plan_chunks, progress_bar, resume_into
from catalog.settings import Settings
from inference.backends.base import Backend
from inference.backends.factory import make_backend
from inference.embedder import load_tokenizer
from inference.errors import EmbedcarError, FailedPrecondition, Internal, InvalidInput, Unavailable
from inference.manifest import load_manifest
from inference.tokenizer import QueryTokenizer

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
Batch = dict[str, npt.NDArray[Any]]


@contextlib.contextmanager
def ray_session(address: str) -> Iterator[None]:
    """Ray for one build: the cluster at `address`, or (empty) a local Ray sized to this machine,
    shut down afterwards. A session the caller already started (a test, a notebook) is used as is."""
    import ray

    if ray.is_initialized():
        yield
        return
    if address:
        check_reachable(address)
    try:
        if address:
            ray.init(address=address)
        else:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    except (ConnectionError, TimeoutError, RuntimeError) as exc:
        raise Unavailable(f"cannot start or reach Ray{f' at {address}' if address else ''}: {exc}") from exc
    try:
        yield
    finally:
        ray.shutdown()


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a `host:port` nobody listens on: ray.init waits minutes for a missing GCS."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # "auto", ray:// client addresses: Ray resolves those itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise Unavailable(f"no Ray cluster answers at {address}: {exc}") from exc


class ChunkActor:
    """A Ray Data actor: one backend, built once from the job's settings; one chunk per call."""

    def __init__(self, settings: Settings, kind: str, max_batch: int, model_id: str, batch_size: int,
                 in_flight: int) -> None:
        m = settings.model
        self._loop = asyncio.new_event_loop()  # the backends are async; an actor call is not
        self._backend: Backend = make_backend(settings, kind, max_batch=max_batch, batch_job=True)
        if self._backend.version_id != model_id:
            raise FailedPrecondition(f"a Ray actor's model is {self._backend.version_id}, the build's {model_id}: "
                                     "give every node the same prepared model")
        self._loop.run_until_complete(self._backend.start())
        self._tokenizer = load_tokenizer(m.model_dir, load_manifest(m.model_dir),
                                         max_text_chars=m.truncate_text_chars, role="document")
        self._batch_size = batch_size
        self._in_flight = in_flight

    def __call__(self, batch: Batch) -> Batch:
        k = int(batch["chunk"][0])
        flat = np.asarray(batch["ids"][0], dtype=np.int64)
        cuts = np.cumsum(np.asarray(batch["lengths"][0], dtype=np.int64))[:-1]
        ids = [seq.tolist() for seq in np.split(flat, cuts)]
        emb = self._loop.run_until_complete(embed_chunk(self._tokenizer, self._backend, ids,
                                                        batch_size=self._batch_size, in_flight=self._in_flight))
        # One output row per text (a fixed [dim] vector), tagged with its chunk and place in it.
        return {"chunk": np.full(len(ids), k, dtype=np.int64), "row": np.arange(len(ids), dtype=np.int64),
                "emb": emb}


class RayEmbedder:
    """ChunkedEmbedder's contract (`run`, resumed_chunks, embedded_items, embed_seconds) over Ray."""

    def __init__(self, settings: Settings, tokenizer: QueryTokenizer, backend: Backend, *, backend_kind: str,
                 progress: bool = True, on_chunk: Callable[[int], None] | None = None) -> None:
        cs = settings.catalog
        if cs.batch_size < 1 or cs.in_flight < 1 or cs.chunk_items < 1 or cs.ray_actors < 0:
            raise InvalidInput("batch_size, in_flight and chunk_items must be positive, ray_actors not negative")
        # Actors may run elsewhere: ship an absolute model path, not one relative to this process.
        self.settings = settings.with_section("model", models_dir=settings.model.models_dir.resolve())
        self.tokenizer = tokenizer
        self.backend_kind = backend_kind
        # The driver's (unstarted) backend says what the actors' will be: the local engine's numbers.
        self.model_id = backend.version_id
        m = self.settings.model
        configured = load_manifest(m.model_dir).variant_id(m.variant)
        if configured != self.model_id:  # the actors build theirs from settings, not from `backend`
            raise FailedPrecondition(f"the Ray engine's actors would embed with {configured}, the build's backend "
                                     f"is {self.model_id}: pass no backend, or one made from these settings")
        self.dim = backend.dim
        self.max_batch = backend.max_batch
        self.batch_size = min(cs.batch_size, backend.max_batch)
        self.in_process = backend.runs_inline  # an in-process model needs its threads' CPUs reserved
        self.progress = progress
        self.on_chunk = on_chunk
        self.resumed_chunks = 0
        self.embedded_items = 0
        self.embed_seconds = 0.0

    async def run(self, texts: Sequence[str], checkpoints: Checkpoints) -> F32:
        # Blocks the event loop while Ray works: the build has nothing else on it.
        plan = plan_chunks(self.tokenizer, texts, self.settings.catalog.chunk_items)
        out, done = resume_into(plan, checkpoints, self.dim)
        self.resumed_chunks = len(done)
        todo = [k for k in range(len(plan.chunks)) if k not in done]
        if not todo:
            return out
        bar = progress_bar(plan, done, enabled=self.progress, desc="embedding (ray)")
        t0 = time.perf_counter()
        try:
            with ray_session(self.settings.catalog.ray_address), \
                    contextlib.closing(self._embedded(plan, todo)) as chunks:
                for k, emb in chunks:
                    items = keep_chunk(plan, k, emb, out, done, checkpoints)
                    self.embedded_items += items
                    bar.update(items)
                    if self.on_chunk is not None:
                        self.on_chunk(k)
        finally:
            bar.close()
            self.embed_seconds = time.perf_counter() - t0
        return out

    def _embedded(self, plan: ChunkPlan, todo: list[int]) -> Generator[tuple[int, F32], None, None]:
        """(chunk, vectors) for each chunk in `todo`, in the order the actors finish them."""
        import ray
        from ray.data import ActorPoolStrategy, DataContext

        DataContext.get_current().enable_progress_bars = False  # the job's own bar counts items
        rows = []
        for k in todo:
            ids = plan.chunk_ids(k)
            rows.append({"chunk": k, "ids": np.fromiter((t for seq in ids for t in seq), dtype=np.int64),
                         "lengths": np.asarray([len(seq) for seq in ids], dtype=np.int64)})
        cpus = self._actor_cpus()
        actors = self.settings.catalog.ray_actors or max(1, int(_cluster_cpus() // cpus))
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            ChunkActor, batch_size=1, batch_format="numpy", num_cpus=cpus,
            compute=ActorPoolStrategy(size=min(actors, len(rows))),
            fn_constructor_kwargs={"settings": self.settings, "kind": self.backend_kind, "max_batch": self.max_batch,
                                   "model_id": self.model_id, "batch_size": self.batch_size,
                                   "in_flight": self.settings.catalog.in_flight})
        log.info("ray engine: %d chunks over %d actors of %g CPUs", len(rows), min(actors, len(rows)), cpus)
        pending: dict[int, F32] = {}  # chunks partly back
        filled: dict[int, int] = {}
        missing = set(todo)
        batches = iter(ds.iter_batches(batch_size=None, batch_format="numpy"))  # held, so it can be closed
        try:
            # Ray Data may split or merge the actors' output blocks: reassemble chunks by (chunk, row).
            for batch in batches:
                chunk, row, emb = batch["chunk"], batch["row"], batch["emb"]
                for k in np.unique(chunk).tolist():
                    mine = chunk == k
                    part = pending.setdefault(k, np.empty((len(plan.chunks[k]), self.dim), dtype=np.float32))
                    part[row[mine]] = emb[mine]
                    filled[k] = filled.get(k, 0) + int(mine.sum())
                    if filled[k] == len(part):
                        missing.discard(k)
                        yield k, pending.pop(k)
        except Exception as exc:
            raise _project_error(exc) from exc
        finally:
            # A caller that stops early (a failed checkpoint write) stops the actors too, at once,
            # not whenever the iterator is collected: they hold the CPUs the next build needs.
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        if missing:
            raise Internal(f"the Ray engine returned no or partial vectors for chunks {sorted(missing)}")

    def _actor_cpus(self) -> float:
        if not self.in_process:
            return 1.0  # a client of a remote server: its CPU work is the tokens' padding
        threads = self.settings.model.intra_op_threads
        smallest = _smallest_node_cpus()
        # ORT with threads=0 uses every core of its node; more than a node holds would never schedule.
        return float(min(threads, smallest) if threads > 0 else smallest)


def _cluster_cpus() -> float:
    import ray

    return float(ray.cluster_resources().get("CPU", 0.0))


def _smallest_node_cpus() -> float:
    import ray

    cpus = [float(n["Resources"].get("CPU", 0.0)) for n in ray.nodes() if n.get("Alive")]
    cpus = [c for c in cpus if c > 0]
    if not cpus:
        raise Unavailable("the Ray cluster has no node with CPUs")
    return min(cpus)


def _project_error(exc: BaseException) -> EmbedcarError:
    """The project error a Ray failure carries (an actor's FailedPrecondition, say), else Internal."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):  # RayTaskError (and its subclasses mimicking the cause)
            e = cause
            continue
        if isinstance(e, EmbedcarError):
            return e
        e = e.__cause__
    return Internal(f"the Ray engine failed: {type(exc).__name__}: {exc}")
