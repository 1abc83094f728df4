"""Export a transformer encoder to ONNX and derive the served variants.

torch + transformers are needed only here (the `export` extra); serving never imports them.
Steps: eager attention (with SDPA, ONNX Runtime cannot fuse attention; ModernBERT also needs its
compiled layers off) -> torch.onnx.export (TorchScript exporter, opset 17, dynamic batch/sequence)
-> check against PyTorch -> ORT transformer optimizer where it has a recipe for the architecture
(fused fp32; a fused graph that disagrees is dropped for the plain export) -> fp16 and int8
(dynamic, per-channel). fp32 must agree with PyTorch or the model is refused; a reduced-precision
variant that misses its tolerance is left out, with its figures.
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

from inference import runtimes
from inference.errors import ModelError

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
# smallest cosine of the model's embeddings (head applied) to the reference, per precision.
FP32_MAX_ABS = 1e-3
MIN_COS = {"fp32": 0.9999, "fp16": 0.999, "bf16": 0.999, "int8": 0.98}
# Architectures ORT's transformer optimizer fuses with its BERT recipe.
FUSION_TYPES = ("bert", "roberta", "distilbert", "xlm-roberta", "camembert", "electra")


@dataclass(frozen=True, slots=True)
class ExportedGraph:
    path: Path
    inputs: tuple[str, ...]
    num_heads: int
    hidden_size: int
    model_type: str


def pad_id(tokenizer_file: Path) -> int:
    """The tokenizer's padding id: its padding setting, else its [PAD]/<pad> token, else 0."""
    cfg = json.loads(tokenizer_file.read_text())
    if cfg.get("padding"):
        return int(cfg["padding"].get("pad_id", 0))
    pads = [int(t["id"]) for t in cfg.get("added_tokens", []) if t.get("content") in ("[PAD]", "<pad>")]
    return pads[0] if pads else 0


def _torch_inputs(tokenizer_file: Path, texts: Sequence[str], inputs: Sequence[str], max_length: int) -> dict[str, Any]:
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=pad_id(tokenizer_file))
    encs = tok.encode_batch(list(texts))
    arrays = {
        "input_ids": [e.ids for e in encs],
        "attention_mask": [e.attention_mask for e in encs],
        "token_type_ids": [e.type_ids for e in encs],
    }
    return {k: torch.tensor(arrays[k], dtype=torch.int64) for k in inputs}


def load_torch_model(src_dir: Path, model_type: str = "") -> Any:
    from transformers import AutoModel

    extra: dict[str, Any] = {}
    if model_type == "modernbert":  # its compiled/unpadded path does not trace
        extra["reference_compile"] = False
    try:
        model = AutoModel.from_pretrained(str(src_dir), attn_implementation="eager", local_files_only=True, **extra)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{src_dir}: transformers cannot load the model: {exc}") from exc
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


