"""`embedcar model report NAME [NAME...]`: what a team reads before choosing a model for this host.

Per prepared model and per variant, measured here: batch-1 latency at 16 and 32 tokens (the raw
graph on its runtime, ONNX Runtime or OpenVINO for bf16, with the model settings' threads, median
and P95 of many calls), batched throughput (texts/s at batch 32 × 32 tokens), index bytes per item
(flat, and the catalog's IVF-PQ layout), weak-label quality on the first --limit grocery products
(catalog/quality.py, the `catalog quality` command's metrics, exact search), and a verdict on RATE
req/s at P95 <= SLA (loadtest/bench/model_verdict.py says the rule). Also what each manifest serves
by default and why, and an int8 row flagged where its nDCG@10 falls more than 0.01 below fp32.

Writes model_report.json, model_report.md (one table) and model_report.png under --out (default
reports/model_report, git-ignored). It lives in loadtest/ because it needs the catalog; `embedcar
model` finds it through the `embedcar.model_commands` entry point group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from catalog.index_build import ivf_factory
from catalog.quality import evaluate
from catalog.settings import CatalogSettings, Settings
from catalog.sources import Product, read_grocery
from inference.backends.onnx import OnnxBackend
from inference.errors import InvalidInput, ModelError
from inference.files import atomic_write_text
from inference.manifest import Manifest, load_manifest
from inference.model_default import set_default_variant
from inference.runtimes import bf16_unavailable
from inference.settings import ModelSettings
from loadtest.bench.model import time_calls, token_batch
from loadtest.bench.model_verdict import SCHEMA, Rule, check_shape, choose_default, finish, markdown, save_png
from loadtest.bench.serving import git_commit, machine_info

log = logging.getLogger(__name__)
Say = Callable[[str], None]
SHAPES = ((1, 16), (1, 32))
# fp16 is the GPU plan's precision: ORT on CPU runs it through casts, slower than fp32 (docs/benchmarks.md).
CPU_SKIPS = {"fp16": "the GPU (TensorRT) precision: not a CPU serving choice; --variants fp16 to measure it"}


@dataclass(frozen=True, slots=True)
class ReportConfig:
    variants: tuple[str, ...] = ()  # empty: every prepared variant but those in CPU_SKIPS
    latency_samples: int = 300  # timed batch-1 calls per shape
    throughput_samples: int = 30  # timed batch calls
    batch: int = 32
    tokens: int = 32
    quality_items: int = 5000  # grocery products embedded for quality; 0: no quality
    known_items: int = 500
    rule: Rule = field(default_factory=Rule)
    seed: int = 0

    def validate(self) -> ReportConfig:
        if self.latency_samples < 1 or self.throughput_samples < 1 or self.batch < 1 or self.tokens < 2:
            raise ModelError("samples, batch and tokens must be positive (tokens >= 2)")
        if self.quality_items < 0 or self.known_items < 1:
            raise ModelError("--limit must be >= 0 and --known-items >= 1")
        return self


def index_bytes_per_item(dim: int, cs: CatalogSettings) -> dict[str, int]:
    """Bytes one more item adds to the index: flat float32, and the catalog's `ivfpq` (4-bit PQ codes
    + the re-rank copy + an int64 id); per-index constants (centroids, codebooks) left out."""
    out = {"flat": dim * 4}
    try:
        _factory, p = ivf_factory("ivfpq", dim, 1, cs)
    except InvalidInput:  # no PQ layout for this dimension (m must be even and divide it)
        return out
    if p:
        out["ivfpq"] = p["pq_m"] * p["pq_bits"] // 8 + dim * (2 if p["refine"] == "fp16" else 1) + 8
    return out


def measure_speed(model_dir: Path, manifest: Manifest, variant: str, ms: ModelSettings,
                  cfg: ReportConfig) -> dict[str, Any]:
    backend = OnnxBackend(model_dir, manifest, variant=variant, threads=ms.intra_op_threads,
                          max_batch=max(cfg.batch, 1))
    rng = np.random.default_rng(cfg.seed)
    latency = {}
    for b, n in SHAPES:
        t = time_calls(backend, token_batch(manifest, b, n, rng), cfg.latency_samples)
        latency[f"{b}x{n}"] = {"p50": round(float(np.median(t)), 3), "p95": round(float(np.percentile(t, 95)), 3),
                               "samples": cfg.latency_samples}
    t = time_calls(backend, token_batch(manifest, cfg.batch, cfg.tokens, rng), cfg.throughput_samples)
    median_s = float(np.median(t)) / 1e3
    return {"latency_ms": latency, "threads": backend.threads,
            "throughput": {"texts_per_s": round(cfg.batch / median_s, 1), "batch_ms_p50": round(median_s * 1e3, 2),
                           "batch": cfg.batch, "tokens": cfg.tokens, "samples": cfg.throughput_samples}}


def measure_quality(settings: Settings, manifest: Manifest, variant: str, products: Sequence[Product],
                    cfg: ReportConfig) -> dict[str, Any]:
    """catalog.quality.evaluate's exact-search scores per query set (no ANN: not what is compared here)."""
    result = asyncio.run(evaluate(settings, variant=variant, pooling=manifest.pooling, known_items=cfg.known_items,
                                  seed=cfg.seed, ann_types=(), products=products))
    return {s: v for s, v in result["exact"].items()} | {"items": result["items"]}


