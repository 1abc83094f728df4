"""The catalog job SIGKILLed at random points, one of them during publish, then resumed.

`embedcar catalog build` runs as a real child process over a fixed product file. A reference
build runs uninterrupted first; its timeline (start-up, time per checkpointed chunk, publish)
places the kills: all but one after a seeded random number of checkpointed chunks plus a random
part of a chunk's time, the last once every chunk is checkpointed (the job is then building and
writing its version) plus a random part of the reference's publish time. After each kill the job
is started again on the same input, as an operator would. The index root starts with copies of
the reference version, as if older versions were serving, so a kill during publish meets a
root that readers use and the final publish prunes.

What must hold: the resumed result equals the reference (same ids in the same order, bit-equal
vectors, same search results), and at no point (a watcher lists the root throughout, and after
every kill) does a reader see a version that is incomplete or differs from the reference.
The kill points are observed from the job's own checkpoint and version files: no test hook.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from catalog import store
from embedcar_settings import Settings
from inference.files import sha256_file
from loadtest.faults.result import ScenarioResult

NAME = "job-kill"
TITLE = "Catalog job SIGKILLed at 5 random points (one during publish), resumed: same index, no partial version"

SEED = 20261201
SEEDED_VERSIONS = 3  # = catalog.publish.KEEP_VERSIONS: the final publish prunes one
QUERIES = ("oat milk", "greek yogurt plain", "gluten free pasta", "dark chocolate bar", "green tea bags",
           "sparkling water", "frozen pizza", "peanut butter", "organic bananas", "dog food",
           "shampoo for dry hair", "whole wheat bread", "ice cream vanilla", "coffee beans", "paper towels",
           "baby wipes", "hot sauce", "cheddar cheese", "tortilla chips", "olive oil")
POLL_S = 0.002
JOB_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Plan:
    items: int
    chunk_items: int
    batch_size: int
    kills: int  # the last one during publish

    @property
    def chunks(self) -> int:
        return math.ceil(self.items / self.chunk_items)


QUICK = Plan(items=320, chunk_items=32, batch_size=32, kills=2)
FULL = Plan(items=3000, chunk_items=200, batch_size=64, kills=5)


@dataclass(slots=True)
class Timeline:
    """What a watcher saw of one job process (time.monotonic() seconds)."""

    started: float
    first_chunk: float | None = None
    all_chunks: float | None = None  # every chunk checkpointed: the publish phase begins
    temp: float | None = None  # a new temp folder appeared: the version is being written
    version: float | None = None  # a new version folder appeared
    exited: float | None = None
    code: int | None = None


@dataclass(slots=True)
class KillPoint:
    """Kill once `after_chunks` chunks are checkpointed, a random part `u` of a chunk's time later;
    a publish point instead once every chunk is checkpointed (or, when an earlier run had done
    that, once the version's temp folder appears), `u` of the reference's remaining publish time
    later."""

    after_chunks: int
    u: float
    publish: bool = False
    # filled in by the attempt
    delay_s: float = 0.0
    killed: bool = False
    chunks_at_kill: int = 0
    landed: str = ""


@dataclass(frozen=True, slots=True)
class Pace:
    """The reference run's timings, which place the kills."""

    chunk_s: float  # per checkpointed chunk
    publish_s: float  # last checkpoint -> version renamed into place
    temp_s: float  # temp folder first seen -> version renamed into place

    @classmethod
    def of(cls, tl: Timeline, n_chunks: int) -> Pace:
        chunk = 0.05
        if tl.first_chunk is not None and tl.all_chunks is not None and n_chunks > 1:
            chunk = max((tl.all_chunks - tl.first_chunk) / (n_chunks - 1), 0.005)
        end = tl.version or tl.exited or tl.started
        return cls(chunk, max(end - (tl.all_chunks or end), 0.0), max(end - (tl.temp or end), 0.0))


@dataclass(slots=True)
class Watch:
    """Lists the index root in a thread while jobs run: any version a reader could list must be
    complete and equal to the reference."""

    root: Path
    ref_sha: str
    ref_ids: list[str]
    seen: dict[str, str] = field(default_factory=dict)  # version -> "ok" or what was wrong
    partial: list[str] = field(default_factory=list)
    listings: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="version-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(0.01)

    def scan(self) -> None:
        self.listings += 1
        try:
            entries = [p for p in self.root.iterdir() if p.name.startswith(store.VERSION_PREFIX)]
        except FileNotFoundError:
            return
        for v in entries:
            # Manifest first, then the folder: a version renamed away (pruned) in between is gone,
            # not partial; a folder that still exists without its manifest is a partial version.
            if not (v / store.MANIFEST_FILE).is_file() and v.is_dir():
                self.partial.append(v.name)
                continue
            if v.name not in self.seen:
                verdict = verify_version(v, self.ref_sha, self.ref_ids)
                if verdict != "gone":
                    self.seen[v.name] = verdict


def verify_version(v: Path, ref_sha: str, ref_ids: list[str]) -> str:
    """"ok" if `v` loads as the index loader loads it and matches the reference; "gone" if it was
    pruned while being read; else what is wrong."""
    import pyarrow.parquet as pq

    from catalog.faiss_lib import faiss_module

    try:
        manifest = store.read_manifest(v)
        index = faiss_module().read_index(str(v / store.INDEX_FILE))
        vectors = np.load(v / store.VECTORS_FILE, mmap_mode="r")
        ids = pq.read_table(v / store.PRODUCTS_FILE, columns=["id"])["id"].to_pylist()
        sha = sha256_file(v / store.VECTORS_FILE)
    except Exception as exc:
        if not v.exists():
            return "gone"
        return f"unreadable: {type(exc).__name__}: {exc}"[:200]
    if not index.ntotal == vectors.shape[0] == len(ids) == manifest.get("count"):
        return f"inconsistent: index {index.ntotal}, vectors {vectors.shape[0]}, ids {len(ids)}"
    if sha != ref_sha:
        return "vectors differ from the reference (sha256)"
    if ids != ref_ids:
        return "ids differ from the reference"
    return "ok"


# --- the job as a child process --------------------------------------------------------------
class Job:
    def __init__(self, settings: Settings, src: Path, root: Path, plan: Plan, log_file: Path) -> None:
        m = settings.model
        self.root = root
        self.log_file = log_file
        self.cmd = [sys.executable, "-m", "inference.cli_main", "catalog", "build", str(src), "--no-progress",
                    "--index-root", str(root), "--index-type", "flat", "--text-fields", "title",
                    "--models-dir", str(m.models_dir.resolve()), "--model", m.name, "--variant", m.variant,
                    "--threads", str(m.intra_op_threads), "--batch-size", str(plan.batch_size), "--in-flight", "2"]
        # The child is configured by flags plus the one setting without a flag; nothing else from
        # this shell's EMBEDCAR_* variables may change what it computes.
        env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDCAR_")}
        env["EMBEDCAR_CATALOG_CHUNK_ITEMS"] = str(plan.chunk_items)
        self.env = env

    def start(self) -> subprocess.Popen[bytes]:
        with self.log_file.open("ab") as out:
            out.write(f"\n--- {time.strftime('%H:%M:%S')} catalog build (a new attempt) ---\n".encode())
            out.flush()
            return subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)

    def chunks_done(self) -> int:
        """Chunks the job has checkpointed (its progress file), -1 when there is none."""
        for p in (self.root / ".work").glob("*/progress.json"):
            try:
                return len(json.loads(p.read_text())["done"])
            except (OSError, ValueError, KeyError):
                continue
        return -1

    def run_to_end(self, n_chunks: int) -> Timeline:
        """Start the job and follow it until it exits on its own."""
        proc = self.start()
        try:
            return self.watch(proc, n_chunks)
        finally:
            _reap(proc)

    def versions(self) -> set[str]:
        return {p.name for p in store.complete_versions(self.root)}

    def temps(self) -> set[str]:
        return {p.name for p in self.root.iterdir() if p.name.startswith(".tmp-")} if self.root.is_dir() else set()

    def watch(self, proc: subprocess.Popen[bytes], n_chunks: int,
              kill_when: Callable[[int, Timeline], bool] | None = None) -> Timeline:
        """Follow `proc` until it exits or `kill_when(chunks_done, timeline)` holds (then return at once)."""
        before, temps_before = self.versions(), self.temps()
        tl = Timeline(time.monotonic())
        deadline = tl.started + JOB_TIMEOUT_S
        while True:
            now = time.monotonic()
            code = proc.poll()
            done = self.chunks_done()
            if done >= 1 and tl.first_chunk is None:
                tl.first_chunk = now
            if done >= n_chunks and tl.all_chunks is None:
                tl.all_chunks = now
            if tl.temp is None and self.temps() - temps_before:
                tl.temp = now
            if tl.version is None and self.versions() - before:
                tl.version = now
            if code is not None:
                tl.exited, tl.code = now, code
                return tl
            if kill_when is not None and kill_when(done, tl):
                return tl
            if now > deadline:
                proc.kill()
                proc.wait()
                raise TimeoutError(f"catalog build ran over {JOB_TIMEOUT_S:g} s; see {self.log_file}")
            time.sleep(POLL_S)