def optimize_fused(graph: ExportedGraph, out: Path) -> bool:
    """ORT transformer optimizer (attention/layernorm/gelu fusion). False when nothing fused."""
    from onnxruntime.transformers import optimizer

    if graph.model_type not in FUSION_TYPES:
        log.info("no fusion recipe for model type %s: the fp32 variant is the plain export", graph.model_type)
        return False
    try:
        opt = optimizer.optimize_model(
            str(graph.path), model_type="bert", num_heads=graph.num_heads, hidden_size=graph.hidden_size,
            opt_level=1,
        )
    except Exception as exc:  # the optimizer is best effort: its pattern matching asserts on odd graphs
        log.info("ORT's optimizer failed on %s (%s): the fp32 variant is the plain export", graph.path.name, exc)
        return False
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

    # Fused com.microsoft ops defeat ONNX shape inference; their outputs are float. The same ops are
    # why the quantizer's pre-processing (shape inference) does not apply: its hint to run it is noise.
    root = logging.getLogger()  # the quantizer logs through the root logger
    hint = _DropMessage("pre-processing before quantization")
    root.addFilter(hint)
    try:
        quantize_dynamic(str(fp32_path), str(out), per_channel=True, weight_type=QuantType.QInt8,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        root.removeFilter(hint)


class _DropMessage(logging.Filter):
    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        return self.needle not in record.getMessage()


def cosines(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.asarray((a * b).sum(axis=1), dtype=np.float32)


def hidden_diff(path: Path, ref_hidden: npt.NDArray[np.float32], feed: dict[str, npt.NDArray[np.int64]]) -> float:
    """Largest disagreement of the graph's last_hidden_state with PyTorch's over attended tokens."""
    got = runtimes.hidden_once(path, "fp32", feed)
    mask = feed["attention_mask"].astype(bool)
    return float(np.abs(got - ref_hidden)[mask].max())


def passes(precision: str, figures: dict[str, float]) -> bool:
    """Whether a variant's figures are within its precision's tolerance."""
    ok = figures.get("min_cos", -1.0) >= MIN_COS[precision]
    if precision == "fp32" and "max_abs_diff" in figures:
        ok = ok and figures["max_abs_diff"] <= FP32_MAX_ABS
    return ok


def st_embeddings(src_dir: Path, texts: Sequence[str], prompt: str) -> npt.NDArray[np.float32] | None:
    """sentence-transformers' own embeddings of `texts` (the reference a user compares with), or
    None where the library is not installed."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    try:
        model = SentenceTransformer(str(src_dir), device="cpu", local_files_only=True)
        for module in model:
            _drop_unused_inputs(src_dir, module)
        # prompt="" (not None): no prompt, not the model's default one
        out = model.encode(list(texts), prompt=prompt, convert_to_numpy=True, batch_size=len(texts),
                           show_progress_bar=False)
    except Exception as exc:  # the library's own errors, untyped: the folder is what it cannot use
        raise ModelError(f"{src_dir}: sentence-transformers cannot embed with this folder "
                         f"({type(exc).__name__}: {exc})") from exc
    return np.asarray(out, dtype=np.float32)


def _drop_unused_inputs(src_dir: Path, module: Any) -> None:
    """What the export does, for sentence-transformers' reference too: a tokenizer whose config lists inputs
    the model's forward does not take (ModernBERT with token_type_ids) has them dropped, with a warning;
    sentence-transformers would pass them on and fail inside the model."""
    import inspect

    auto, tok = getattr(module, "auto_model", None), getattr(module, "tokenizer", None)
    if auto is None or tok is None:
        return
    takes = inspect.signature(auto.forward).parameters
    dropped = [n for n in tok.model_input_names if n not in takes]
    if dropped:
        log.warning("%s: tokenizer_config.json model_input_names lists %s, which %s.forward does not take: "
                    "dropped (as the export does)", src_dir, ", ".join(dropped), type(auto).__name__)
        tok.model_input_names = [n for n in tok.model_input_names if n in takes]


def adopt_onnx(src: Path, out: Path, tokenizer_file: Path) -> tuple[Path, tuple[str, ...], int]:
    """A user's ONNX encoder as our raw graph: (path, inputs, hidden size).

    Its inputs must be token ids and mask (token_type_ids optional); its token states are the first
    [batch, sequence, hidden] float output, renamed `last_hidden_state` if it has another name.
    """
    import onnx

    try:
        model = onnx.load(str(src))
    except Exception as exc:  # onnx raises DecodeError and friends for a file that is not a graph
        raise ModelError(f"{src}: not a readable ONNX model: {exc}") from exc
    init_names = {i.name for i in model.graph.initializer}
    names = tuple(i.name for i in model.graph.input if i.name not in init_names)
    allowed = ("input_ids", "attention_mask", "token_type_ids")
    if not {"input_ids", "attention_mask"} <= set(names) or set(names) - set(allowed):
        raise ModelError(f"{src}: graph inputs {list(names)}; expected input_ids, attention_mask and optionally "
                         "token_type_ids")
    rank3 = [o for o in model.graph.output if len(o.type.tensor_type.shape.dim) == 3
             and o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    if not rank3:
        raise ModelError(f"{src}: no [batch, sequence, hidden] float output (token states) among "
                         f"{[o.name for o in model.graph.output]}")
    hidden_out = rank3[0]
    if hidden_out.name != "last_hidden_state":
        model.graph.node.append(onnx.helper.make_node("Identity", [hidden_out.name], ["last_hidden_state"]))
        hidden_out = onnx.helper.make_tensor_value_info("last_hidden_state", onnx.TensorProto.FLOAT,
                                                        ["batch", "sequence", "hidden"])
    del model.graph.output[:]
    model.graph.output.append(hidden_out)
    onnx.save(model, str(out))
    ordered = tuple(n for n in allowed if n in names)
    feed = _torch_inputs(tokenizer_file, CHECK_TEXTS[:1], ordered, 64)
    try:
        width = runtimes.hidden_once(out, "fp32", {k: v.numpy() for k, v in feed.items()}).shape[-1]
    except Exception as exc:  # ORT's own untyped errors for a graph it cannot run
        raise ModelError(f"{src}: ONNX Runtime cannot run it on tokens of tokenizer.json: {exc}") from exc
    return out, ordered, int(width)


def default_max_length(model: Any) -> int:
    """Without sentence_bert_config.json: the position table's size, at most 512."""
    return min(int(getattr(model.config, "max_position_embeddings", 512)), 512)
