"""How long a `model tune` run takes in all, said as it starts: `--minutes` bounds the training only.

    so far         reading the catalog, making the pairs and the held-out sets, loading the model (timed)
    training       the --minutes budget (less what a resumed run already spent), or --steps at the time one
                   step takes here (trainer.step_seconds, measured on the run's own batches)
    scoring        the held-out sets encoded by the base model (unless a resumed run kept its figures) and
                   by each tuned one (heldout.workload texts each), at the rates measured here on a sample
                   of those texts (`encode_rates`)
    export         the tuned model saved, exported to ONNX and each variant checked (inference.prepare):
                   not measured before it runs; EXPORT_FIXED_S + EXPORT_S_PER_M_PARAMS per million of the
                   model's parameters, measured on a 2-vCPU machine (it runs on the CPU, GPU or not)
    index build    with --rollout: every product encoded once more, at the documents' rate

A rough figure, said as one: "about".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from catalog.tuning import heldout

SAMPLE = 128  # texts of each role timed for the encoding rates
# The sample is timed in length-sorted chunks of this many: a whole run's batches hold texts of about one
# length (sentence-transformers sorts them), while one batch of the sample would be padded to its longest.
CHUNK = 32
# One step probed (forward + backward, trainer.step_seconds) is this share of a step in training: the
# probe leaves out the optimizer step and the checkpoints (~10-15 % more on a CPU).
PROBE_SHARE = 0.8
# `model.save` + `prepare_model(--from)` (export, the fp32/fp16/int8 variants and their checks, the weights
# copied), measured 2026-12-07 on a 2-vCPU AMD EPYC, torch 2.13 CPU, other jobs taking half of it: 23 s for a
# tuned all-MiniLM-L6-v2 (22.7M parameters), 4-5 s for the tests' 30,144-parameter model. Export work grows
# with the weights, over a fixed part (tracing, sessions, checks).
EXPORT_FIXED_S = 5.0
EXPORT_S_PER_M_PARAMS = 0.8


def encode_rates(encode: heldout.Encode, held: heldout.HeldOut, sample: int = SAMPLE) -> tuple[float, float]:
    """Texts per second of (documents, queries) for `encode`, each timed on up to `sample` held-out texts
    spread over the sets, in length-sorted chunks (CHUNK), after a warm-up call."""
    docs = _spread(held.documents + held.distractors, sample)
    queries = _spread([q for qs in held.sets for q in qs.queries], sample)
    encode(docs[:2] or queries[:2], "document")  # first-call costs (threads, kernels) are not the rate
    rates = []
    for texts, role in ((docs, "document"), (queries, "query")):
        if not texts:
            rates.append(float("inf"))
            continue
        texts = sorted(texts, key=len)
        t0 = time.perf_counter()
        for start in range(0, len(texts), CHUNK):
            encode(texts[start:start + CHUNK], role)
        rates.append(len(texts) / max(time.perf_counter() - t0, 1e-6))
    return rates[0], rates[1]


def _spread(items: list[str], n: int) -> list[str]:
    """Up to `n` items taken evenly across `items` (the sets follow one another: a prefix would be one set)."""
    step = max(1, len(items) // max(1, n))
    return items[::step][:n]


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True, slots=True)
class Estimate:
    so_far_s: float
    train_s: float
    train_what: str  # what the training figure is: the budget, or steps at the measured step time
    scorings: int  # held-out scorings left: the base's (unless a resumed run kept them) and the tuned model's
    documents: int  # per scoring
    queries: int
    doc_rate: float  # texts/s, measured here
    query_rate: float
    params: int  # the model's parameters, for the export's share
    rollout_products: int = 0  # --rollout: products in the index built afterwards
    with_base: bool = True  # the base's scoring is among `scorings`

    @property
    def scoring_s(self) -> float:
        return self.scorings * (self.documents / self.doc_rate + self.queries / self.query_rate)

    @property
    def export_s(self) -> float:
        return EXPORT_FIXED_S + EXPORT_S_PER_M_PARAMS * self.params / 1e6

    @property
    def rollout_s(self) -> float:
        return self.rollout_products / self.doc_rate

    @property
    def total_s(self) -> float:
        return self.so_far_s + self.train_s + self.scoring_s + self.export_s + self.rollout_s

    def line(self) -> str:
        tuned = self.scorings - 1 if self.with_base else self.scorings
        who = "the tuned model" if tuned == 1 else f"{tuned} tuned models"
        if self.with_base:
            who = f"the base and {who}"
        parts = [
            f"{duration(self.train_s)} training ({self.train_what})",
            f"about {duration(self.scoring_s)} scoring {who} on the held-out sets ({self.documents:,} documents "
            f"and {self.queries:,} query cuts each, at {self.doc_rate:,.0f} and {self.query_rate:,.0f} texts/s "
            "measured here)",
            f"about {duration(self.export_s)} exporting and checking the tuned model's ONNX variants "
            f"({f'{self.params / 1e6:.1f}M' if self.params >= 100_000 else f'{self.params:,}'} parameters)",
        ]
        if self.rollout_products:
            parts.append(f"about {duration(self.rollout_s)} building the index of {self.rollout_products:,} "
                         "products (--rollout)")
        return (f"this run takes about {duration(self.total_s)} in all: {duration(self.so_far_s)} so far (catalog, "
                f"pairs, model), then " + ", ".join(parts))
