"""Numbers, verdict and pictures of a load test run: JSON, Markdown and a PNG per run.

Latency percentiles are over successful requests, measured from the scheduled send time; errors
count separately by code and the SLA needs both a P95 within budget and an error share within its
limit (a server that rejects most requests fast must not pass). Triton's per-model statistics are
diffed over the measured window, so queue vs compute time and the average batch size
(inferences / executions) show where the server spends its time.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from inference.files import atomic_write_text
from loadtest.runner import OK, RunResult, Sample

PERCENTILES = (50, 90, 95, 99)
Summary = dict[str, Any]


def target_label(s: Summary) -> str:
    """"sidecar-embed:triton" where the CLI recorded the spec, else the target's own name."""
    t = s.get("target", {})
    return str(t.get("spec") or t.get("target") or "?")


def latency_stats(ms: np.ndarray) -> dict[str, float | None]:
    if len(ms) == 0:
        return {"p50": None, "p90": None, "p95": None, "p99": None, "max": None, "mean": None, "min": None}
    out: dict[str, float | None] = {f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}
    out |= {"max": float(ms.max()), "mean": float(ms.mean()), "min": float(ms.min())}
    return out


def summarize(result: RunResult, *, name: str, sla_ms: float = 20.0, max_error_share: float = 0.01) -> Summary:
    cfg = result.config
    measured = result.measured
    ok = [s for s in measured if s.code == OK]
    lat = np.array([s.latency_s * 1e3 for s in ok], dtype=np.float64)
    stats = latency_stats(lat)
    errors = dict(Counter(s.code for s in measured if s.code != OK))
    n = len(measured)
    error_share = (n - len(ok)) / n if n else 1.0
    # Achieved rate: answers per second over the window, stretched when replies trail past its end.
    end = max([cfg.duration_s, *(s.scheduled_s + s.latency_s for s in measured)])
    p95 = stats["p95"]
    passed = p95 is not None and p95 <= sla_ms and error_share <= max_error_share
    reason = ("no successful request" if p95 is None else
              f"P95 {p95:.2f} ms {'<=' if p95 <= sla_ms else '>'} {sla_ms:g} ms, "
              f"errors {error_share:.2%} {'<=' if error_share <= max_error_share else '>'} {max_error_share:.2%}")
    send_lag = np.array([s.send_lag_s * 1e3 for s in measured], dtype=np.float64)
    return {
        "name": name,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "target": result.target,
        "config": asdict(cfg),
        "requests": n,
        "ok": len(ok),
        "offered_rate": n / cfg.duration_s,
        "achieved_rate": len(ok) / end if end > 0 else 0.0,
        "latency_ms": stats,
        "errors": errors,
        "error_share": error_share,
        "error_examples": result.errors_seen,
        "sla": {"p95_budget_ms": sla_ms, "max_error_share": max_error_share, "pass": passed, "reason": reason},
        "generator": {
            "lag_p50_ms": result.pacer.lag_p50_ms,
            "lag_p99_ms": result.pacer.lag_p99_ms,
            "lag_max_ms": result.pacer.lag_max_ms,
            "late_share": result.pacer.late_share,
            "late_ms": result.pacer.late_ms,
            "kept_schedule": result.pacer.kept,
            "warning": result.pacer.warning(),
            "cpu_s": result.generator_cpu_s,
            "cpu_share_of_one_core": result.generator_cpu_s / result.wall_s if result.wall_s else 0.0,
        },
        "send_lag_ms": {k: v for k, v in latency_stats(send_lag).items() if k in ("p50", "p99", "max")},
        "stages_ms": stage_stats(ok),
        "triton": triton_window(result.stats_before, result.stats_after),
        "timeline": timeline(measured, cfg.duration_s),
    }


def stage_stats(samples: Sequence[Sample]) -> dict[str, dict[str, float]]:
    """Mean/P50/P95 per stage of the server-reported timings (sidecar stages, client tokenize...).

    `outside_server` is what the server's own `total` does not cover: the network hop, the client
    library and the load generator's event loop (send lag excluded; it is reported separately).
    """
    per: dict[str, list[float]] = {}
    for s in samples:
        for k, v in (s.timings_ns or {}).items():
            per.setdefault(k, []).append(v / 1e6)
        if s.timings_ns and "total" in s.timings_ns:
            outside = (s.latency_s - s.send_lag_s) * 1e3 - s.timings_ns["total"] / 1e6
            per.setdefault("outside_server", []).append(outside)
    return {k: {"mean": float(np.mean(v)), "p50": float(np.percentile(v, 50)), "p95": float(np.percentile(v, 95))}
            for k, v in per.items()}


