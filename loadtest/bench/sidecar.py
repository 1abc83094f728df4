"""`embedcar bench sidecar`: localhost latency of Embed for one 16-32-token query.

Cases (sequential requests, one at a time: typeahead latency, not throughput):
  raw_ort          the embedded ONNX Runtime call alone (tokens -> pooled embedding), in-process
  sidecar_hit      Embed through the sidecar, answered from the cache
  sidecar_miss     Embed through the sidecar, every query new (embedded backend)
  raw_triton       TritonBackend.embed alone, in-process        (with --start-triton)
  triton_miss      Embed through a sidecar on the Triton backend (with --start-triton)
  overload         open-loop load beyond capacity (with --overload-qps): accepted requests' latency
                   against the unloaded miss latency, and how fast the excess is refused
The sidecar runs in its own process (as deployed, loadtest.stack.SidecarProcess), so client and
server do not share a GIL.
The client calls it over loopback TCP, or with --uds over a Unix socket (report field `transport`);
with --uds, `hit_by_transport` also times cache hits over both transports of the same sidecar in
alternating blocks, the fair A/B of the transport. With --floor, `hit_vs_floor` times cache hits
against a do-nothing gRPC server with the same reply (loadtest/bench/floor.py) in the same way: the part
of a hit that any Python gRPC service pays on this host.
sidecar_miss minus raw_ort is what the sidecar adds on a miss; sidecar_hit is the whole hit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from embedcar_client.client import AsyncClient, Client
from inference.backends.factory import make_backend
from inference.backends.onnx import OnnxBackend
from inference.embedder import load_tokenizer
from inference.errors import EmbedcarError
from inference.files import atomic_write_text
from inference.manifest import load_manifest
from inference.tokenizer import QueryTokenizer
from loadtest.bench.floor import floor_process
from loadtest.stack import SidecarProcess
from sidecar.settings import Settings

_WORDS = ("organic whole milk oat almond soy greek yogurt vanilla strawberry banana apple gala fuji "
          "sourdough rye bagel tortilla free range eggs dozen cheddar mozzarella parmesan butter "
          "unsalted olive oil extra virgin basmati jasmine rice penne spaghetti marinara pesto "
          "chicken breast boneless skinless ground beef lean salmon fillet frozen pizza pepperoni "
          "dark chocolate sea salt caramel coffee beans decaf green tea honey maple syrup gluten "
          "free low sodium family size pack of 12 ounce 1 gallon 500g 2 lb fresh baby spinach")
VOCAB = tuple(_WORDS.split())
LOG_DIR = Path("var/bench")  # the sidecar children's logs (git-ignored)


def make_queries(tokenizer: QueryTokenizer, n: int, *, seed: int = 7, lo: int = 16, hi: int = 32) -> list[str]:
    """`n` distinct shopper-like queries of lo..hi tokens ([CLS]/[SEP] included)."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        q = " ".join(rng.choice(VOCAB) for _ in range(rng.randint(8, 20)))
        if q in seen:
            continue
        if lo <= len(tokenizer.encode([q]).ids[0]) <= hi:
            seen.add(q)
            out.append(q)
    return out


def stats_ms(samples_s: list[float]) -> dict[str, float]:
    a = np.asarray(samples_s) * 1e3
    return {"n": len(a), "median_ms": round(float(np.median(a)), 3), "p95_ms": round(float(np.percentile(a, 95)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3), "mean_ms": round(float(a.mean()), 3)}


def timed(fn: Callable[[str], Any], queries: list[str]) -> tuple[list[float], list[Any]]:
    lat: list[float] = []
    out: list[Any] = []
    for q in queries:
        t0 = time.perf_counter()
        r = fn(q)
        lat.append(time.perf_counter() - t0)
        out.append(r)
    return lat, out


@contextlib.contextmanager
def sidecar_process(settings: Settings, backend: str, *, triton_url: str | None = None,
                    uds: bool = False) -> Iterator[tuple[str, str]]:
    """A sidecar child (HTTP off) on the bench's model settings; yields (the client's target, its TCP target).

    uds: the child also listens on a Unix socket in a fresh temporary folder, and the target is that socket.
    """
    m = settings.model
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        sock = None
        if uds:
            sock = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="embedcar-bench-"))) / "grpc.sock"
        sc = stack.enter_context(SidecarProcess(
            settings, backend=backend, variant=m.variant, triton_url=triton_url, http=False, uds_path=sock,
            log_file=LOG_DIR / f"sidecar-{backend}.log",
            extra_env={"EMBEDCAR_MODEL_INTRA_OP_THREADS": str(m.intra_op_threads)}))
        yield (sc.uds_target if uds else sc.grpc_target), sc.grpc_target