def variants_to_measure(manifest: Manifest, wanted: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(variants to measure, {variant left out: why})."""
    skipped: dict[str, str] = {}
    names = list(wanted) or list(manifest.variants)
    chosen = []
    for v in names:
        if v in manifest.variants:
            if not wanted and v in CPU_SKIPS:
                skipped[v] = CPU_SKIPS[v]
            elif manifest.variants[v].precision == "bf16" and bf16_unavailable():
                skipped[v] = bf16_unavailable()
            else:
                chosen.append(v)
        elif v in manifest.refused:
            skipped[v] = "refused when prepared (missed its check)"
        else:
            skipped[v] = "not prepared"
    for v in manifest.refused:
        skipped.setdefault(v, "refused when prepared (missed its check)")
    return chosen, skipped


def for_model(settings: Settings, name: str) -> Settings:
    return dataclasses.replace(settings, model=dataclasses.replace(settings.model, name=name))


def report_model(settings: Settings, name: str, cfg: ReportConfig, products: Sequence[Product],
                 say: Say) -> dict[str, Any]:
    s = for_model(settings, name)
    model_dir = s.model.model_dir
    manifest = load_manifest(model_dir)
    chosen, skipped = variants_to_measure(manifest, cfg.variants)
    rows = []
    for variant in chosen:
        say(f"{name} {variant}: latency and throughput ({cfg.latency_samples} + {cfg.throughput_samples} calls)")
        row: dict[str, Any] = {"variant": variant, **measure_speed(model_dir, manifest, variant, s.model, cfg),
                               "index_bytes_per_item": index_bytes_per_item(manifest.dim, s.catalog)}
        if products:
            say(f"{name} {variant}: quality on {len(products)} products")
            row["quality"] = measure_quality(s, manifest, variant, products, cfg)
        else:
            row["quality"] = {}
        rows.append(row)
    return {"name": name, "version_id": manifest.version_id, "dim": manifest.dim,
            "architecture": manifest.architecture, "pooling": manifest.pooling,
            "default_variant": manifest.default_variant, "default_reason": manifest.default_reason,
            "refused": manifest.refused, "skipped_variants": skipped, "variants": rows}


def set_defaults(settings: Settings, report: dict[str, Any], say: Say = print) -> dict[str, str]:
    """Each model's measured default variant (model_verdict.choose_default), written by the product's
    `model set-default` (inference/model_default.py); {name: variant} for the manifests changed."""
    changed = {}
    for m in report["models"]:
        choice = choose_default(m, report.get("date", "")[:10])
        if choice is None:
            say(f"{m['name']}: no default set: fp32's quality was not measured (--limit 0?)")
            continue
        variant, why = choice
        was = set_default_variant(for_model(settings, m["name"]).model.model_dir, variant, why,
                                  expected_version_id=m["version_id"])
        m["default_variant"], m["default_reason"] = variant, why
        if was is not None:
            say(f"{m['name']}: serves {variant} by default now (was {was}): {why}")
            changed[m["name"]] = variant
    return changed


def run_report(settings: Settings, names: Sequence[str], cfg: ReportConfig, *, out_dir: Path, command: str = "",
               set_default: bool = False, say: Say = print) -> tuple[dict[str, Any], dict[str, Path]]:
    cfg.validate()
    for name in names:  # all prepared before minutes of measuring start
        load_manifest(for_model(settings, name).model.model_dir)
    products = read_grocery(cfg.quality_items).products if cfg.quality_items else []
    threads = settings.model.intra_op_threads
    report: dict[str, Any] = {
        "schema": SCHEMA, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": git_commit(),
        "command": command, "machine": machine_info() | {"load_avg_start": round(os.getloadavg()[0], 2)},
        "config": {"variants": list(cfg.variants), "latency_samples": cfg.latency_samples,
                   "throughput_samples": cfg.throughput_samples, "batch": cfg.batch, "tokens": cfg.tokens,
                   "quality_items": len(products), "known_items": cfg.known_items, "intra_op_threads": threads,
                   "threads_label": f"{threads} threads" if threads else "threads = cores (the default)",
                   "text_fields": list(settings.catalog.text_fields), "seed": cfg.seed},
        "models": [report_model(settings, n, cfg, products, say) for n in names],
    }
    report["machine"]["load_avg_end"] = round(os.getloadavg()[0], 2)
    finish(report, cfg.rule)
    if problems := check_shape(report):  # a bug here, not a measurement: say so before writing
        raise ModelError(f"model report is incomplete: {'; '.join(problems)}")
    if set_default:
        set_defaults(settings, report, say)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "model_report.json", "md": out_dir / "model_report.md",
             "png": out_dir / "model_report.png"}
    atomic_write_text(paths["json"], json.dumps(report, indent=2, sort_keys=True) + "\n")
    atomic_write_text(paths["md"], markdown(report))
    save_png(report, paths["png"])
    return report, paths