def triton_window(before: dict[str, dict[str, int]] | None,
                  after: dict[str, dict[str, int]] | None) -> dict[str, dict[str, float]] | None:
    """Per-model averages over the window from two cumulative snapshots."""
    if not before or not after:
        return None
    out: dict[str, dict[str, float]] = {}
    for model, a in after.items():
        b = before.get(model, {})
        d = {k: a.get(k, 0) - b.get(k, 0) for k in a}
        inferences, executions = d.get("inference_count", 0), d.get("execution_count", 0)
        if inferences == 0 and d.get("success_count", 0) == 0:
            continue
        row: dict[str, float] = {
            "requests": float(d.get("success_count", 0)),
            "failed": float(d.get("fail_count", 0)),
            "inferences": float(inferences),
            "executions": float(executions),
            "avg_batch": inferences / executions if executions else 0.0,
        }
        for part in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
            count = d.get(f"{part}_count", 0)
            row[f"{part}_us"] = d.get(f"{part}_ns", 0) / count / 1e3 if count else 0.0
        out[model] = row
    return out


def timeline(samples: Sequence[Sample], duration_s: float, *, step_s: float = 1.0) -> list[dict[str, float]]:
    """Per-second sends, successes and P50/P95/P99 (binned by scheduled time)."""
    bins = int(np.ceil(duration_s / step_s))
    slot = np.array([int(s.scheduled_s // step_s) for s in samples], dtype=np.int64)
    ok = np.array([s.code == OK for s in samples], dtype=bool)
    lat = np.array([s.latency_s * 1e3 for s in samples], dtype=np.float64)
    rows = []
    for k in range(bins):
        here = slot == k
        good = lat[here & ok]
        row = {"t": k * step_s, "sent": float(here.sum()), "ok": float(len(good))}
        if len(good):
            row |= {f"p{p}": float(np.percentile(good, p)) for p in (50, 95, 99)}
        rows.append(row)
    return rows


# --- files ---------------------------------------------------------------------------------------

def write_run(result: RunResult, summary: Summary, out_dir: Path) -> dict[str, Path]:
    """<name>.json (summary), <name>.md, <name>.png and <name>.samples.csv (every request)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / summary["name"]
    paths = {"json": base.with_suffix(".json"), "md": base.with_suffix(".md"), "png": base.with_suffix(".png"),
             "csv": out_dir / f"{summary['name']}.samples.csv"}
    atomic_write_text(paths["json"], json.dumps(summary, indent=2, sort_keys=True) + "\n")
    atomic_write_text(paths["md"], markdown(summary))
    atomic_write_text(paths["csv"], samples_csv(result.samples))
    plot_run(result, summary, paths["png"])
    return paths


def samples_csv(samples: Sequence[Sample]) -> str:
    lines = ["index,scheduled_s,send_lag_ms,latency_ms,code,warmup"]
    lines += [f"{s.index},{s.scheduled_s:.6f},{s.send_lag_s * 1e3:.4f},{s.latency_s * 1e3:.4f},{s.code},{int(s.warmup)}"
              for s in samples]
    return "\n".join(lines) + "\n"


def fmt_ms(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def cpu_per_request(result: RunResult, servers_s: dict[str, float]) -> dict[str, float]:
    """CPU ms per request (warm-up included) of the generator and of each started server."""
    n = max(len(result.samples), 1)
    return {"load generator": result.generator_cpu_s * 1e3 / n} | {k: v * 1e3 / n for k, v in servers_s.items()}


def markdown(s: Summary) -> str:
    cfg, lat, gen, sla = s["config"], s["latency_ms"], s["generator"], s["sla"]
    verdict = "PASS" if sla["pass"] else "FAIL"
    lines = [
        f"# Load test `{s['name']}`: {target_label(s)} — SLA {verdict}",
        "",
        f"{s['created']}; {cfg['arrivals']} arrivals at {cfg['rate']:g}/s for {cfg['duration_s']:g} s "
        f"(+{cfg['warmup_s']:g} s warm-up, not counted), batch {cfg['batch']}, concurrency cap {cfg['concurrency']}, "
        f"deadline {cfg['deadline_ms']:g} ms, seed {cfg['seed']}. Target: "
        + ", ".join(f"{k}={v}" for k, v in s["target"].items() if v) + ".",
        "",
        f"SLA: {sla['reason']} → **{verdict}**.",
        "",
        "| requests | ok | offered/s | achieved/s | P50 ms | P90 ms | P95 ms | P99 ms | max ms | mean ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['requests']} | {s['ok']} | {s['offered_rate']:.1f} | {s['achieved_rate']:.1f} | "
        + " | ".join(fmt_ms(lat[k]) for k in ("p50", "p90", "p95", "p99", "max", "mean")) + " |",
        "",
        "Latency is measured from each request's scheduled send time (open loop, no coordinated omission).",
        "",
    ]
    if s["errors"]:
        lines += ["## Errors by code", "", "| code | count | example |", "|---|---:|---|"]
        lines += [f"| {code} | {count} | {s['error_examples'].get(code, '')[:120]} |"
                  for code, count in sorted(s["errors"].items())]
        lines.append("")
    if s["stages_ms"]:
        lines += ["## Where the time goes (server-reported stages, successful requests)", "",
                  "| stage | mean ms | P50 ms | P95 ms |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['mean']:.3f} | {v['p50']:.3f} | {v['p95']:.3f} |" for k, v in s["stages_ms"].items()]
        lines.append("")
    if s["triton"]:
        lines += ["## Triton per-model statistics over the window", "",
                  "| model | requests | inferences | executions | avg batch | queue µs | input µs | infer µs "
                  "| output µs | total µs |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {m} | {r['requests']:.0f} | {r['inferences']:.0f} | {r['executions']:.0f} | {r['avg_batch']:.2f} "
                  f"| {r['queue_us']:.0f} | {r['compute_input_us']:.0f} | {r['compute_infer_us']:.0f} "
                  f"| {r['compute_output_us']:.0f} | {r['success_us']:.0f} |" for m, r in s["triton"].items()]
        lines.append("")
    if s.get("triton_phases_us"):
        lines += ["## Inside Triton, per request (its traces, measured window), P50 / P95 µs", "",
                  "| model | phase | P50 µs | P95 µs |", "|---|---|---:|---:|"]
        lines += [f"| {m} | {ph} | {p50:.0f} | {p95:.0f} |" for m, phases in s["triton_phases_us"].items()
                  for ph, (p50, p95) in phases.items()]
        lines.append("")
    if s.get("cpu_ms_per_request"):
        cores = os.cpu_count() or 1
        rate = s["config"]["rate"]
        lines += [f"## CPU per request (warm-up included), against {cores} cores at {rate:g}/s", "",
                  "| process | CPU ms per request | share of the machine |", "|---|---:|---:|"]
        cpu = s["cpu_ms_per_request"]
        lines += [f"| {k} | {v:.2f} | {v * rate / 1e3 / cores:.0%} |" for k, v in cpu.items()]
        total = sum(cpu.values())
        lines += [f"| **all** | **{total:.2f}** | **{total * rate / 1e3 / cores:.0%}** |", ""]
    lines += [
        "## Load generator",
        "",
        f"Release lag P50 {gen['lag_p50_ms']:.2f} ms, P99 {gen['lag_p99_ms']:.2f} ms, max {gen['lag_max_ms']:.2f} ms; "
        f"{gen['late_share']:.2%} released more than {gen['late_ms']:g} ms late; "
        f"send lag incl. concurrency-cap wait P99 {fmt_ms(s['send_lag_ms']['p99'])} ms; "
        f"generator CPU {gen['cpu_s']:.1f} s ({gen['cpu_share_of_one_core']:.0%} of one core).",
        "",
    ]
    if gen["warning"]:
        lines += [f"**Warning:** {gen['warning']}.", ""]
    return "\n".join(lines)


def plot_run(result: RunResult, summary: Summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = result.measured
    ok = [s for s in measured if s.code == OK]
    bad = [s for s in measured if s.code != OK]
    sla = summary["sla"]["p95_budget_ms"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), constrained_layout=True)
    ax1.scatter([s.scheduled_s for s in ok], [s.latency_s * 1e3 for s in ok], s=2, alpha=0.4, label="ok")
    if bad:
        ax1.scatter([s.scheduled_s for s in bad], [s.latency_s * 1e3 for s in bad], s=8, marker="x",
                    color="tab:red", label="error")
    tl = [r for r in summary["timeline"] if "p95" in r]
    if tl:
        ax1.plot([r["t"] + 0.5 for r in tl], [r["p95"] for r in tl], color="black", lw=1, label="P95 per second")
    ax1.axhline(sla, color="tab:orange", ls="--", label=f"SLA {sla:g} ms")
    ax1.set_yscale("log")
    ax1.set_xlabel("scheduled send time (s)")
    ax1.set_ylabel("latency (ms)")
    ax1.set_title(f"{summary['name']}: {target_label(summary)} at {summary['config']['rate']:g}/s")
    ax1.legend(loc="upper right", fontsize=8)
    lat = np.array([s.latency_s * 1e3 for s in ok])
    if len(lat):
        lo, hi = max(lat.min(), 1e-3), max(lat.max(), sla) * 1.05
        ax2.hist(lat, bins=np.geomspace(lo, hi, 80))
        for p, style in ((50, ":"), (95, "-"), (99, "--")):
            ax2.axvline(float(np.percentile(lat, p)), color="black", ls=style, lw=1, label=f"P{p}")
        ax2.axvline(sla, color="tab:orange", ls="--", label="SLA")
        ax2.set_xscale("log")
        ax2.legend(fontsize=8)
    ax2.set_xlabel("latency (ms)")
    ax2.set_ylabel("requests")
    save_png(fig, path)
    plt.close(fig)


def save_png(fig: Any, path: Path) -> None:
    """Render to a temp file in the same folder and rename: no half-written PNG."""
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    tmp.replace(path)


# --- side by side --------------------------------------------------------------------------------

def comparison_markdown(summaries: Sequence[Summary], *, title: str = "Side by side") -> str:
    first = summaries[0]["config"] if summaries else {}
    lines = [
        f"# {title}",
        "",
        (f"Same query stream for every target: {first.get('arrivals')} arrivals at {first.get('rate')}/s for "
         f"{first.get('duration_s')} s, batch {first.get('batch')}, seed {first.get('seed')}." if first else ""),
        "",
        "| target | run | P50 ms | P90 ms | P95 ms | P99 ms | max ms | mean ms | achieved/offered | errors | SLA "
        "| gen. lag P99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for s in summaries:
        lat = s["latency_ms"]
        errors = ", ".join(f"{k} {v}" for k, v in sorted(s["errors"].items())) or "0"
        lines.append(
            f"| {target_label(s)} | {s['name']} | {fmt_ms(lat['p50'])} | {fmt_ms(lat['p90'])} | "
            f"{fmt_ms(lat['p95'])} | {fmt_ms(lat['p99'])} | {fmt_ms(lat['max'])} | {fmt_ms(lat['mean'])} | "
            f"{s['achieved_rate']:.1f}/{s['offered_rate']:.1f} | {errors} | {'PASS' if s['sla']['pass'] else 'FAIL'} | "
            f"{s['generator']['lag_p99_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def write_comparison(summaries: Sequence[Summary], out_dir: Path, name: str) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md", "png": out_dir / f"{name}.png"}
    atomic_write_text(paths["json"], json.dumps({"name": name, "runs": list(summaries)}, indent=2, sort_keys=True)
                      + "\n")
    atomic_write_text(paths["md"], comparison_markdown(summaries, title=f"Side by side: {name}"))
    fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
    ps = [50, 75, 90, 95, 99, 99.9]
    for s in summaries:
        lat = s["latency_ms"]
        if lat["p50"] is None:
            continue
        # The summary keeps only the headline percentiles; plot those as a percentile curve.
        ys = [lat["p50"], None, lat["p90"], lat["p95"], lat["p99"], lat["max"]]
        pts = [(p, y) for p, y in zip(ps, ys, strict=True) if y is not None]
        ax.plot([str(p) if p != 99.9 else "max" for p, _ in pts], [y for _, y in pts], marker="o",
                label=f"{target_label(s)} ({s['name']})")
    if summaries:
        ax.axhline(summaries[0]["sla"]["p95_budget_ms"], color="tab:orange", ls="--", label="SLA")
    ax.set_yscale("log")
    ax.set_xlabel("percentile")
    ax.set_ylabel("latency (ms)")
    ax.legend(fontsize=8)
    save_png(fig, paths["png"])
    plt.close(fig)
    return paths
