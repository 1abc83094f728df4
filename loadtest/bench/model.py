"""`embedcar bench model`: raw ONNX Runtime latency per variant, shape and thread count.

Prints a Markdown table (median and P95 over many calls), and what length buckets save against
padding every query to 128 tokens (the "length buckets" row of docs/benchmarks.md's levers).
Timing on shared machines is noisy: the figures to quote are ratios within one run.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from inference.backends.onnx import OnnxBackend
from inference.manifest import Manifest, load_manifest
from inference.tokenizer import TokenBatch

SHAPES: tuple[tuple[int, int], ...] = ((1, 16), (1, 32), (1, 64), (1, 128), (32, 32))


def token_batch(manifest: Manifest, b: int, n: int, rng: np.random.Generator) -> TokenBatch:
    """`b` rows of `n` random in-vocabulary ids, all attended: latency depends on the shape only."""
    ids = rng.integers(1000, 20000, size=(b, n), dtype=np.int64)
    ids[:, 0] = manifest.special_ids[1] if len(manifest.special_ids) > 1 else 101
    mask = np.ones((b, n), dtype=np.int64)
    return TokenBatch(ids, mask, np.zeros_like(ids) if manifest.has_token_type_ids else None)


def time_calls(backend: OnnxBackend, batch: TokenBatch, reps: int) -> np.ndarray:
    """`reps` call times in ms, after a warm-up of max(3, reps / 20) calls."""
    for _ in range(max(3, reps // 20)):
        backend.embed_sync(batch)
    out = np.empty(reps)
    for i in range(reps):
        t0 = time.perf_counter()
        backend.embed_sync(batch)
        out[i] = time.perf_counter() - t0
    return out * 1e3


def run(model_dir: Path, variants: Sequence[str], threads: Sequence[int], reps: int) -> str:
    manifest = load_manifest(model_dir)
    rng = np.random.default_rng(0)
    lines = [
        f"ORT latency, {platform.machine()}, {platform.python_version()}, reps={reps} (batch 32: reps/10)",
        "",
        "| variant | threads | batch x tokens | median ms | P95 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    medians: dict[tuple[str, int, tuple[int, int]], float] = {}
    for variant in variants:
        if variant not in manifest.variants:
            continue
        for t in threads:
            backend = OnnxBackend(model_dir, manifest, variant=variant, threads=t)
            for b, n in SHAPES:
                ms = time_calls(backend, token_batch(manifest, b, n, rng), reps if b == 1 else max(10, reps // 10))
                medians[(variant, t, (b, n))] = float(np.median(ms))
                lines.append(f"| {variant} | {t} | {b} x {n} | {np.median(ms):.2f} | {np.percentile(ms, 95):.2f} |")
    lines.append("")
    for variant in variants:
        for t in threads:
            k16, k32, k128 = ((variant, t, (1, n)) for n in (16, 32, 128))
            if k128 in medians:
                lines.append(f"- {variant}, {t} threads: 1x128 / 1x16 = {medians[k128] / medians[k16]:.1f}x, "
                             f"1x128 / 1x32 = {medians[k128] / medians[k32]:.1f}x (what a 16-32-token query "
                             f"saves by its bucket instead of padding to 128)")
    return "\n".join(lines)
