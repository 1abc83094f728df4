"""Export a BERT-family encoder to ONNX and derive the served variants.

torch + transformers are needed only here (the `export` extra); serving never imports them.
Steps: eager attention (with SDPA, ONNX Runtime cannot fuse attention) -> torch.onnx.export
(TorchScript exporter, opset 17, dynamic batch/sequence) -> check against PyTorch -> ORT
transformer optimizer (fused fp32) -> fp16 (for the GPU path) and int8 (dynamic, per-channel).
Any variant that disagrees with PyTorch beyond its tolerance is refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inference.errors import ModelError
from inference.pooling import pool

log = logging.getLogger(__name__)

OPSET = 17
# Real shopper-style texts used to compare ONNX with PyTorch (different lengths on purpose).
CHECK_TEXTS = (
    "best marathon training shoes for women",
    "running shoes",
    "organic gluten free pasta sauce under 5 dollars family size",
    "wireless noise cancelling headphones with long battery life for travel and office",
    "baby formula",
    "Ünïcödé café crème brûlée 🍮 и немного кириллицы",
)
# Largest elementwise disagreement with PyTorch's last_hidden_state accepted for fp32 graphs, and
# smallest cosine of pooled embeddings for reduced-precision variants.
FP32_MAX_ABS = 1e-3
FP16_MIN_COS = 0.9999
INT8_MIN_COS = 0.98


@dataclass(frozen=True, slots=True)
class ExportedGraph:
    path: Path
    inputs: tuple[str, ...]
    num_heads: int
    hidden_size: int
    model_type: str


def _torch_inputs(tokenizer_file: Path, texts: Sequence[str], inputs: Sequence[str], max_length: int) -> dict[str, Any]:
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=tok.padding["pad_id"] if tok.padding else 0)
    encs = tok.encode_batch(list(texts))
    arrays = {
        "input_ids": [e.ids for e in encs],
        "attention_mask": [e.attention_mask for e in encs],
        "token_type_ids": [e.type_ids for e in encs],
    }
    return {k: torch.tensor(arrays[k], dtype=torch.int64) for k in inputs}


def load_torch_model(src_dir: Path) -> Any:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(src_dir), attn_implementation="eager")
    model.eval()
    return model


def model_inputs(model: Any) -> tuple[str, ...]:
    import inspect

    params = inspect.signature(model.forward).parameters
    names = ["input_ids", "attention_mask"]
    if "token_type_ids" in params and int(getattr(model.config, "type_vocab_size", 0) or 0) > 0:
        names.append("token_type_ids")
    return tuple(names)


def export_onnx(model: Any, tokenizer_file: Path, out: Path, max_length: int) -> ExportedGraph:
    """TorchScript-based export with dynamic batch and sequence axes."""
    import torch

    names = model_inputs(model)
    sample = _torch_inputs(tokenizer_file, CHECK_TEXTS[:2], names, max_length)

    class _Wrapper(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any) -> Any:
            return self.inner(**dict(zip(names, args, strict=True))).last_hidden_state

    dyn = {n: {0: "batch", 1: "sequence"} for n in (*names, "last_hidden_state")}
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(
            _Wrapper(model).eval(),  # a fresh Module is in training mode; export restores it
            tuple(sample[n] for n in names),
            str(out),
            input_names=list(names),
            output_names=["last_hidden_state"],
            dynamic_axes=dyn,
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )
    cfg = model.config
    return ExportedGraph(out, names, int(cfg.num_attention_heads), int(cfg.hidden_size), str(cfg.model_type))


def torch_hidden(model: Any, tokenizer_file: Path, texts: Sequence[str], inputs: Sequence[str],
                 max_length: int) -> tuple[npt.NDArray[np.float32], dict[str, npt.NDArray[np.int64]]]:
    import torch

    feed = _torch_inputs(tokenizer_file, texts, inputs, max_length)
    with torch.no_grad():
        hidden = model(**feed).last_hidden_state.numpy().astype(np.float32)
    return hidden, {k: v.numpy() for k, v in feed.items()}


def ort_hidden(path: Path, feed: dict[str, npt.NDArray[np.int64]]) -> npt.NDArray[np.float32]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}
    out = sess.run(["last_hidden_state"], {k: v for k, v in feed.items() if k in wanted})[0]
    return np.asarray(out, dtype=np.float32)


def optimize_fused(graph: ExportedGraph, out: Path) -> bool:
    """ORT transformer optimizer (attention/layernorm/gelu fusion). False when nothing fused."""
    from onnxruntime.transformers import optimizer

    if graph.model_type not in ("bert", "roberta", "distilbert", "xlm-roberta", "electra"):
        log.info("no fusion recipe for model type %s: the fp32 variant is the plain export", graph.model_type)
        return False
    opt = optimizer.optimize_model(
        str(graph.path), model_type="bert", num_heads=graph.num_heads, hidden_size=graph.hidden_size,
        opt_level=1,
    )
    opt.save_model_to_file(str(out))
    return bool(opt.get_fused_operator_statistics().get("Attention", 0)
                or opt.get_fused_operator_statistics().get("MultiHeadAttention", 0))


def convert_fp16(fp32_path: Path, out: Path) -> None:
    """fp16 weights and compute, fp32 inputs/outputs kept, for the GPU/TensorRT path."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(fp32_path))
    converted = convert_float_to_float16(model, keep_io_types=True)
    onnx.save(converted, str(out))


def quantize_int8(fp32_path: Path, out: Path) -> None:
    """Dynamic quantization, per-channel s8 weights (per-tensor loses too much on this model)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # Fused com.microsoft ops defeat ONNX shape inference; their outputs are float.
    quantize_dynamic(str(fp32_path), str(out), per_channel=True, weight_type=QuantType.QInt8,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


def cosines(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.asarray((a * b).sum(axis=1), dtype=np.float32)


def check_variant(path: Path, precision: str, ref_hidden: npt.NDArray[np.float32],
                  feed: dict[str, npt.NDArray[np.int64]]) -> dict[str, float]:
    """Compare a graph with PyTorch on real tokens; raise ModelError if it disagrees."""
    got = ort_hidden(path, feed)
    mask = feed["attention_mask"].astype(bool)
    max_abs = float(np.abs(got - ref_hidden)[mask].max())
    cos = float(cosines(pool(got, feed["attention_mask"]), pool(ref_hidden, feed["attention_mask"])).min())
    limit_ok = {
        "fp32": max_abs <= FP32_MAX_ABS,
        "fp16": cos >= FP16_MIN_COS,
        "int8": cos >= INT8_MIN_COS,
    }[precision]
    if not limit_ok:
        raise ModelError(f"{path.name}: disagrees with PyTorch (max abs diff {max_abs:.2e}, min cos {cos:.6f})")
    return {"max_abs_diff": max_abs, "min_cos": cos}


def sentence_transformers_pooling(src_dir: Path) -> str:
    """The model's own pooling config -> our pooling mode (mean is the only one we serve)."""
    cfg_path = src_dir / "1_Pooling" / "config.json"
    if not cfg_path.exists():
        return "mean"
    cfg = json.loads(cfg_path.read_text())
    if not cfg.get("pooling_mode_mean_tokens", False):
        raise ModelError(f"{cfg_path}: only mean-token pooling models are supported, got {cfg}")
    return "mean"


def max_seq_length(src_dir: Path, model: Any) -> int:
    st = src_dir / "sentence_bert_config.json"
    if st.exists():
        return int(json.loads(st.read_text())["max_seq_length"])
    return min(int(getattr(model.config, "max_position_embeddings", 512)), 512)
