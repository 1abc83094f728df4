"""Prometheus metrics: one histogram per request stage (geometric buckets), cache and queue counters.

Each Sidecar gets its own registry, so several can live in one process (tests, benchmarks).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from sidecar.timings import STAGES

# 10 µs .. ~10 s, doubling: the sidecar's own stages live at the bottom, inference in the middle.
LATENCY_BUCKETS = tuple(1e-5 * 2**i for i in range(21))
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class StageHistograms(Collector):
    """Per-stage latency histograms at ~0.3 µs an observation.

    prometheus_client's Histogram takes a lock and scans its buckets per observation (~4 µs): seven
    stages per request would spend a good part of a cache hit's budget on bookkeeping.
    """

    name = "embedcar_stage_seconds"

    def __init__(self, rpcs: tuple[str, ...] = ("embed", "search")) -> None:
        self._bounds = LATENCY_BUCKETS
        self._data: dict[tuple[str, str], list[float]] = {
            (rpc, s): [0.0] * (len(LATENCY_BUCKETS) + 2) for rpc in rpcs for s in STAGES}  # counts..., +Inf, sum

    def observe(self, rpc: str, timings_ns: dict[str, int]) -> None:
        bounds = self._bounds
        for stage, ns in timings_ns.items():
            row = self._data[(rpc, stage)]
            sec = ns * 1e-9
            row[bisect.bisect_left(bounds, sec)] += 1
            row[-1] += sec

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, "Time per request stage.", labels=["rpc", "stage"])
        for (rpc, stage), row in self._data.items():
            cum = 0.0
            buckets = []
            for le, n in zip((*(f"{b:.6g}" for b in self._bounds), "+Inf"), row[:-1], strict=True):
                cum += n
                buckets.append((le, cum))
            fam.add_metric([rpc, stage], buckets, row[-1])
        yield fam


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.stages = StageHistograms()
        r.register(self.stages)
        self.requests = Counter("embedcar_requests", "Requests by rpc and outcome code.", ["rpc", "code"], registry=r)
        self.cache_hits = Counter("embedcar_cache_hits", "Texts answered from the cache.", registry=r)
        self.cache_misses = Counter("embedcar_cache_misses", "Texts not in the cache.", registry=r)
        self.singleflight_joins = Counter("embedcar_singleflight_joins",
                                          "Misses that joined an in-flight computation.", registry=r)
        self.rejections = Counter("embedcar_rejections", "Requests refused: unauthenticated, rate_limit, admission, "
                                  "deadline.", ["reason"], registry=r)
        self.backend_errors = Counter("embedcar_backend_errors", "Backend failures by kind.", ["kind"], registry=r)
        self.batch_size = Histogram("embedcar_batch_size", "Texts per backend call.", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.backend_answers = Counter("embedcar_backend_answers", "Backend calls by the backend that answered "
                                       "(embedded-fallback: the embedded model while the backend was down).",
                                       ["backend"], registry=r)
        self.backend_up = Gauge("embedcar_backend_up", "1 while the backend serves.", registry=r)
        self.cache_entries = Gauge("embedcar_cache_entries", "Entries in the embedding cache.", registry=r)
        self.model_switches = Counter("embedcar_model_switches", "Served model versions switched by a rollout "
                                      "(or a rollback), each with its index.", registry=r)
        self.model_info = Gauge("embedcar_model_info", "1 per model version in service (name, version id).",
                                ["model", "version"], registry=r)
        self.gc_pause = Histogram("embedcar_gc_pause_seconds", "Garbage-collector pauses of the sidecar's process "
                                  "by generation (2 = full), each stopping every request in flight.",
                                  ["generation"], buckets=LATENCY_BUCKETS, registry=r)
        self._gc_pause = [self.gc_pause.labels(str(g)) for g in range(3)]

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self._gc_pause[min(generation, 2)].observe(seconds)

    def observe_timings(self, rpc: str, timings_ns: dict[str, int]) -> None:
        self.stages.observe(rpc, timings_ns)

    def render(self) -> bytes:
        return generate_latest(self.registry)