def bench_client(target: str, queries: list[str], warm: list[str]) -> dict[str, Any]:
    """Cache misses (each query once), then cache hits (one query again and again)."""
    with Client(target) as c:
        for q in warm:
            c.embed([q])
        miss_lat, miss = timed(lambda q: c.embed([q]), queries)
        hit_q = queries[0]
        hit_lat, hit = timed(lambda _q: c.embed([hit_q]), queries)
    assert not any(r.cache_hits[0] for r in miss) and all(r.cache_hits[0] for r in hit)

    def stages(results: list[Any]) -> dict[str, float]:
        keys = results[0].timings_ns.keys()
        return {k: round(float(np.median([r.timings_ns[k] for r in results])) / 1e3, 1) for k in keys}

    miss_inference = [r.timings_ns["inference"] * 1e-9 for r in miss]
    return {"miss": stats_ms(miss_lat), "hit": stats_ms(hit_lat),
            "miss_outside_inference": stats_ms([t - i for t, i in zip(miss_lat, miss_inference, strict=True)]),
            "miss_server_stages_median_us": stages(miss), "hit_server_stages_median_us": stages(hit)}


def bench_hits_alternating(targets: dict[str, str], query: str, n: int, *, block: int = 50) -> dict[str, Any]:
    """One query, again and again, to each target in alternating blocks (first 5 calls of a block
    not counted), so all see the same machine; on a sidecar the query must be cached already."""
    lat: dict[str, list[float]] = {name: [] for name in targets}
    clients = {name: Client(t) for name, t in targets.items()}
    try:
        for c in clients.values():
            c.embed([query])
        while min(len(v) for v in lat.values()) < n:
            for name, c in clients.items():
                for j in range(block):
                    t0 = time.perf_counter()
                    c.embed([query])
                    if j >= 5 and len(lat[name]) < n:
                        lat[name].append(time.perf_counter() - t0)
    finally:
        for c in clients.values():
            c.close()
    return {name: stats_ms(v) for name, v in lat.items()}


async def _open_loop(target: str, queries: list[str], qps: float, deadline_s: float) -> list[tuple[str, float]]:
    """Fire one request every 1/qps seconds whatever the answers (open loop); (outcome, seconds) each."""
    out: list[tuple[str, float]] = []
    async with AsyncClient(target) as c:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.1

        async def one(i: int, q: str) -> None:
            await asyncio.sleep(max(0.0, start + i / qps - loop.time()))
            t0 = time.perf_counter()
            try:
                await c.embed([q], timeout_s=deadline_s)
                out.append(("ok", time.perf_counter() - t0))
            except EmbedcarError as exc:
                out.append((exc.code, time.perf_counter() - t0))

        await asyncio.gather(*(one(i, q) for i, q in enumerate(queries)))
    return out


def bench_overload(target: str, queries: list[str], qps: float, deadline_s: float) -> dict[str, Any]:
    """Offered load beyond capacity: accepted requests should keep their latency, the rest fail fast."""
    results = asyncio.run(_open_loop(target, queries, qps, deadline_s))
    by_code: dict[str, list[float]] = {}
    for code, sec in results:
        by_code.setdefault(code, []).append(sec)
    return {"offered_qps": qps, "deadline_ms": deadline_s * 1e3, "offered": len(results),
            "outcomes": {code: stats_ms(lat) for code, lat in sorted(by_code.items())}}


def bench_raw_ort(settings: Settings, tokenizer: QueryTokenizer, queries: list[str]) -> dict[str, float]:
    backend = make_backend(settings, "embedded")
    assert isinstance(backend, OnnxBackend)
    backend.warm_up()
    batches = [tokenizer.batch(tokenizer.encode([q]).ids) for q in queries]
    lat = []
    for b in batches:
        t0 = time.perf_counter()
        backend.embed_sync(b)
        lat.append(time.perf_counter() - t0)
    return stats_ms(lat)


