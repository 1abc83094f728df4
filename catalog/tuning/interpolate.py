"""Weight interpolation between the base and the tuned model, the mix chosen on the gate.

Fine-tuning on catalog pairs moves the model toward the shapes it trained on (aisle names, short
prefixes) and away from what the base already did well (whole shopper queries). Averaging the two
models' weights, base + a·(tuned − base), keeps most of the gain and most of the base's strengths
(Wortsman et al., 2022, "Robust fine-tuning of zero-shot models", WiSE-FT). Each mix in MIXES is
scored on the held-out sets like the tuned model; the published one is the mix that passes the gate
with the best mean nDCG@10 over every set and cut (a = 1: the tuned model as trained).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MIXES = (1.0, 0.7, 0.5)  # a = share of the tuned model's change kept; 1.0 first: what training made


@dataclass(frozen=True, slots=True)
class Scored:
    mix: float
    figures: dict[str, Any]
    misses: list[str]

    @property
    def passed(self) -> bool:
        return not self.misses


def snapshot(model: Any) -> dict[str, Any]:
    """A copy of the model's weights (CPU), to mix with later."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def apply(model: Any, base: Mapping[str, Any], tuned: Mapping[str, Any], mix: float) -> None:
    """Load base + mix·(tuned − base) into `model` (integer buffers, such as position ids, as tuned)."""
    import torch

    mixed = {}
    for k, t in tuned.items():
        b = base.get(k)
        mixed[k] = t if b is None or not torch.is_floating_point(t) else b + mix * (t - b)
    model.load_state_dict(mixed)


def mean_ndcg(figures: Mapping[str, Any]) -> float:
    values = [sc["ndcg_at_10"] for per_cut in figures.values() for sc in per_cut.values()]
    return sum(values) / len(values) if values else 0.0


def choose(model: Any, base: Mapping[str, Any], tuned: Mapping[str, Any], evaluate: Callable[[], dict[str, Any]],
           gate: Callable[[dict[str, Any]], list[str]], say: Callable[[str], None],
           mixes: tuple[float, ...] = MIXES) -> tuple[Scored, list[Scored]]:
    """Score each mix, leave the chosen one loaded in `model`; (chosen, all scored). None passing: the
    best-scoring mix is returned (the gate then refuses it, or --force publishes it)."""
    scored = []
    for mix in mixes:
        apply(model, base, tuned, mix)
        figures = evaluate()
        s = Scored(mix, figures, gate(figures))
        scored.append(s)
        say(f"mix {mix:g} (base + {mix:g}·tuning): mean nDCG@10 {mean_ndcg(figures):.4f}, "
            + ("passes the gate" if s.passed else f"{len(s.misses)} misses, e.g. {s.misses[0]}"))
    passing = [s for s in scored if s.passed]
    chosen = max(passing or scored, key=lambda s: (mean_ndcg(s.figures), s.mix))
    apply(model, base, tuned, chosen.mix)
    return chosen, scored
