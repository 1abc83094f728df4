"""Step the offered rate up and find the highest rate that still meets the SLA."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.errors import InvalidInput
from inference.files import atomic_write_text
from loadtest.report import Summary, fmt_ms, save_png, summarize, target_label
from loadtest.runner import RunConfig, run_load
from loadtest.targets import Target

log = logging.getLogger(__name__)


def parse_sweep(spec: str) -> list[float]:
    """"START:STOP:STEP" -> [START, START+STEP, ..., <= STOP]."""
    try:
        start, stop, step = (float(x) for x in spec.split(":"))
    except ValueError as exc:
        raise InvalidInput(f"--sweep wants START:STOP:STEP (e.g. 50:300:25), got {spec!r}") from exc
    if start <= 0 or step <= 0 or stop < start:
        raise InvalidInput(f"--sweep needs 0 < START <= STOP and STEP > 0, got {spec!r}")
    rates, r = [], start
    while r <= stop + 1e-9:
        rates.append(round(r, 6))
        r += step
    return rates


@dataclass(slots=True)
class SweepResult:
    name: str
    steps: list[Summary]
    best_rate: float | None  # highest rate whose run met the SLA (None: not even the first)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "best_rate": self.best_rate, "steps": self.steps}


async def sweep(
    target: Target,
    rates: Sequence[float],
    base: RunConfig,
    next_texts: Callable[[int], Sequence[str]],
    *,
    name: str,
    sla_ms: float = 20.0,
    max_error_share: float = 0.01,
    stop_after_failures: int = 1,
    label: str | None = None,
) -> SweepResult:
    """One run per rate, lowest first; stops after `stop_after_failures` failing steps in a row.

    `next_texts(n)` gives each step fresh queries, so with --no-cache a later step never hits the
    cache with an earlier step's texts.
    """
    steps: list[Summary] = []
    best: float | None = None
    failures = 0
    for rate in rates:
        cfg = dataclasses.replace(base, rate=rate)
        result = await run_load(target, next_texts(cfg.requests * cfg.batch), cfg)
        summary = summarize(result, name=f"{name}-{rate:g}", sla_ms=sla_ms, max_error_share=max_error_share)
        if label:
            summary["target"]["spec"] = label
        steps.append(summary)
        lat = summary["latency_ms"]
        log.info("sweep %s: %g/s P95 %s ms, errors %.2f%% -> %s", name, rate, fmt_ms(lat["p95"]),
                 100 * summary["error_share"], "pass" if summary["sla"]["pass"] else "FAIL")
        if summary["sla"]["pass"]:
            best, failures = rate if best is None else max(best, rate), 0
        else:
            failures += 1
            if failures >= stop_after_failures:
                break
    return SweepResult(name, steps, best)


def sweep_markdown(res: SweepResult) -> str:
    sla = res.steps[0]["sla"]["p95_budget_ms"] if res.steps else 20.0
    target = target_label(res.steps[0]) if res.steps else "?"
    best = f"**{res.best_rate:g} requests/s**" if res.best_rate is not None else "**none** (the lowest rate failed)"
    lines = [
        f"# Rate sweep `{res.name}`: {target}",
        "",
        f"Highest rate meeting the SLA (P95 ≤ {sla:g} ms, errors within limit): {best}.",
        "",
        "| offered/s | achieved/s | P50 ms | P95 ms | P99 ms | max ms | errors | gen. lag P99 ms | SLA |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in res.steps:
        lat = s["latency_ms"]
        lines.append(f"| {s['config']['rate']:g} | {s['achieved_rate']:.1f} | {fmt_ms(lat['p50'])} | "
                     f"{fmt_ms(lat['p95'])} | {fmt_ms(lat['p99'])} | {fmt_ms(lat['max'])} | {s['error_share']:.2%} | "
                     f"{s['generator']['lag_p99_ms']:.2f} | {'PASS' if s['sla']['pass'] else 'FAIL'} |")
    warnings = [s["generator"]["warning"] for s in res.steps if s["generator"]["warning"]]
    if warnings:
        lines += ["", f"**Warning:** {warnings[-1]}."]
    return "\n".join(lines) + "\n"


def write_sweep(res: SweepResult, out_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"{res.name}.{k}" for k in ("json", "md", "png")}
    atomic_write_text(paths["json"], json.dumps(res.to_json(), indent=2, sort_keys=True) + "\n")
    atomic_write_text(paths["md"], sweep_markdown(res))
    fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
    rates = [s["config"]["rate"] for s in res.steps]
    for key, style in (("p50", ":"), ("p95", "-"), ("p99", "--")):
        vals = [s["latency_ms"][key] for s in res.steps]
        ax.plot(rates, [float("nan") if v is None else v for v in vals], ls=style, marker="o", label=key.upper())
    if res.steps:
        ax.axhline(res.steps[0]["sla"]["p95_budget_ms"], color="tab:orange", ls="--", label="SLA")
    if res.best_rate is not None:
        ax.axvline(res.best_rate, color="tab:green", lw=1, label=f"best {res.best_rate:g}/s")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"sweep {res.name}")
    ax.legend(fontsize=8)
    save_png(fig, paths["png"])
    plt.close(fig)
    return paths