# --- the scenario ----------------------------------------------------------------------------
def run(settings: Settings, work: Path, *, quick: bool) -> ScenarioResult:
    result = ScenarioResult(NAME, TITLE)
    t0 = time.monotonic()
    try:
        _run(settings, work, QUICK if quick else FULL, SEED, result)
    except Exception as exc:  # one broken scenario must not end the whole suite's report
        result.check("scenario ran to the end", "no error", f"{type(exc).__name__}: {exc}"[:300], False)
    finally:
        result.seconds = round(time.monotonic() - t0, 1)
    return result


def _run(settings: Settings, work: Path, plan: Plan, seed: int, result: ScenarioResult) -> None:
    from catalog.sources import read_grocery

    work.mkdir(parents=True, exist_ok=True)
    src = work / "products.jsonl"
    products = read_grocery(limit=plan.items).products
    src.write_text("".join(json.dumps({"id": p.id, **p.fields}) + "\n" for p in products))
    n_chunks = math.ceil(len(products) / plan.chunk_items)

    # 1. The uninterrupted reference, and its timeline to place the kills.
    ref_root = work / "reference"
    shutil.rmtree(ref_root, ignore_errors=True)
    ref = Job(settings, src, ref_root, plan, work / "reference.log")
    tl = ref.run_to_end(n_chunks)
    if tl.code != 0 or not ref.versions():
        raise RuntimeError(f"the reference build failed (exit {tl.code}); see {ref.log_file}")
    ref_dir = store.complete_versions(ref_root)[-1]
    ref_sha = sha256_file(ref_dir / store.VECTORS_FILE)
    ref_ids = _ids(ref_dir)
    pace = Pace.of(tl, n_chunks)
    points = kill_points(random.Random(seed), plan.kills, n_chunks)

    # 2. The killed-and-resumed job, in a root that already serves (copies of the reference).
    root = work / "killed"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for i in range(SEEDED_VERSIONS):
        shutil.copytree(ref_dir, root / f"{store.VERSION_PREFIX}20000101T00000{i}.000000Z-seed")
    job = Job(settings, src, root, plan, work / "killed.log")
    watch = Watch(root, ref_sha, ref_ids)
    watch.start()
    after_kill: list[str] = []
    attempts = 0
    final: Timeline | None = None
    try:
        for point in points:
            attempts += 1
            _attempt(job, point, n_chunks, pace)
            after_kill.extend(_readers_view(root, ref_sha, ref_ids))
            if not point.killed:
                break  # the job finished before this kill: nothing left to resume
        if all(p.killed for p in points):
            attempts += 1
            final = job.run_to_end(n_chunks)
            after_kill.extend(_readers_view(root, ref_sha, ref_ids))
    finally:
        watch.stop()
    watch.scan()
    _judge(result, plan, seed, points, final, attempts, root, ref_root, ref_dir, ref_ids, watch, after_kill,
           settings, job, n_chunks, pace)


