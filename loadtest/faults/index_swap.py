"""Index hot swap under Search load.

A real sidecar (gRPC, embedded model) serves `Search` from an index root at 50 req/s, open loop,
while a separate process runs the catalog job's publish step (`catalog.publish.publish_index`: build
FAISS, write a hidden temp folder, fsync, rename, prune) every few seconds. Each version holds a
different window of one embedded product pool, so a reply whose hits do not all belong to the
version it names shows a torn swap. The embeddings are computed once by the real job; re-embedding
per version would make a swap every 2–3 s impossible on a CPU and adds nothing to what is tested.

The publisher child is this module run as `python -m loadtest.faults.index_swap publisher ...`
(an internal entry point: one JSON line in per version, one JSON line out when it is published).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from embedcar_settings import Settings
from inference.errors import EmbedcarError
from loadtest.faults.result import ScenarioResult

if TYPE_CHECKING:
    from embedcar_client.client import AsyncClient

NAME = "index-swap"
TITLE = "Index hot swap under 50 req/s of Search: no failed search, every reply from one published version"

K = 5
TIMEOUT_S = 30.0  # per search: a slow shared box must not turn into "failed searches"


@dataclass(frozen=True, slots=True)
class Plan:
    pool: int  # products embedded once
    items: int  # products per version (a window of the pool, shifted per version)
    swaps: int  # versions published while the load runs
    interval_s: float  # between publishes
    rate: float  # searches per second
    poll_s: float  # sidecar index poll interval

    @property
    def shift(self) -> int:
        return max(1, (self.pool - self.items) // max(self.swaps, 1))

    @property
    def duration_s(self) -> float:
        return self.interval_s * (self.swaps + 1)


QUICK = Plan(pool=400, items=300, swaps=2, interval_s=1.5, rate=50.0, poll_s=0.2)
FULL = Plan(pool=4000, items=3000, swaps=6, interval_s=2.5, rate=50.0, poll_s=0.25)


def window(k: int, pool: int, items: int, shift: int) -> list[int]:
    """Pool rows of version k: `items` consecutive rows from k * shift, wrapping around."""
    return [(k * shift + j) % pool for j in range(items)]


@dataclass(slots=True)
class Reply:
    sent: float  # scheduled send (time.perf_counter): latency counts any pacer lag too
    done: float
    query: str
    version: str = ""
    ids: list[str] = field(default_factory=list)
    error: str = ""  # error code, "" = ok


@dataclass(slots=True)
class Swap:
    k: int
    asked: float  # command sent to the publisher
    published: float  # publisher answered: the version is on disk
    version: str = ""
    first_served: float | None = None  # first reply naming it came back


# --- the publisher child ---------------------------------------------------------------------
def publisher_main(argv: Sequence[str]) -> int:
    """Publish windows of the pool version at `argv[0]` into the root `argv[1]`, one per stdin line."""
    from catalog import store
    from catalog.product_table import read_products
    from catalog.publish import publish_index

    pool_dir, root = Path(argv[0]), Path(argv[1])
    items, shift = int(argv[2]), int(argv[3])
    settings = Settings.load(environ={}, overrides={"catalog": {"index_root": root, "index_type": "flat"}})
    vectors = np.load(pool_dir / store.VECTORS_FILE)
    products, _rows = read_products(pool_dir / store.PRODUCTS_FILE)
    pool_meta = store.read_manifest(pool_dir)
    meta = {key: pool_meta[key] for key in ("model_id", "text_fields", "source", "build", "skipped", "bad_rows")}
    for line in sys.stdin:
        k = int(json.loads(line)["k"])
        rows = window(k, len(products), items, shift)
        t0 = time.monotonic()
        version, _params = publish_index(settings, vectors[rows], [products[r] for r in rows],
                                         meta | {"swap": k}, index_type="flat")
        print(json.dumps({"k": k, "version": version.name, "seconds": round(time.monotonic() - t0, 4)}),
              flush=True)
    return 0


class Publisher:
    """The child process, driven over its stdin/stdout."""

    def __init__(self, pool_dir: Path, root: Path, plan: Plan, log_file: Path) -> None:
        self._args = [str(pool_dir), str(root), str(plan.items), str(plan.shift)]
        self._log_file = log_file
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        err = await asyncio.to_thread(self._log_file.open, "ab")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "loadtest.faults.index_swap", "publisher", *self._args,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err)
        finally:
            err.close()  # the child has its own copy

    async def publish(self, k: int) -> Swap:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        asked = time.perf_counter()
        proc.stdin.write((json.dumps({"k": k}) + "\n").encode())
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if not line:
            raise RuntimeError(f"the publisher exited (code {await proc.wait()}); see {self._log_file}")
        got = json.loads(line)
        return Swap(k, asked, time.perf_counter(), got["version"])

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()


# --- the scenario ----------------------------------------------------------------------------
def run(settings: Settings, work: Path, *, quick: bool) -> ScenarioResult:
    from catalog import store
    from catalog.product_table import read_products
    from inference.aio import run_sync

    result = ScenarioResult(NAME, TITLE)
    t0 = time.monotonic()
    plan = QUICK if quick else FULL
    try:
        work.mkdir(parents=True, exist_ok=True)
        pool_dir = _embed_pool(settings, work / "pool", plan.pool)
        products, _ = read_products(pool_dir / store.PRODUCTS_FILE)
        ids_of = {k: {products[r].id for r in window(k, plan.pool, plan.items, plan.shift)}
                  for k in range(plan.swaps + 1)}
        queries = _queries([p.fields.get("title", "") for p in products], seed=0)
        replies, swaps, final = run_sync(_serve(settings, work, pool_dir, queries, plan))
        _judge(result, plan, replies, swaps, final, ids_of)
    except Exception as exc:  # one broken scenario must not end the whole suite's report
        result.check("scenario ran to the end", "no error", f"{type(exc).__name__}: {exc}"[:300], False)
    finally:
        result.seconds = round(time.monotonic() - t0, 1)
    return result


async def _serve(settings: Settings, work: Path, pool_dir: Path, queries: Sequence[str],
                 plan: Plan) -> tuple[list[Reply], list[Swap], str]:
    """Publish the first version, start the sidecar on it, then load it while versions follow."""
    from sidecar.app import SidecarThread

    root = work / "served"
    publisher = Publisher(pool_dir, root, plan, work / "publisher.log")
    await publisher.start()
    try:
        swaps = [await publisher.publish(0)]
        sc_settings = settings.with_section(
            "sidecar", backend="embedded", host="127.0.0.1", grpc_port=0, http_port=-1, api_keys="",
            api_keys_file=None, index_dir=root, poll_s=plan.poll_s, rate_per_s=1e6, burst=1_000_000,
            default_deadline_ms=int(TIMEOUT_S * 1000), warm_queries_file=None,
            # Every search embeds, so latency before and around swaps compares like for like; the
            # admission budget is off because shedding load on a busy box is not what is tested here
            # (the overload scenario is): a refused search would read as a failed swap.
            cache_entries=0, admission_budget_ms=0.0)
        thread = SidecarThread(sc_settings)
        sidecar = await asyncio.to_thread(thread.__enter__)
        try:
            return await _drive(sidecar.grpc_target, queries, plan, publisher, swaps)
        finally:
            await asyncio.to_thread(thread.__exit__, None, None, None)
    finally:
        await publisher.close()


def _embed_pool(settings: Settings, root: Path, n: int) -> Path:
    """The real catalog job over the first n grocery products (flat index): the shared pool."""
    from catalog.job import build
    from catalog.sources import read_grocery
    from catalog.spec import BuildSpec
    from inference.aio import run_sync

    s = settings.with_section("catalog", index_root=root, index_type="flat", chunk_items=1024)
    summary = run_sync(build(s, BuildSpec(), loaded=read_grocery(limit=n), progress=False))
    assert summary.version_dir is not None
    return summary.version_dir


def _queries(titles: Sequence[str], *, seed: int, n: int = 500) -> list[str]:
    """Shopper-like prefixes of real titles: the first one to three words, lower-cased."""
    rng = np.random.default_rng(seed)
    words = [t.lower().split() for t in titles if t.strip()]
    out = []
    for i in rng.integers(0, len(words), n):
        w = words[int(i)]
        out.append(" ".join(w[: int(rng.integers(1, 4))]))
    return out


async def _drive(target: str, queries: Sequence[str], plan: Plan, publisher: Publisher,
                 swaps: list[Swap]) -> tuple[list[Reply], list[Swap], str]:
    from embedcar_client.client import AsyncClient
    from loadtest.schedule import arrival_offsets, pace

    replies: list[Reply] = []
    tasks: set[asyncio.Task[None]] = set()
    async with AsyncClient(target) as client:

        async def one(i: int, due: float) -> None:
            q = queries[i % len(queries)]
            r = Reply(due, 0.0, q)
            try:
                res = await client.search([q], k=K, timeout_s=TIMEOUT_S)
                r.version, r.ids = res.index_version, [h.id for h in res.hits[0]]
            except EmbedcarError as exc:
                r.error = exc.code
            r.done = time.perf_counter()
            replies.append(r)

        def release(i: int, due: float) -> None:
            t = asyncio.create_task(one(i, due))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        async def swapper(start: float) -> None:
            for k in range(1, plan.swaps + 1):
                await asyncio.sleep(max(0.0, start + k * plan.interval_s - time.perf_counter()))
                swaps.append(await publisher.publish(k))

        for q in queries[-20:]:  # warm-up, not counted: first calls of each shape pay ORT's set-up
            await client.search([q], k=K, timeout_s=TIMEOUT_S)
        start = time.perf_counter() + 0.05
        swapping = asyncio.create_task(swapper(start))
        try:
            await pace(arrival_offsets(plan.rate, plan.duration_s), release, start=start, clock=time.perf_counter)
            await swapping
        finally:
            swapping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await swapping
        if tasks:
            await asyncio.gather(*list(tasks))
        final = await _settle(client, swaps[-1].version, plan)
    return replies, swaps, final


async def _settle(client: AsyncClient, newest: str, plan: Plan) -> str:
    """The version the sidecar serves once it has had time to pick up the last publish."""
    got = ""
    deadline = time.monotonic() + 20 * plan.poll_s + 30
    while time.monotonic() < deadline:
        got = (await client.search(["milk"], k=1, timeout_s=TIMEOUT_S)).index_version
        if got == newest:
            break
        await asyncio.sleep(plan.poll_s / 2)
    return str(got)


# --- judging ---------------------------------------------------------------------------------
def _judge(result: ScenarioResult, plan: Plan, replies: list[Reply], swaps: list[Swap], final: str,
           ids_of: dict[int, set[str]]) -> None:
    by_name = {s.version: s for s in swaps}
    ok = [r for r in replies if not r.error]
    failed = [r for r in replies if r.error]
    codes: dict[str, int] = {}
    for r in failed:
        codes[r.error] = codes.get(r.error, 0) + 1
    result.check("failed searches", "0", f"{len(failed)} of {len(replies)}"
                 + (f" ({', '.join(f'{c} {n}' for c, n in sorted(codes.items()))})" if codes else ""),
                 not failed and len(replies) > 0)
    unknown = [r for r in ok if r.version not in by_name]
    early = [r for r in ok if r.version in by_name and r.done < by_name[r.version].asked]
    result.check("replies naming a valid version", "all (published, and published before the reply)",
                 f"{len(ok) - len(unknown) - len(early)} of {len(ok)}"
                 + (f"; unknown {sorted({r.version for r in unknown})[:3]}" if unknown else "")
                 + (f"; {len(early)} before their publish" if early else ""),
                 not unknown and not early)
    torn = [r for r in ok if r.version in by_name and not set(r.ids) <= ids_of[by_name[r.version].k]]
    result.check("hits from the version the reply names", "all", f"{len(ok) - len(torn)} of {len(ok)}",
                 not torn)
    back = _went_back(ok)
    result.check("no reply older than one already served", "0", str(back), back == 0)
    newest = swaps[-1].version
    result.check("final version is the newest", newest, final, final == newest)
    result.check("swaps done", f">= {plan.swaps}", str(len(swaps) - 1), len(swaps) - 1 >= plan.swaps)

    for s in swaps:
        served = [r.done for r in ok if r.version == s.version]
        s.first_served = min(served) if served else None
    seen = sorted({r.version for r in ok})
    result.figures.update({
        "searches": len(replies),
        "rate_per_s": plan.rate,
        "swaps": len(swaps) - 1,
        "interval_s": plan.interval_s,
        "items_per_version": plan.items,
        "versions_published": len(swaps),
        "versions_seen": len(seen),
        "index_poll_s": plan.poll_s,
        "publish_ms": [round((s.published - s.asked) * 1e3, 1) for s in swaps[1:]],
        "swap_visible_ms": [round((s.first_served - s.published) * 1e3, 1) if s.first_served else None
                            for s in swaps[1:]],
    })
    near = plan.poll_s + 0.5  # a swap's effect: from its publish until the sidecar has loaded it
    windows = [(s.asked, s.published + near) for s in swaps[1:]]
    first = swaps[1].asked if len(swaps) > 1 else float("inf")
    before = [r.done - r.sent for r in ok if r.sent < first]
    around = [r.done - r.sent for r in ok if any(a <= r.sent <= b for a, b in windows)]
    for label, xs in (("before_swaps", before), ("around_swaps", around)):
        if xs:
            result.figures[f"{label}_requests"] = len(xs)
            result.figures[f"{label}_p50_ms"] = round(float(np.percentile(xs, 50)) * 1e3, 2)
            result.figures[f"{label}_p95_ms"] = round(float(np.percentile(xs, 95)) * 1e3, 2)
    if seen:
        result.notes.append(f"versions served: {', '.join(seen)}")


def _went_back(ok: list[Reply]) -> int:
    """Replies sent after a reply naming a newer version had come back, yet naming an older one."""
    events = sorted([(r.done, 1, r.version) for r in ok] + [(r.sent, 0, r.version) for r in ok])
    newest_back, bad = "", 0
    for _t, kind, version in events:
        if kind == 1:
            newest_back = max(newest_back, version)
        elif version < newest_back:
            bad += 1
    return bad


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "publisher":
        sys.exit(publisher_main(sys.argv[2:]))
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else 'loadtest.faults.index_swap'} publisher ...")
