"""The CPU runtimes a prepared variant runs on: ONNX Runtime (fp32, fp16, int8) and OpenVINO (bf16).

bf16 keeps a base-size model's quality where dynamic int8 does not (all-mpnet-base-v2: int8 min cos
0.863, bf16 0.99997) at about int8's speed, but only on a CPU that computes bf16 natively (AMX or
AVX512-BF16): elsewhere OpenVINO would quietly compute in f32 at f32's speed, and the variant's
vectors would no longer be the ones its index was built with. So bf16 is built and served only
where OpenVINO reports the capability, and refused elsewhere with the reason.

OpenVINO reads the ORT-fused fp32 graph (its ONNX frontend knows the com.microsoft fused ops), so
the bf16 variant shares the fp32 file; the precision is chosen when the graph is compiled.
"""

from __future__ import annotations

import os
import threading
from functools import cache
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from inference.errors import ModelError

OUTPUT = "last_hidden_state"
OPENVINO_PRECISIONS = ("bf16",)  # the precisions computed by OpenVINO; every other by ONNX Runtime


class Graph(Protocol):
    """One loaded encoder graph: feed in, last_hidden_state out. Safe to call from several threads."""

    inputs: tuple[str, ...]

    def hidden(self, feed: dict[str, npt.NDArray[np.int64]]) -> npt.NDArray[np.float32]: ...


def runtime_of(precision: str) -> str:
    return "openvino" if precision in OPENVINO_PRECISIONS else "onnxruntime"


@cache
def bf16_unavailable() -> str:
    """Why this host cannot run the bf16 variant; "" when it can."""
    try:
        import openvino as ov
    except ImportError:
        return "OpenVINO is not installed (the `openvino` package runs the bf16 variant)"
    try:
        caps = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except Exception as exc:  # no CPU plugin on this platform: bf16 is not for this host, the rest still is
        return f"OpenVINO cannot use this CPU ({exc})"
    if "BF16" not in caps:
        return ("this CPU computes bf16 neither with AMX nor with AVX512-BF16 (OpenVINO's CPU capabilities: "
                f"{', '.join(caps)}); OpenVINO would run it in f32")
    return ""


class OrtGraph:
    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads if threads > 0 else (os.cpu_count() or 1)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        # Never spinning: spinning threads answer the next call sooner but hold both cores for a while
        # after each call, for 2-3x the CPU per query (lost: docs/benchmarks.md, ORT's threads).
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own untyped errors for unreadable graphs
            raise ModelError(f"ONNX Runtime cannot load {path}: {exc}") from exc
        self.inputs = tuple(i.name for i in self.session.get_inputs())

    def hidden(self, feed: dict[str, npt.NDArray[np.int64]]) -> npt.NDArray[np.float32]:
        return np.asarray(self.session.run([OUTPUT], feed)[0])


class OpenVinoGraph:
    def __init__(self, path: Path, threads: int, precision: str) -> None:
        why = bf16_unavailable() if precision == "bf16" else ""
        if why:
            raise ModelError(f"the {precision} variant cannot run here: {why}; serve fp32 or int8 "
                             "(EMBEDCAR_MODEL_VARIANT)")
        import openvino as ov

        core = ov.Core()
        try:
            model = core.read_model(str(path))
            self._compiled = core.compile_model(model, "CPU", {
                "INFERENCE_PRECISION_HINT": precision,
                "INFERENCE_NUM_THREADS": threads if threads > 0 else (os.cpu_count() or 1),
                "PERFORMANCE_HINT": "LATENCY",
                "NUM_STREAMS": 1,
                # The search engine shares these cores: no thread is pinned to one of them.
                "ENABLE_CPU_PINNING": False,
            })
        except Exception as exc:  # OpenVINO's errors are untyped RuntimeErrors
            raise ModelError(f"OpenVINO cannot compile {path} for {precision}: {exc}") from exc
        self.inputs = tuple(p.get_any_name() for p in self._compiled.inputs)
        self._output = self._compiled.output(OUTPUT)
        self._local = threading.local()  # an infer request is not thread-safe: one per calling thread

    def hidden(self, feed: dict[str, npt.NDArray[np.int64]]) -> npt.NDArray[np.float32]:
        req = getattr(self._local, "request", None)
        if req is None:
            req = self._local.request = self._compiled.create_infer_request()
        return np.array(req.infer(feed)[self._output], dtype=np.float32)  # a copy: the request reuses its buffer


def open_graph(path: Path, precision: str, threads: int) -> Graph:
    """The graph at `path` on the runtime that computes `precision` (`threads` 0: every core)."""
    if runtime_of(precision) == "openvino":
        return OpenVinoGraph(path, threads, precision)
    return OrtGraph(path, threads)


def hidden_once(path: Path, precision: str, feed: dict[str, npt.NDArray[np.int64]]) -> npt.NDArray[np.float32]:
    """last_hidden_state of one feed (the inputs the graph does not take are dropped): for checks."""
    graph = open_graph(path, precision, 0)
    return graph.hidden({k: v for k, v in feed.items() if k in graph.inputs})

