"""The metrics reference page (docs/metrics.md), written from a live `Metrics` registry.

Name, type and help come from what the registry exports; label names from each metric's
declaration; the values a label takes from its series where they exist from the start (stages, GC
generations); what to alert on from `sidecar.metrics.ALERTS`, so a new metric without guidance
fails the reference test instead of reaching the page silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from sidecar.metrics import ALERTS, Metrics

HEADER = """\
# Metrics

Every Prometheus metric the sidecar exports, generated from its registry (`sidecar/metrics.py`) by
`embedcar docs reference` (do not edit by hand; a test fails when this page and the code disagree).

Scrape `GET /metrics` on the sidecar's HTTP port (`EMBEDCAR_SIDECAR_HTTP_PORT`, default 8080); with
API keys set it needs one, like the other HTTP routes. Each sidecar process has its own registry: with
several processes per host, scrape each. Triton exports its own metrics on
`EMBEDCAR_TRITON_METRICS_PORT` (see Triton's documentation); the catalog job, the demo and the load
test export none.
"""


@dataclass(frozen=True, slots=True)
class MetricRow:
    name: str  # the family name; counters are exported as name + "_total"
    type: str  # counter, gauge, histogram
    labels: dict[str, tuple[str, ...]]  # label name -> values present from the start (may be empty)
    help: str
    alert: str

    @property
    def series(self) -> str:
        if self.type == "counter":
            return f"{self.name}_total"
        if self.type == "histogram":
            return f"{self.name}_bucket, _sum, _count"
        return self.name


def metric_rows(metrics: Metrics | None = None) -> list[MetricRow]:
    """Every exported family, in registration order. KeyError names a metric missing from ALERTS."""
    metrics = metrics or Metrics()
    declared = _declared_labels(metrics)
    rows = []
    for fam in metrics.registry.collect():
        values: dict[str, dict[str, None]] = {name: {} for name in declared.get(fam.name, ())}
        for sample in fam.samples:
            for key, value in sample.labels.items():
                if key != "le":
                    values.setdefault(key, {})[value] = None
        if fam.name not in ALERTS:
            raise KeyError(f"metric {fam.name} has no entry in sidecar.metrics.ALERTS (what to alert on)")
        rows.append(MetricRow(fam.name, fam.type, {k: tuple(v) for k, v in values.items()},
                              " ".join(fam.documentation.split()), ALERTS[fam.name]))
    return rows


def _declared_labels(metrics: Metrics) -> dict[str, tuple[str, ...]]:
    """Family name -> label names, for metrics that have no series until first used (a labelled
    counter): prometheus_client keeps them as `_labelnames`; our own collectors as `labelnames`."""
    out: dict[str, tuple[str, ...]] = {}
    for collector in vars(metrics).values():
        if isinstance(collector, CollectorRegistry) or not hasattr(collector, "collect"):
            continue
        names = tuple(getattr(collector, "_labelnames", ()) or getattr(collector, "labelnames", ()))
        for fam in collector.collect():
            out[fam.name] = names
    return out


def metrics_page(metrics: Metrics | None = None) -> str:
    lines = [HEADER, "| Series | Type | Labels | Meaning | Alert on |", "|---|---|---|---|---|"]
    for row in metric_rows(metrics):
        labels = "; ".join(f"`{k}`" + (f" ({', '.join(v)})" if v else "") for k, v in row.labels.items()) or "none"
        cells = (f"`{row.series}`", row.type, labels, row.help, row.alert)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
