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
    labelnames = ("rpc", "stage")

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
        fam = HistogramMetricFamily(self.name, "Time per request stage.", labels=list(self.labelnames))
        for (rpc, stage), row in self._data.items():
            cum = 0.0
            buckets = []
            for le, n in zip((*(f"{b:.6g}" for b in self._bounds), "+Inf"), row[:-1], strict=True):
                cum += n
                buckets.append((le, cum))
            fam.add_metric([rpc, stage], buckets, row[-1])
        yield fam


# What to alert on, per metric: the operator's half of the reference page (docs/metrics.md,
# sidecar/metrics_reference.py), kept here so a new metric without it fails the reference test.
ALERTS: dict[str, str] = {
    "embedcar_stage_seconds": "P99 of stage=total (rpc=embed) above the callers' budget for 5 min; a rise in "
    "stage=queue with flat stage=inference means the sidecar needs more cores, not a faster model.",
    "embedcar_requests": "Share of code!=ok above 1 % for 5 min: unavailable or internal points at the "
    "backend, invalid_argument at a caller, resource_exhausted or shed at capacity.",
    "embedcar_cache_hits": "Dashboard: hit ratio hits / (hits + misses). A sudden drop after a deploy means a "
    "cold or disabled cache (sidecar.cache_entries).",
    "embedcar_cache_misses": "See embedcar_cache_hits; misses are what reach the model.",
    "embedcar_singleflight_joins": "No alert: how many misses shared another request's computation.",
    "embedcar_rejections": "Any sustained reason=admission or reason=shed: traffic past capacity (add "
    "sidecars or cores); reason=unauthenticated: a caller with a wrong key; reason=rate_limit: a tenant "
    "past its sidecar.rate_per_s.",
    "embedcar_backend_errors": "Any sustained rate: the backend (Triton or the embedded model) is failing.",
    "embedcar_batch_size": "No alert: rows per backend call (batching at work under load).",
    "embedcar_backend_answers": "backend=embedded-fallback above zero: Triton is down and the in-process model "
    "answers in its place.",
    "embedcar_backend_up": "0 for more than a minute (the backend is down; with embedded_fallback the "
    "in-process model answers meanwhile).",
    "embedcar_cache_entries": "No alert: the cache's fill (at most sidecar.cache_entries).",
    "embedcar_model_switches": "Dashboard: each rollout or rollback; more than expected means flapping "
    "versions.",
    "embedcar_model_info": "Dashboard: the version each served model answers with (a rollout replaces the "
    "series); no series at all: nothing in service.",
    "embedcar_gc_pause_seconds": "P99 of generation=2 above a few ms: full collections are pausing every "
    "request (the heap is not frozen, see inference/heap.py).",
}


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
                                  "deadline, shed.", ["reason"], registry=r)
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