def bench_raw_triton(settings: Settings, tokenizer: QueryTokenizer, queries: list[str]) -> dict[str, float]:
    async def run() -> list[float]:
        b = make_backend(settings, "triton")
        await b.start()
        try:
            lat = []
            for q in queries:
                batch = tokenizer.batch(tokenizer.encode([q]).ids)
                t0 = time.perf_counter()
                await b.embed(batch)
                lat.append(time.perf_counter() - t0)
            return lat
        finally:
            await b.close()

    return stats_ms(asyncio.run(run()))


def run_bench(settings: Settings, *, requests: int = 300, start_triton: bool = False, overload_qps: float = 0.0,
              overload_s: float = 5.0, overload_deadline_ms: float = 50.0, uds: bool = False,
              floor: bool = False, out: Path | None = None) -> dict[str, Any]:
    m = settings.model
    manifest = load_manifest(m.model_dir)
    tokenizer = load_tokenizer(m.model_dir, manifest)
    queries = make_queries(tokenizer, 2 * requests + 50)
    warm, measured, triton_queries = queries[:50], queries[50:50 + requests], queries[50 + requests:]
    report: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "host": os.uname().nodename,
                              "cpus": os.cpu_count(), "requests": requests, "model": manifest.variant_id(m.variant),
                              "transport": "uds" if uds else "tcp",
                              "note": "sequential requests, one query each, 16-32 tokens", "cases": {}}
    cases = report["cases"]
    cases["raw_ort"] = bench_raw_ort(settings, tokenizer, measured)
    with sidecar_process(settings, "embedded", uds=uds) as (target, tcp):
        cases["sidecar_embedded"] = bench_client(target, measured, warm)
        if uds:
            cases["hit_by_transport"] = bench_hits_alternating({"tcp": tcp, "uds": target}, measured[0], requests)
        if floor:
            with floor_process(manifest.dim) as bare:
                cases["hit_vs_floor"] = bench_hits_alternating({"sidecar": tcp, "floor": bare}, measured[0], requests)
        if overload_qps > 0:
            fresh = make_queries(tokenizer, int(overload_qps * overload_s), seed=11)
            cases["overload_embedded"] = bench_overload(target, fresh, overload_qps, overload_deadline_ms / 1e3)
    if start_triton:
        from inference.triton.launcher import TritonServer

        with TritonServer(settings, variant=m.variant) as triton:
            ts = settings.with_section("triton", urls=(triton.grpc_url,))
            cases["raw_triton"] = bench_raw_triton(ts, tokenizer, triton_queries)
            with sidecar_process(ts, "triton", triton_url=triton.grpc_url, uds=uds) as (target, _tcp):
                cases["sidecar_triton"] = bench_client(target, triton_queries, warm)
    emb = cases["sidecar_embedded"]
    summary = {
        "transport": report["transport"],
        "raw_ort_p95_ms": cases["raw_ort"]["p95_ms"],
        "hit_p50_ms": emb["hit"]["median_ms"], "hit_p95_ms": emb["hit"]["p95_ms"],
        "miss_embedded_p50_ms": emb["miss"]["median_ms"], "miss_embedded_p95_ms": emb["miss"]["p95_ms"],
        "sidecar_added_on_miss_p95_ms": emb["miss_outside_inference"]["p95_ms"],
    }
    for case in ("hit_by_transport", "hit_vs_floor"):
        summary |= {f"hit_{name}_p50_p95_ms": [v["median_ms"], v["p95_ms"]] for name, v in cases.get(case, {}).items()}
    if "sidecar_triton" in cases:
        summary |= {"raw_triton_p95_ms": cases["raw_triton"]["p95_ms"],
                    "miss_triton_p50_ms": cases["sidecar_triton"]["miss"]["median_ms"],
                    "miss_triton_p95_ms": cases["sidecar_triton"]["miss"]["p95_ms"]}
    if "overload_embedded" in cases:
        outcomes = cases["overload_embedded"]["outcomes"]
        summary |= {"overload_accepted_p95_ms": outcomes.get("ok", {}).get("p95_ms"),
                    "overload_rejected": {k: v["n"] for k, v in outcomes.items() if k != "ok"},
                    "overload_rejected_p95_ms": max((v["p95_ms"] for k, v in outcomes.items() if k != "ok"),
                                                    default=None)}
    report["summary"] = summary
    if out is not None:
        atomic_write_text(out, json.dumps(report, indent=2))
    return report