def kill_points(rng: random.Random, kills: int, n_chunks: int) -> list[KillPoint]:
    """`kills - 1` points after distinct random chunk counts (0 = during start-up or the first
    chunk), each short of the last chunk so it lands while embedding; then the publish point."""
    during = sorted(rng.sample(range(max(n_chunks - 1, 1)), min(kills - 1, max(n_chunks - 1, 1))))
    points = [KillPoint(c, rng.random()) for c in during]
    points.append(KillPoint(n_chunks, rng.random(), publish=True))
    return points


def _attempt(job: Job, point: KillPoint, n_chunks: int, pace: Pace) -> None:
    temps_before, versions_before = job.temps(), job.versions()
    at_start = max(job.chunks_done(), 0)
    trigger = ""

    def due(done: int, tl: Timeline) -> bool:
        nonlocal trigger
        if not point.publish:
            trigger = "chunks"
            return done >= point.after_chunks
        if at_start < n_chunks and done >= n_chunks:
            trigger = "last checkpoint"
        elif tl.temp is not None:
            trigger = "temp folder"
        return bool(trigger)

    proc = job.start()
    try:
        tl = job.watch(proc, n_chunks, kill_when=due)
        if tl.exited is None:
            point.delay_s = point.u * (0.9 * pace.chunk_s if trigger == "chunks" else
                                       0.8 * (pace.publish_s if trigger == "last checkpoint" else pace.temp_s))
            time.sleep(point.delay_s)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                point.killed = True
    finally:
        _reap(proc)
    done = job.chunks_done()
    point.chunks_at_kill = max(done, 0)
    if not point.killed:
        point.landed = f"missed: the job exited (code {proc.returncode}) first"
    elif job.versions() - versions_before:
        point.landed = "publish: after the version was renamed into place"
    elif job.temps() - temps_before:
        point.landed = "publish: while the version's temp folder was being written"
    elif done >= n_chunks:
        point.landed = "publish: after the last checkpoint, before the version's temp folder"
    elif done < 0:
        point.landed = "start-up: no checkpoint yet"
    elif done == at_start:
        point.landed = f"start-up: {done} of {n_chunks} chunks checkpointed by earlier runs"
    else:
        point.landed = f"embedding: {done} of {n_chunks} chunks checkpointed"


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a job that exited or was killed; one still running (an error here) is killed."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _readers_view(root: Path, ref_sha: str, ref_ids: list[str]) -> list[str]:
    """Problems a reader would meet now: any listed version that is not complete and equal to the
    reference, or the newest one failing to open as the sidecar opens it."""
    from catalog.index import ProductIndex

    problems = []
    for v in sorted(p for p in root.iterdir() if p.name.startswith(store.VERSION_PREFIX)):
        verdict = verify_version(v, ref_sha, ref_ids)
        if verdict not in ("ok", "gone"):
            problems.append(f"{v.name}: {verdict}")
    try:
        ProductIndex.open(root, expected_model_id=None)
    except Exception as exc:
        problems.append(f"newest version does not open: {exc}")
    return problems


