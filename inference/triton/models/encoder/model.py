"""Triton Python-backend `encoder`: ONNX Runtime on CPU, token ids in, last_hidden_state out.

Copied into <repo>/encoder/1/model.py by `embedcar triton repo --target cpu`. Runs inside the
backend stub's own Python: the project and venv paths come from the `sys_path` config parameter.
With fused pooling (the config has a `mode` parameter) it can also emit `embedding`, made here
by the model's head (inference/head.py: pooling, Dense layers, normalisation; what every backend
uses), which saves the ensemble a second Python-backend hop; it computes only the outputs a request
asks for.

A request whose caller's deadline (the backend's wall-clock parameter) passed while it queued is
answered with an error instead of computed: Triton's own queue timeouts would do this, but any
queue policy turns on a batcher path that can lose its wake-up (inference/triton/repository.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np  # importable wherever the backend utils are: they need it themselves
import triton_python_backend_utils as pb_utils

EXPIRED_METRIC = "embedcar_encoder_expired_total"


def config_params(args: dict[str, str]) -> dict[str, str]:
    """String parameters of the model config, with `sys_path` applied so imports resolve."""
    cfg = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
    for p in reversed(params.get("sys_path", "").split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(0, p)
    return params


def expired_counter(model: str) -> tuple[Any, Any]:
    """Triton's /metrics counter of requests answered EXPIRED, with its family (which must outlive
    it); (None, None) where the server has metrics off."""
    try:
        family = pb_utils.MetricFamily(
            name=EXPIRED_METRIC, kind=pb_utils.MetricFamily.COUNTER,
            description="Requests the encoder refused to compute: their caller's deadline passed while they queued")
        return family, family.Metric(labels={"model": model})  # one series per encoder (model version)
    except Exception:
        return None, None


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = config_params(args)
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = int(params.get("intra_op_threads", "1"))
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Spinning threads burn the cores other stubs and the server need between requests.
        opts.add_session_config_entry("session.intra_op.allow_spinning", params.get("allow_spinning", "0"))
        if params.get("allow_spinning") == "1" and int(params.get("spin_duration_us", "0")) > 0:
            opts.add_session_config_entry("session.intra_op.spin_duration_us", params["spin_duration_us"])
        opts.log_severity_level = 3
        self.sess: Any = ort.InferenceSession(params["onnx_path"], opts, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.head: Any = None
        if "mode" in params:
            from inference.head import from_params

            self.head = from_params(params)
        from inference import heap
        from inference.triton.models import tensors
        from inference.triton.names import DEADLINE_PARAM, EXPIRED, POOL_SKIP_PARAM

        self.tensors = tensors
        self.deadline_param, self.expired, self.skip_param = DEADLINE_PARAM, EXPIRED, POOL_SKIP_PARAM
        self.expired_family, self.expired_count = expired_counter(args["model_name"])
        heap.settle()  # the stub is this model's own process: no full collection pauses its requests

    def _outputs(self, request: Any, feed: dict[str, Any], hidden: Any) -> list[Any]:
        wanted = set(request.requested_output_names()) or {"last_hidden_state"}
        out = []
        if "last_hidden_state" in wanted:
            out.append(self.tensors.output("last_hidden_state", hidden))
        if "embedding" in wanted:
            if self.head is None:
                raise ValueError("this encoder was configured without pooling")
            emb = self.head(hidden, feed["attention_mask"], input_ids=feed["input_ids"],
                            skip=self.tensors.int_param(request, self.skip_param))
            out.append(self.tensors.output("embedding", emb))
        return out

    def _feed(self, request: Any) -> dict[str, Any]:
        feed: dict[str, Any] = self.tensors.id_feed(request, self.inputs)
        if "token_type_ids" in self.inputs and "token_type_ids" not in feed:
            feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
        return feed

    def execute(self, requests: list[Any]) -> list[Any]:
        """One ORT run per same-shape group of requests, one response per request."""
        feeds: list[dict[str, Any] | None] = []
        responses: list[Any] = [None] * len(requests)
        now, expired = time.time_ns(), 0
        for i, req in enumerate(requests):
            if self.tensors.expired(req, self.deadline_param, now):
                feeds.append(None)
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(self.expired, pb_utils.TritonError.UNAVAILABLE))
                expired += 1
                continue
            try:
                feeds.append(self._feed(req))
            except Exception as exc:
                feeds.append(None)
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"encoder input: {exc}"))
        if expired and self.expired_count is not None:
            self.expired_count.increment(expired)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, feed in enumerate(feeds):
            if feed is not None:
                groups.setdefault(tuple(feed["input_ids"].shape[1:]), []).append(i)
        for idx in groups.values():
            parts = [feeds[i] for i in idx]
            try:
                if len(parts) == 1:
                    joined = parts[0]
                else:
                    joined = {k: np.concatenate([p[k] for p in parts if p is not None]) for k in self.inputs}
                hidden = self.sess.run(["last_hidden_state"], joined)[0]
                start = 0
                for i, p in zip(idx, parts, strict=True):
                    assert p is not None
                    n = p["input_ids"].shape[0]
                    outs = self._outputs(requests[i], p, hidden[start : start + n])
                    responses[i] = pb_utils.InferenceResponse(output_tensors=outs)
                    start += n
            except Exception as exc:
                for i in idx:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"encoder: {exc}"))
        return responses

    def finalize(self) -> None:
        self.sess = None
