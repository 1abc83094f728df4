"""Weight interpolation between base and tuned (catalog/tuning/interpolate.py): the mixed weights are
base + a·(tuned − base), integer buffers stay as tuned, and the mix kept is the best that passes the
gate (the best-scoring one when none does, for the gate to refuse)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is the tune extra's (make test installs it)")

from catalog.tuning import interpolate  # noqa: E402


class Tiny(torch.nn.Module):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1, bias=False)
        self.register_buffer("ids", torch.arange(3))


def weights(model: Tiny, w: float) -> None:
    with torch.no_grad():
        model.linear.weight.fill_(w)


def test_a_mix_is_the_base_plus_a_share_of_the_tuning() -> None:
    model = Tiny()
    weights(model, 1.0)
    base = interpolate.snapshot(model)
    weights(model, 3.0)
    model.ids += 10  # an integer buffer: never averaged
    tuned = interpolate.snapshot(model)
    interpolate.apply(model, base, tuned, 0.25)
    assert model.linear.weight.flatten().tolist() == [1.5, 1.5]
    assert model.ids.tolist() == [10, 11, 12]
    assert base["linear.weight"].flatten().tolist() == [1.0, 1.0]  # the snapshots are copies


def figures(ndcg: float) -> dict[str, Any]:
    return {"known-item": {"100": {"ndcg_at_10": ndcg}}}


@pytest.mark.parametrize(("scores", "passing", "kept"), [
    ({1.0: 0.80, 0.7: 0.78, 0.5: 0.75}, {1.0, 0.7, 0.5}, 1.0),  # the tuned model as trained is best
    ({1.0: 0.80, 0.7: 0.78, 0.5: 0.75}, {0.7, 0.5}, 0.7),  # it misses the gate: the best passing mix
    ({1.0: 0.80, 0.7: 0.78, 0.5: 0.75}, set(), 1.0),  # none passes: the best, for the gate to refuse
])
def test_the_mix_kept_is_the_best_that_passes(scores: dict[float, float], passing: set[float], kept: float) -> None:
    model = Tiny()
    weights(model, 0.0)
    base = interpolate.snapshot(model)
    weights(model, 1.0)
    tuned = interpolate.snapshot(model)

    def mix_now() -> float:
        return round(float(model.linear.weight[0, 0].detach()), 3)  # the mix loaded = the weight itself here

    lines: list[str] = []
    chosen, tried = interpolate.choose(model, base, tuned, lambda: figures(scores[mix_now()]),
                                       lambda f: [] if mix_now() in passing else ["known-item 100 % worse"],
                                       lines.append)
    assert chosen.mix == kept and mix_now() == kept  # left loaded in the model
    assert [t.mix for t in tried] == [1.0, 0.7, 0.5] and len(lines) == 3
    assert chosen.passed == (kept in passing)
