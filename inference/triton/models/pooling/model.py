"""Triton Python-backend `pooling`: last_hidden_state + mask -> the model's embedding.

Copied into <repo>/pooling/1/model.py. It runs the model's head (inference/head.py: pooling, Dense
layers, normalisation), the same code the embedded backend uses, so both backends agree; the head
comes from the model's manifest through the config's parameters.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import triton_python_backend_utils as pb_utils


def config_params(args: dict[str, str]) -> dict[str, str]:
    """String parameters of the model config, with `sys_path` applied so imports resolve."""
    cfg = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
    for p in reversed(params.get("sys_path", "").split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(0, p)
    return params


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = config_params(args)
        from inference.head import from_params
        from inference.triton.models import tensors
        from inference.triton.names import POOL_SKIP_PARAM

        self.head: Any = from_params(params)
        self.tensors = tensors
        self.skip_param = POOL_SKIP_PARAM

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for req in requests:
            try:
                hidden = self.tensors.to_numpy(pb_utils.get_input_tensor_by_name(req, "last_hidden_state"))
                mask = self.tensors.to_numpy(pb_utils.get_input_tensor_by_name(req, "attention_mask"))
                ids_t = pb_utils.get_input_tensor_by_name(req, "input_ids")
                ids = self.tensors.to_numpy(ids_t) if ids_t is not None else None
                emb = self.head(hidden, mask, input_ids=ids, skip=self.tensors.int_param(req, self.skip_param))
                out = self.tensors.output("embedding", emb)
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            except Exception as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"pooling: {exc}")))
        return responses
