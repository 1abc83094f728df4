"""Triton's request traces, summarised per phase: where a request's time goes inside the server.

The statistics API gives cumulative means, which one slow request in a thousand distorts; traces
carry per-request timestamps, so medians and P95 per phase are possible. `trace_args` turns
tracing on for a server started by the launcher (every request, timestamps only, written to one
JSON file when the server stops); `phase_table` reads that file back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from inference.triton.names import is_ensemble

WHOLE = "whole request in the server"
# (label, from timestamp, to timestamp), per model trace; missing pairs are skipped.
PHASES = {
    "ensemble": [("gRPC read -> request", "GRPC_WAITREAD_END", "REQUEST_START"),
                 ("ensemble scheduling", "REQUEST_START", "QUEUE_START"),
                 (WHOLE, "GRPC_WAITREAD_END", "GRPC_SEND_END"),
                 ("gRPC send", "GRPC_SEND_START", "GRPC_SEND_END")],
    "model": [("queue", "QUEUE_START", "COMPUTE_START"),
              ("compute input", "COMPUTE_START", "COMPUTE_INPUT_END"),
              ("execute (Python-backend round trip)", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"),
              ("compute output", "COMPUTE_OUTPUT_START", "COMPUTE_END"),
              ("release", "COMPUTE_END", "REQUEST_END")],
}


def trace_args(path: Path) -> list[str]:
    """tritonserver flags: trace every request's timestamps into `path` (written at shutdown)."""
    return ["--trace-config", "mode=triton", "--trace-config", f"triton,file={path}",
            "--trace-config", "rate=1", "--trace-config", "level=TIMESTAMPS", "--trace-config", "count=-1",
            "--trace-config", "triton,log-frequency=0"]


def load_traces(path: Path) -> list[dict[str, object]]:
    """One dict per traced model request: model name and {timestamp name: ns}."""
    text = path.read_text() if path.exists() else ""
    raw = json.loads(text) if text.strip().startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    by_id: dict[object, dict[str, object]] = {}
    for entry in raw:
        rec = by_id.setdefault(entry["id"], {"model": "", "ts": {}})
        if "model_name" in entry:
            rec["model"] = entry["model_name"]
        ts = rec["ts"]
        assert isinstance(ts, dict)
        for stamp in entry.get("timestamps", []):
            ts[stamp["name"]] = int(stamp["ns"])
    return list(by_id.values())


def phase_table(path: Path, *, ensemble: str | None = None, window_ns: tuple[int, int] | None = None
                ) -> dict[str, dict[str, tuple[float, float]]]:
    """model -> phase -> (P50 µs, P95 µs); `window_ns` keeps requests that started inside it
    (Triton stamps with the monotonic clock, the same as time.monotonic_ns()). The ensembles are
    `ensemble`, or without it every model named like ours (`embedder.<model>.<hash>`)."""
    samples: dict[str, dict[str, list[float]]] = {}
    for rec in load_traces(path):
        ts = rec["ts"]
        model = str(rec["model"])
        assert isinstance(ts, dict)
        start = ts.get("REQUEST_START")
        if window_ns is not None and (start is None or not window_ns[0] <= start <= window_ns[1]):
            continue
        whole = model == ensemble if ensemble is not None else is_ensemble(model)
        for label, a, b in PHASES["ensemble" if whole else "model"]:
            if a in ts and b in ts:
                samples.setdefault(model, {}).setdefault(label, []).append((ts[b] - ts[a]) / 1e3)
    return {m: {label: (float(np.percentile(v, 50)), float(np.percentile(v, 95))) for label, v in phases.items()}
            for m, phases in samples.items()}
