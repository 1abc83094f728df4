"""Triton Python-backend `encoder`: ONNX Runtime on CPU, token ids in, last_hidden_state out.

Copied into <repo>/encoder/1/model.py by `embedcar triton repo --target cpu`. Runs inside the
backend stub's own Python: the project and venv paths come from the `sys_path` config parameter.
With fused pooling (the config has a `mode` parameter) it can also emit `embedding`, pooled here
by `inference.pooling.pool` (the function every backend uses), which saves the ensemble a second
Python-backend hop; it computes only the outputs a request asks for.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np  # importable wherever the backend utils are: they need it themselves
import triton_python_backend_utils as pb_utils


def config_params(args: dict[str, str]) -> dict[str, str]:
    """String parameters of the model config, with `sys_path` applied so imports resolve."""
    cfg = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
    for p in reversed(params.get("sys_path", "").split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(0, p)
    return params


def to_numpy(tensor: Any) -> Any:
    """Zero-copy numpy view through DLPack.

    The wheel's stub was built for numpy < 2; with numpy 2 its as_numpy()/Tensor(ndarray) read the
    array descriptor wrongly (garbage values, zero-byte outputs). DLPack carries dtype and shape
    itself, so it works with either numpy.
    """
    return np.from_dlpack(tensor)


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
        self.pool: Any = None
        if "mode" in params:
            from inference.pooling import params_from_config, pool

            self.pool = pool
            self.mode, self.special_ids = params_from_config(params)
        from inference import heap

        heap.settle()  # the stub is this model's own process: no full collection pauses its requests

    def _outputs(self, request: Any, feed: dict[str, Any], hidden: Any) -> list[Any]:
        wanted = set(request.requested_output_names()) or {"last_hidden_state"}
        out = []
        if "last_hidden_state" in wanted:
            out.append(pb_utils.Tensor.from_dlpack("last_hidden_state", hidden))
        if "embedding" in wanted:
            if self.pool is None:
                raise ValueError("this encoder was configured without pooling")
            emb = self.pool(hidden, feed["attention_mask"], self.mode, input_ids=feed["input_ids"],
                            special_ids=self.special_ids)
            out.append(pb_utils.Tensor.from_dlpack("embedding", emb))
        return out

    def _feed(self, request: Any) -> dict[str, Any]:
        feed: dict[str, Any] = {}
        for name in self.inputs:
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None:
                feed[name] = to_numpy(t).astype(np.int64, copy=False)
        if "token_type_ids" in self.inputs and "token_type_ids" not in feed:
            feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
        return feed

    def execute(self, requests: list[Any]) -> list[Any]:
        """One ORT run per same-shape group of requests, one response per request."""
        feeds: list[dict[str, Any] | None] = []
        responses: list[Any] = [None] * len(requests)
        for i, req in enumerate(requests):
            try:
                feeds.append(self._feed(req))
            except Exception as exc:
                feeds.append(None)
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"encoder input: {exc}"))
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