def _ids(version: Path) -> list[str]:
    import pyarrow.parquet as pq

    ids: list[str] = pq.read_table(version / store.PRODUCTS_FILE, columns=["id"])["id"].to_pylist()
    return ids


def _search_all(settings: Settings, roots: list[Path]) -> list[list[list[tuple[str, float]]]]:
    """Hits (id, score) for QUERIES on the newest version under each root, one embedding for all."""
    from catalog.index import ProductIndex
    from catalog.job import job_backend
    from inference.aio import run_sync
    from inference.embedder import Embedder, load_tokenizer
    from inference.manifest import load_manifest

    backend = job_backend(settings)
    model_dir = settings.model.model_dir
    embedder = Embedder(load_tokenizer(model_dir, load_manifest(model_dir)), backend)

    async def embed() -> Any:
        await backend.start()
        try:
            return (await embedder.embed(list(QUERIES))).embeddings
        finally:
            await backend.close()

    q = run_sync(embed())
    out = []
    for root in roots:
        idx = ProductIndex.open(root, expected_model_id=backend.version_id)
        out.append([[(h.id, h.score) for h in row] for row in idx.search(q, k=10)])
    return out


def _judge(result: ScenarioResult, plan: Plan, seed: int, points: list[KillPoint], final: Timeline | None,
           attempts: int, root: Path, ref_root: Path, ref_dir: Path, ref_ids: list[str], watch: Watch,
           after_kill: list[str], settings: Settings, job: Job, n_chunks: int, pace: Pace) -> None:
    killed = [p for p in points if p.killed]
    pub = [p for p in killed if p.landed.startswith("publish:")]
    result.check("kills landed", f"{len(points)} (the last during publish)",
                 f"{len(killed)} of {len(points)}", len(killed) == len(points))
    result.check("a kill during publish", "after every chunk was checkpointed, before the job exited",
                 pub[0].landed if pub else (points[-1].landed or "not reached"), bool(pub))
    resumed = final is not None and final.code == 0
    result.check("resumed to completion", "exit 0 and a new version",
                 f"exit {final.code if final else 'not run'}", resumed)
    newest = store.newest_version(root)
    is_new = newest is not None and not newest.name.endswith("-seed")
    same_ids = same_vectors = same_hits = False
    hits_measured = "not compared"
    if resumed and is_new and newest is not None:
        same_ids = _ids(newest) == ref_ids
        a, b = np.load(newest / store.VECTORS_FILE), np.load(ref_dir / store.VECTORS_FILE)
        same_vectors = a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
        ours, theirs = _search_all(settings, [root, ref_root])
        equal_rows = sum(x == y for x, y in zip(ours, theirs, strict=True))
        same_hits = equal_rows == len(QUERIES)
        hits_measured = f"{equal_rows} of {len(QUERIES)} queries (top 10 ids and scores)"
    result.check("ids equal to the uninterrupted run", "same ids, same order",
                 f"{len(_ids(newest)) if is_new and newest else 0} ids, equal: {same_ids}", same_ids)
    result.check("vectors bit-equal to the uninterrupted run", "np.array_equal", str(same_vectors), same_vectors)
    result.check("search results equal to the uninterrupted run", f"{len(QUERIES)} of {len(QUERIES)}",
                 hits_measured, same_hits)
    bad_seen = {v: why for v, why in watch.seen.items() if why != "ok"}
    result.check("partial versions visible", "0 (watcher + after every kill)",
                 f"{len(watch.partial)} partial folders in {watch.listings} listings, "
                 f"{len(after_kill)} problems after kills", not watch.partial and not after_kill)
    result.check("visible versions load with matching checksums", "all",
                 f"{len(watch.seen) - len(bad_seen)} of {len(watch.seen)}"
                 + (f"; {next(iter(bad_seen.items()))}" if bad_seen else ""), not bad_seen and bool(watch.seen))
    result.figures.update({
        "seed": seed,
        "items": plan.items,
        "chunks": n_chunks,
        "chunk_items": plan.chunk_items,
        "kills": len(killed),
        "attempts": attempts,
        "kill_points": [{"after_chunks": p.after_chunks, "delay_ms": round(p.delay_s * 1e3, 1),
                         "landed": p.landed} for p in points],
        "reference_chunk_ms": round(pace.chunk_s * 1e3, 1),
        "reference_publish_ms": round(pace.publish_s * 1e3, 1),
        "reference_temp_folder_ms": round(pace.temp_s * 1e3, 1),
        "versions_watched": len(watch.seen),
        "watcher_listings": watch.listings,
        "temp_folders_left": len(job.temps()),
    })
    for p in points:
        what = "publish point" if p.publish else f"after {p.after_chunks} chunks"
        result.notes.append(f"kill {what} + {p.delay_s * 1e3:.0f} ms: {p.landed}")
    if after_kill:
        result.notes.extend(after_kill[:5])
