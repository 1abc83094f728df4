"""Triton Python-backend `encoder` on PyTorch: token ids in, the model's embedding out.

Copied into <repo>/encoder.<model>.<hash>/1/model.py by `embedcar triton repo --encoder torch`. It runs
inference/torch_encoder.py, the module the sidecar's torch backend runs (the transformer from the model
folder's weights/, then the model's head), on the instance's device: a KIND_GPU instance on its own GPU
(float16 or bfloat16 where the served variant says so), a KIND_CPU one in float32 on its share of the
cores. It pools in this stub, so the ensemble is the CPU encoder's one-step layout and its clients see
the same model interface: int32 ids in, `embedding` out.

Like the ONNX encoder, it answers a request whose caller's deadline passed while it queued with an
error instead of computing it (inference/triton/models/encoder/model.py says why Triton's queue
timeouts are off).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
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


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = config_params(args)
        from pathlib import Path

        import torch

        from inference import heap
        from inference.torch_encoder import load_encoder
        from inference.triton.models import tensors
        from inference.triton.models.encoder.model import expired_counter
        from inference.triton.names import DEADLINE_PARAM, EXPIRED, POOL_SKIP_PARAM

        gpu = args.get("model_instance_kind") == "GPU"
        if not gpu:
            # Instances x threads <= cores (the generator's sizing): more would oversubscribe them.
            torch.set_num_threads(int(params.get("threads", "1")))
            with contextlib.suppress(RuntimeError):  # settable once per process, before any parallel work
                torch.set_num_interop_threads(1)
        device = f"cuda:{args.get('model_instance_device_id', '0')}" if gpu else "cpu"
        dtype = getattr(torch, params.get("dtype", "float32"))  # the served variant's (the generator's TORCH_DTYPES)
        self.encoder: Any = load_encoder(Path(params["model_dir"]), device=device, dtype=dtype)
        self.inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if self.encoder.uses_token_types else [])
        self.tensors = tensors
        self.deadline_param, self.expired, self.skip_param = DEADLINE_PARAM, EXPIRED, POOL_SKIP_PARAM
        self.expired_family, self.expired_count = expired_counter(args["model_name"])
        heap.settle()  # the stub is this model's own process: no full collection pauses its requests

    def execute(self, requests: list[Any]) -> list[Any]:
        """One forward pass per group of requests of one shape and pooling skip, one response per request."""
        responses: list[Any] = [None] * len(requests)
        feeds: dict[int, dict[str, Any]] = {}
        groups: dict[tuple[int, int], list[int]] = {}
        now, expired = time.time_ns(), 0
        for i, req in enumerate(requests):
            if self.tensors.expired(req, self.deadline_param, now):
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(self.expired, pb_utils.TritonError.UNAVAILABLE))
                expired += 1
                continue
            try:
                feeds[i] = self.tensors.id_feed(req, self.inputs)
                key = (feeds[i]["input_ids"].shape[1], self.tensors.int_param(req, self.skip_param))
            except Exception as exc:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"encoder input: {exc}"))
                continue
            groups.setdefault(key, []).append(i)
        if expired and self.expired_count is not None:
            self.expired_count.increment(expired)
        for (_, skip), idx in groups.items():
            try:
                joined = {k: np.concatenate([feeds[i][k] for i in idx]) if len(idx) > 1 else feeds[idx[0]][k]
                          for k in feeds[idx[0]]}
                emb = self.encoder.encode(joined["input_ids"], joined["attention_mask"],
                                          joined.get("token_type_ids"), skip=skip)
                start = 0
                for i in idx:
                    n = feeds[i]["input_ids"].shape[0]
                    out = self.tensors.output("embedding", np.ascontiguousarray(emb[start : start + n]))
                    responses[i] = pb_utils.InferenceResponse(output_tensors=[out])
                    start += n
            except Exception as exc:
                for i in idx:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"encoder: {exc}"))
        return responses

    def finalize(self) -> None:
        self.encoder = None
