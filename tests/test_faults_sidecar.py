"""The fault suite's Triton and overload scenarios in their short form, on real processes.

The suite asserts what must hold on any machine (no failed request with the fallback, only
UNAVAILABLE without it, rejections that say when to retry, flat memory); the latency and goodput
targets are figures of `embedcar faults` (docs/reliability.md), which needs an otherwise idle box.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from embedcar_settings import Settings
from loadtest.faults import overload, triton_kill, triton_pool
from loadtest.faults.result import ScenarioResult
from tests.components import require_triton


def outage_only(settings: Settings) -> Settings:
    """Admission's latency budget off: on a busy CI box it would (rightly) shed load, and these tests
    are about the outage; the overload scenario is where admission is judged."""
    return settings.with_section("sidecar", admission_budget_ms=0.0)


def checks(res: ScenarioResult) -> dict[str, bool]:
    return {c.name: c.passed for c in res.checks}


def needs_triton() -> None:
    require_triton()


@pytest.mark.triton
@pytest.mark.slow
def test_triton_kill_scenario(settings: Settings, model_dir: Path, tmp_path: Path) -> None:
    needs_triton()
    res = triton_kill.run(settings, tmp_path, quick=True)
    got = checks(res)
    assert got["fallback on: failed requests"], res.figures["fallback_on"]
    assert got["fallback on: the fallback answered during the outage"], res.figures["fallback_on"]
    assert got["fallback off: failures are UNAVAILABLE only"], res.figures["fallback_off"]["codes"]
    off = res.figures["fallback_off"]
    assert off["failed"] > 0  # the outage was real: without the fallback, callers saw it
    assert off["recovered_s_after_ready"] is not None and off["answered_by"].get("triton", 0) > 0


@pytest.mark.triton
@pytest.mark.slow
def test_triton_pool_scenario(settings: Settings, model_dir: Path, tmp_path: Path) -> None:
    needs_triton()
    res = triton_pool.run(outage_only(settings), tmp_path, quick=True)
    assert checks(res)["failed requests"], res.figures


@pytest.mark.slow
def test_overload_scenario(settings: Settings, model_dir: Path, tmp_path: Path) -> None:
    res = overload.run(settings, tmp_path, quick=True)
    fig = res.figures["overload"]["5x"]
    # Overload is refused with RESOURCE_EXHAUSTED, or by gRPC's C core while the event loop lags behind
    # (shed: see sidecar.grpc_server.backlog_options), never an error or a crash; HTTP 429s say when
    # to retry, memory stays flat, and the sidecar serves normally afterwards.
    assert set(fig["codes"]) <= {"ok", "resource_exhausted", "shed", "deadline_exceeded"}, fig["codes"]
    assert fig["codes"].get("resource_exhausted", 0) > 0 and fig["codes"].get("ok", 0) > 0
    got = checks(res)
    assert got["5x: HTTP 429 carries Retry-After"] and fig["retry_after_probe"]["http_429"] > 0
    assert got["5x: sidecar RSS bounded"], fig
    # And it serves afterwards: the 20 normal calls after the storm each answered within their 2 s
    # deadline (a failed one raises). How fast is the scenario's own check, a figure for the report.
    assert res.figures["after"]["max_ms"] <= 2000
