"""Reading Triton's per-request traces into phase medians (the file format of `--trace-config`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.triton.trace import WHOLE, phase_table


def _trace(tid: int, model: str, stamps: dict[str, int], parent: int | None = None) -> list[dict[str, object]]:
    # Triton writes a header entry per trace (id, model) and timestamps entries; keep both shapes.
    head: dict[str, object] = {"id": tid, "model_name": model, "model_version": 1}
    if parent is not None:
        head["parent_id"] = parent
    return [head, {"id": tid, "timestamps": [{"name": k, "ns": v} for k, v in stamps.items()]}]


def _request(t0: int, execute_us: int) -> list[dict[str, object]]:
    us = 1000
    ens = {"GRPC_WAITREAD_START": t0 - 50 * us, "GRPC_WAITREAD_END": t0, "REQUEST_START": t0 + 60 * us,
           "QUEUE_START": t0 + 80 * us, "REQUEST_END": t0 + (300 + execute_us) * us,
           "GRPC_SEND_START": t0 + (300 + execute_us) * us, "GRPC_SEND_END": t0 + (400 + execute_us) * us}
    enc = {"REQUEST_START": t0 + 81 * us, "QUEUE_START": t0 + 82 * us, "COMPUTE_START": t0 + 100 * us,
           "COMPUTE_INPUT_END": t0 + 150 * us, "COMPUTE_OUTPUT_START": t0 + (150 + execute_us) * us,
           "COMPUTE_END": t0 + (250 + execute_us) * us, "REQUEST_END": t0 + (260 + execute_us) * us}
    tid = t0 // 1000
    return _trace(tid, "embedder", ens) + _trace(tid + 1, "encoder", enc, parent=tid)


def test_phases_per_model_with_medians(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    entries = [e for i, ex in enumerate([5000, 6000, 7000]) for e in _request(10_000_000 * (i + 1), ex)]
    path.write_text(json.dumps(entries))
    table = phase_table(path, ensemble="embedder")
    assert table["encoder"]["execute (Python-backend round trip)"][0] == pytest.approx(6000)
    assert table["encoder"]["queue"][0] == pytest.approx(18)
    assert table["embedder"][WHOLE][0] == pytest.approx(6400)
    assert table["embedder"]["ensemble scheduling"][0] == pytest.approx(20)


def test_window_keeps_only_requests_that_started_inside_it(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    entries = _request(10_000_000, 1000) + _request(50_000_000, 9000)
    path.write_text("\n".join(json.dumps(e) for e in entries))  # one JSON object per line works too
    table = phase_table(path, ensemble="embedder", window_ns=(40_000_000, 60_000_000))
    assert table["encoder"]["execute (Python-backend round trip)"][0] == pytest.approx(9000)


def test_a_missing_trace_file_gives_no_phases(tmp_path: Path) -> None:
    assert phase_table(tmp_path / "none.json", ensemble="embedder") == {}
