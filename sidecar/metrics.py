"""Prometheus metrics: one histogram per request stage (geometric buckets), cache and queue counters.

Each Sidecar gets its own registry, so several can live in one process (tests, benchmarks).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from sidecar.timings import STAGES

# 10 µs .. ~10 s, doubling: the sidecar's own stages live at the bottom, inference in the middle.
LATENCY_BUCKETS = tuple(1e-5 * 2**i for i in range(21))
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The series of what one served model does carry its name and version id: a rollout starts new
# series for the new version and removes the retired version's (ModelMetrics.retire).
MODEL_LABELS = ("model", "version")


class StageHistograms(Collector):
    """Per-stage latency histograms at ~0.3 µs an observation, one set per (rpc, model, version).

    prometheus_client's Histogram takes a lock and scans its buckets per observation (~4 µs): seven
    stages per request would spend a good part of a cache hit's budget on bookkeeping.
    """

    name = "embedcar_stage_seconds"
    labelnames = ("rpc", "stage", *MODEL_LABELS)

    def __init__(self) -> None:
        self._bounds = LATENCY_BUCKETS
        self._data: dict[tuple[str, str, str], dict[str, list[float]]] = {}  # (rpc, model, version) -> stage -> row

    def rows(self, rpc: str, model: str, version: str) -> dict[str, list[float]]:
        """The rows one (rpc, model version) observes into: counts per bucket..., +Inf, sum."""
        key = (rpc, model, version)
        rows = self._data.get(key)
        if rows is None:
            rows = self._data[key] = {s: [0.0] * (len(LATENCY_BUCKETS) + 2) for s in STAGES}
        return rows

    def observe(self, rows: dict[str, list[float]], timings_ns: dict[str, int]) -> None:
        bounds = self._bounds
        for stage, ns in timings_ns.items():
            row = rows[stage]
            sec = ns * 1e-9
            row[bisect.bisect_left(bounds, sec)] += 1
            row[-1] += sec

    def remove(self, model: str, version: str) -> None:
        for key in [k for k in self._data if k[1:] == (model, version)]:
            del self._data[key]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, "Time per request stage.", labels=list(self.labelnames))
        for (rpc, model, version), rows in list(self._data.items()):
            for stage, row in rows.items():
                cum = 0.0
                buckets = []
                for le, n in zip((*(f"{b:.6g}" for b in self._bounds), "+Inf"), row[:-1], strict=True):
                    cum += n
                    buckets.append((le, cum))
                fam.add_metric([rpc, stage, model, version], buckets, row[-1])
        yield fam


# What to alert on, per metric: the operator's half of the reference page (docs/metrics.md,
# sidecar/metrics_reference.py), kept here so a new metric without it fails the reference test.
ALERTS: dict[str, str] = {
    "embedcar_stage_seconds": "P99 of stage=total (rpc=embed) above the callers' budget for 5 min; a rise in "
    "stage=queue with flat stage=inference means the sidecar needs more cores, not a faster model.",
    "embedcar_requests": "Share of code!=ok above 1 % for 5 min: unavailable or internal points at the "
    "backend, invalid_argument at a caller, resource_exhausted or shed at capacity.",
    "embedcar_cache_hits": "Dashboard: hit ratio hits / (hits + misses), per model. A sudden drop after a "
    "deploy means a cold or disabled cache (sidecar.cache_entries).",
    "embedcar_cache_misses": "See embedcar_cache_hits; misses are what reach the model.",
    "embedcar_singleflight_joins": "No alert: how many misses shared another request's computation.",
    "embedcar_rejections": "Any sustained reason=admission or reason=shed: traffic past capacity (add "
    "sidecars or cores); reason=unauthenticated: a caller with a wrong key; reason=rate_limit: a tenant "
    "past its sidecar.rate_per_s.",
    "embedcar_backend_errors": "Any sustained rate: the backend (Triton or the embedded model) is failing.",
    "embedcar_batch_size": "No alert: rows per backend call (batching at work under load).",
    "embedcar_forward_passes": "No alert: embedded forward passes by the thread that ran them; thread=loop "
    "while queries arrive sparsely (no thread hop), thread=worker under load.",
    "embedcar_backend_answers": "backend=embedded-fallback above zero: Triton is down and the in-process model "
    "answers in its place.",
    "embedcar_backend_up": "0 for more than a minute (the backend is down; with embedded_fallback the "
    "in-process model answers meanwhile).",
    "embedcar_serving": "0 for more than a minute: health says NOT_SERVING (a backend down without fallback, "
    "or a listener not answering; see embedcar_listener_up).",
    "embedcar_listener_up": "0 on any listener: it did not answer the sidecar's own check on a new connection; "
    "the process exits once one stays silent for sidecar.listener_dead_s.",
    "embedcar_cache_entries": "No alert: the cache's fill (at most sidecar.cache_entries).",
    "embedcar_model_switches": "Dashboard: each rollout or rollback; more than expected means flapping "
    "versions.",
    "embedcar_model_info": "Dashboard: the version each served model answers with (a rollout replaces the "
    "series, and the retired version's other series go with it); no series: nothing in service.",
    "embedcar_gc_pause_seconds": "P99 of generation=2 above a few ms: full collections are pausing every "
    "request (the heap is not frozen, see inference/heap.py).",
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        m = MODEL_LABELS
        self.stages = StageHistograms()
        r.register(self.stages)
        self.requests = Counter("embedcar_requests", "Requests by rpc and outcome code.", ["rpc", "code"], registry=r)
        self.rejections = Counter("embedcar_rejections", "Requests refused: unauthenticated, rate_limit, shed, "
                                  "admission, deadline.", ["reason"], registry=r)
        self.cache_hits = Counter("embedcar_cache_hits", "Texts answered from the cache.", m, registry=r)
        self.cache_misses = Counter("embedcar_cache_misses", "Texts not in the cache.", m, registry=r)
        self.singleflight_joins = Counter("embedcar_singleflight_joins",
                                          "Misses that joined an in-flight computation.", m, registry=r)
        self.backend_errors = Counter("embedcar_backend_errors", "Backend failures by kind.", [*m, "kind"],
                                      registry=r)
        self.batch_size = Histogram("embedcar_batch_size", "Texts per backend call.", m, buckets=BATCH_BUCKETS,
                                    registry=r)
        self.forward_passes = Counter("embedcar_forward_passes", "Embedded micro-batcher's forward passes by the "
                                      "thread that ran them (loop | worker).", [*m, "thread"], registry=r)
        self.backend_answers = Counter("embedcar_backend_answers", "Backend calls by the backend that answered "
                                       "(embedded-fallback: the embedded model while the backend was down).",
                                       [*m, "backend"], registry=r)
        self.backend_up = Gauge("embedcar_backend_up", "1 while the model's backend serves.", m, registry=r)
        self.serving = Gauge("embedcar_serving", "1 while health says SERVING (HTTP /health and gRPC health "
                             "alike).", registry=r)
        self.listener_up = Gauge("embedcar_listener_up", "1 while the listener (grpc, uds, http) answered the "
                                 "sidecar's last check on a new connection.", ["listener"], registry=r)
        self.cache_entries = Gauge("embedcar_cache_entries", "Entries in the model's embedding cache.", m,
                                   registry=r)
        self.model_switches = Counter("embedcar_model_switches", "Served model versions switched by a rollout "
                                      "(or a rollback), each with its index.", registry=r)
        self.model_info = Gauge("embedcar_model_info", "1 per model version in service (name, version id).",
                                m, registry=r)
        self.gc_pause = Histogram("embedcar_gc_pause_seconds", "Garbage-collector pauses of the sidecar's process "
                                  "by generation (2 = full), each stopping every request in flight.",
                                  ["generation"], buckets=LATENCY_BUCKETS, registry=r)
        self._gc_pause = [self.gc_pause.labels(str(g)) for g in range(3)]
        # ServedModels holding each version's series: a rollback can bring a version back while its
        # retired twin still drains, and that twin's retirement must not remove the live series.
        self.holders: collections.Counter[tuple[str, str]] = collections.Counter()

    def for_model(self, model: str, version: str) -> ModelMetrics:
        return ModelMetrics(self, model, version)

    def observe_listener(self, listener: str, up: bool) -> None:
        self.listener_up.labels(listener).set(1 if up else 0)

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self._gc_pause[min(generation, 2)].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One served model version's series, bound once (a `labels()` lookup costs ~15 µs a request)."""

    def __init__(self, metrics: Metrics, model: str, version: str) -> None:
        self._metrics = metrics
        self.labels = (model, version)
        self.cache_hits = metrics.cache_hits.labels(model, version)
        self.cache_misses = metrics.cache_misses.labels(model, version)
        self.singleflight_joins = metrics.singleflight_joins.labels(model, version)
        self.batch_size = metrics.batch_size.labels(model, version)
        self.passes_on_loop = metrics.forward_passes.labels(model, version, "loop")
        self.passes_on_worker = metrics.forward_passes.labels(model, version, "worker")
        self.backend_up = metrics.backend_up.labels(model, version)
        self.cache_entries = metrics.cache_entries.labels(model, version)
        self.rejected_admission = metrics.rejections.labels("admission")
        self.rejected_deadline = metrics.rejections.labels("deadline")
        self._stages = {rpc: metrics.stages.rows(rpc, model, version) for rpc in ("embed", "search")}
        self._answers: dict[str, Any] = {}
        self._retired = False
        metrics.holders[self.labels] += 1
        self.backend_up.set(1)

    def observe_timings(self, rpc: str, timings_ns: dict[str, int]) -> None:
        self._metrics.stages.observe(self._stages[rpc], timings_ns)

    def answered(self, backend: str) -> None:
        counter = self._answers.get(backend)
        if counter is None:
            counter = self._answers[backend] = self._metrics.backend_answers.labels(*self.labels, backend)
        counter.inc()

    def backend_error(self, kind: str) -> None:
        self._metrics.backend_errors.labels(*self.labels, kind).inc()

    def retire(self) -> None:
        """Remove this version's series once no served model holds them (a rollout replaced it)."""
        m = self._metrics
        if self._retired:
            return
        self._retired = True
        m.holders[self.labels] -= 1
        if m.holders[self.labels] > 0:
            return
        del m.holders[self.labels]
        m.stages.remove(*self.labels)
        for family in (m.cache_hits, m.cache_misses, m.singleflight_joins, m.batch_size, m.backend_up,
                       m.cache_entries):
            with contextlib.suppress(KeyError):
                family.remove(*self.labels)
        for family in (m.backend_answers, m.backend_errors, m.forward_passes):  # (model, version, a third label)
            for labels in list(family._metrics):  # prometheus_client keeps no public list of children
                if labels[:2] == self.labels:
                    family.remove(*labels)
