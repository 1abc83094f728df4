"""`embedcar bench demo`: a scripted typist on the demo's websocket.

Types N shopper queries letter by letter (one keystroke every `key_interval_ms`, as a person
would, not waiting for answers), on one connection like one browser tab, and measures each
answered keystroke the way the page does: total = client round trip; network = total - server
time; server = server time - sidecar stages; then the sidecar's cache / tokenize / queue /
inference / search. Also: sidecar = the sidecar's own Search total, hops = total - sidecar (what
the demo adds: the page's websocket, the demo server and its call to the sidecar). Superseded
keystrokes are counted, not timed (they were never computed).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo_ui.search import STAGES
from inference.errors import InvalidInput, Unavailable
from inference.files import atomic_write_text

QUERIES_FILE = Path(__file__).resolve().parent / "typist_queries.txt"
BREAKDOWN = ("total", "sidecar", "hops", "network", "server", *STAGES)


def load_queries(path: Path = QUERIES_FILE) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [q.strip() for q in lines if q.strip() and not q.startswith("#")]


def sample_queries(n: int, *, seed: int = 7, pool: list[str] | None = None) -> list[str]:
    """`n` queries drawn with Zipf-like weights (1/rank): popular queries repeat, as in real traffic."""
    pool = pool or load_queries()
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(len(pool))]
    return rng.choices(pool, weights=weights, k=n)


@dataclass(slots=True)
class Keystroke:
    seq: int
    text: str
    sent_ns: int


@dataclass(slots=True)
class BenchResult:
    samples: list[dict[str, float]] = field(default_factory=list)  # per answered keystroke, ms
    cache_hits: int = 0
    sent: int = 0
    superseded: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        answered = len(self.samples)
        stages = {
            name: {"p50_ms": percentile([s[name] for s in self.samples], 50),
                   "p95_ms": percentile([s[name] for s in self.samples], 95),
                   "p99_ms": percentile([s[name] for s in self.samples], 99)}
            for name in BREAKDOWN
        }
        return {
            "keystrokes_sent": self.sent,
            "answered": answered,
            "superseded": self.superseded,
            "lost": self.lost,
            "errors": self.errors,
            "cache_hit_rate": self.cache_hits / answered if answered else 0.0,
            "stages": stages,
            "wall_s": round(self.wall_s, 2),
        }


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (the same rule the page uses)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = max(0, min(len(ordered) - 1, -(-len(ordered) * p // 100) - 1))
    return round(ordered[int(idx)], 3)


def breakdown(reply: dict[str, Any], total_ms: float) -> dict[str, float]:
    timings = reply.get("timings_ns") or {}
    stages = {k: float(timings.get(k, 0)) / 1e6 for k in STAGES}
    server_ms = float(reply.get("server_ms", 0.0))
    sidecar_ms = float(timings.get("total", 0)) / 1e6
    return {
        "total": total_ms,
        "sidecar": sidecar_ms,
        "hops": max(0.0, total_ms - sidecar_ms),
        "network": max(0.0, total_ms - server_ms),
        "server": max(0.0, server_ms - sum(stages.values())),
        **stages,
    }


async def run_bench(url: str, queries: list[str], *, key_interval_ms: float = 60.0,
                    pause_ms: float = 300.0, reply_timeout_s: float = 5.0) -> BenchResult:
    from websockets.asyncio.client import connect

    result = BenchResult()
    pending: dict[int, Keystroke] = {}
    answered = asyncio.Event()
    t_start = time.perf_counter()

    async def receive(ws: Any) -> None:
        async for raw in ws:
            now = time.perf_counter_ns()
            msg = json.loads(raw)
            key = pending.pop(msg.get("seq"), None) if isinstance(msg.get("seq"), int) else None
            if "dropped" in msg:
                result.superseded += 1
            elif "error" in msg:
                code = str(msg["error"].get("code"))
                result.errors[code] = result.errors.get(code, 0) + 1
            elif key is not None:
                result.samples.append(breakdown(msg, (now - key.sent_ns) / 1e6))
                result.cache_hits += bool(msg.get("cache_hit"))
            if not pending:
                answered.set()

    try:
        ws_cm = connect(url, open_timeout=10, max_size=1 << 20)
        ws = await ws_cm.__aenter__()
    except OSError as exc:
        raise Unavailable(f"cannot connect to {url}: {exc} (is `embedcar demo` running?)") from exc
    try:
        reader = asyncio.create_task(receive(ws))
        seq = 0
        for query in queries:
            next_at = time.perf_counter()
            for i in range(1, len(query) + 1):
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                seq += 1
                answered.clear()
                pending[seq] = Keystroke(seq, query[:i], time.perf_counter_ns())
                await ws.send(json.dumps({"seq": seq, "text": query[:i]}))
                result.sent += 1
                next_at += key_interval_ms / 1000
            # Let the last keystroke of the query come back, then a short pause before the next.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(answered.wait(), reply_timeout_s)
            await asyncio.sleep(pause_ms / 1000)
        result.lost = len(pending)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
    finally:
        await ws_cm.__aexit__(None, None, None)
    result.wall_s = time.perf_counter() - t_start
    return result


def format_summary(summary: dict[str, Any], budget_ms: float) -> str:
    rows = [f"{'stage':<10} {'P50 ms':>8} {'P95 ms':>8} {'P99 ms':>8}"]
    for name, v in summary["stages"].items():
        rows.append(f"{name:<10} {v['p50_ms']:>8.2f} {v['p95_ms']:>8.2f} {v['p99_ms']:>8.2f}")
    p95 = summary["stages"]["total"]["p95_ms"]
    verdict = "within" if p95 <= budget_ms else "OVER"
    rows.append(
        f"keystrokes sent {summary['keystrokes_sent']}, answered {summary['answered']}, "
        f"superseded {summary['superseded']}, lost {summary['lost']}, errors {summary['errors'] or 0}; "
        f"cache hit rate {summary['cache_hit_rate']:.1%}"
    )
    rows.append(f"P95 per keystroke {p95:.2f} ms: {verdict} the {budget_ms:g} ms budget")
    return "\n".join(rows)


def bench(url: str, *, n_queries: int = 200, key_interval_ms: float = 60.0, seed: int = 7,
          budget_ms: float = 20.0, out: Path | None = None) -> dict[str, Any]:
    if n_queries < 1:
        raise InvalidInput("--queries must be >= 1")
    if key_interval_ms < 0:
        raise InvalidInput("--key-interval-ms must be >= 0")
    queries = sample_queries(n_queries, seed=seed)
    result = asyncio.run(run_bench(url, queries, key_interval_ms=key_interval_ms))
    summary = {
        "bench": "demo-typeahead",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "url": url,
        "queries": n_queries,
        "key_interval_ms": key_interval_ms,
        "seed": seed,
        "budget_ms": budget_ms,
        **result.summary(),
    }
    print(format_summary(summary, budget_ms))
    if out is not None:
        atomic_write_text(out, json.dumps(summary, indent=2))
        print(f"wrote {out}")
    return summary
