"""Export a transformer encoder to ONNX and derive the served variants.

torch + transformers are needed only here (the `export` extra); serving never imports them.
Steps: eager attention (with SDPA, ONNX Runtime cannot fuse attention; ModernBERT also needs its
compiled layers off) -> torch.onnx.export (TorchScript exporter, opset 17, dynamic batch/sequence)
-> check against PyTorch -> ORT transformer optimizer where it has a recipe for the architecture
(fused fp32; a fused graph that disagrees is dropped for the plain export) -> fp16 and int8
(per-channel s8 weights, u8 activations with ranges calibrated at prepare). fp32 must agree with
PyTorch or the model is refused; a reduced-precision variant that misses its tolerance is left
out, with its figures.

int8 activation ranges are fixed, not measured per call: ORT's dynamic quantization takes one range
over the whole [batch, sequence, hidden] tensor, padding included, so a text's vector moved with its
batch-mates (MiniLM: cos 0.9908 alone vs in a batch of 4). With constant scales every row is
computed on its own, as in fp32; docs/benchmarks.md has the comparison.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
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
# Largest difference of a unit embedding's component between a text alone (exact length) and the
# same text in mixed batches padded to other lengths, for int8. With constant scales each row is
# computed as alone: MiniLM moved 0.0 on 495 held-out texts (dynamic: 3.7e-2, and 7.4e-5 even on a
# tiny random model). The bound is fp32's padding tolerance: room for float summation order in the
# fp32 ops between int8 ones; an int8 that misses it is refused (fp32 served), never served moving.
BATCH_MAX_ABS = 1e-5
# Texts the int8 variant's activation ranges are calibrated on: "q<TAB>text" (a shopper query, the
# query role's prompt) or "d<TAB>text" (a catalog title, the document role's); `#` lines are notes.
CALIBRATION_FILE = Path(__file__).with_name("int8_calibration.txt")
Feed = dict[str, npt.NDArray[np.int64]]
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


def quantize_dynamic_int8(fp32_path: Path, out: Path) -> None:
    """ORT dynamic quantization, per-channel s8 weights (per-tensor loses too much on this model).
    Batch-dependent on its own: `quantize_int8` fixes its activation ranges."""
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


def calibration_texts(path: Path = CALIBRATION_FILE) -> dict[str, list[str]]:
    """The calibration texts per role ("query", "document")."""
    roles: dict[str, list[str]] = {"query": [], "document": []}
    for line in path.read_text(encoding="utf-8").splitlines():
        kind, _, text = line.partition("\t")
        if kind in ("q", "d") and text:
            roles["query" if kind == "q" else "document"].append(text)
    return roles


def quantize_int8(fp32_path: Path, out: Path, feeds: Sequence[Feed]) -> int:
    """Static int8 with the dynamic graph's kernels (QAttention, MatMulInteger, per-channel s8
    weights as `quantize_dynamic_int8` makes them), each DynamicQuantizeLinear replaced by a
    QuantizeLinear whose u8 scale and zero point come from the range its input took over `feeds`:
    the same speed, no per-call range pass, no dependence on the batch. Before that, the inputs
    coming from a layer norm are smoothed (`_smooth`): one static range per tensor cannot hold their
    few outlier channels without losing the rest. Returns the tensors calibrated."""
    import tempfile

    import onnx
    from onnx import numpy_helper

    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".int8.") as tmp:
        smoothed = Path(tmp) / "smoothed.onnx"
        _smooth(onnx.load(str(fp32_path)), feeds, smoothed)
        quantize_dynamic_int8(smoothed, out)
    model = onnx.load(str(out))
    dynamic = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear"]
    ranges = _activation_ranges(model, [n.input[0] for n in dynamic], feeds)
    nodes = []
    for node in model.graph.node:
        if node.op_type != "DynamicQuantizeLinear":
            nodes.append(node)
            continue
        # DynamicQuantizeLinear's own formula (range widened to hold 0), on the calibrated range.
        lo, hi = min(float(ranges[node.input[0]][0]), 0.0), max(float(ranges[node.input[0]][1]), 0.0)
        scale = (hi - lo) / 255.0 if hi > lo else 1.0
        zero = int(np.clip(np.round(-lo / scale), 0, 255))
        q, s_name, z_name = node.output
        model.graph.initializer.extend([numpy_helper.from_array(np.array(scale, dtype=np.float32), s_name),
                                        numpy_helper.from_array(np.array(zero, dtype=np.uint8), z_name)])
        nodes.append(onnx.helper.make_node("QuantizeLinear", [node.input[0], s_name, z_name], [q],
                                           name=f"{node.name}_static" if node.name else ""))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _fold_static(model)
    onnx.save(model, str(out))
    return len(dynamic)


def _fold_static(model: Any) -> None:
    """MatMulInteger -> Cast -> Mul(a_scale * b_scale) becomes one MatMulIntegerToFloat: ORT fuses
    that itself only where the scale product is computed in the graph (dynamic), not a constant.
    Without it the static graph was 8 % slower than dynamic at batch 1. (Folding the smoothing Mul
    into a per-channel QuantizeLinear instead was 75 % slower: ORT's per-axis QuantizeLinear is a
    slow path.)"""
    import onnx

    producer = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    drop: set[str] = set()
    replace: dict[str, Any] = {}
    for mm in model.graph.node:
        if mm.op_type != "MatMulInteger" or len(consumers.get(mm.output[0], [])) != 1:
            continue
        cast = consumers[mm.output[0]][0]
        outs = consumers.get(cast.output[0], [])
        if cast.op_type != "Cast" or len(outs) != 1 or outs[0].op_type != "Mul":
            continue
        mul = outs[0]
        scales = producer.get(mul.input[1])
        if scales is None or scales.op_type != "Mul" or len(consumers[scales.output[0]]) != 1:
            continue
        replace[mul.output[0]] = onnx.helper.make_node(
            "MatMulIntegerToFloat", [mm.input[0], mm.input[1], *scales.input, *mm.input[2:4]], list(mul.output),
            name=f"{mm.name}_to_float", domain="com.microsoft")
        drop.update({mm.output[0], cast.output[0], scales.output[0]})
    nodes = [replace.get(n.output[0], n) for n in model.graph.node if n.output[0] not in drop]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if replace and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))


SMOOTH_ALPHA = 0.5  # SmoothQuant's split of the range between activation and weight


def _smooth(model: Any, feeds: Sequence[Feed], out: Path) -> int:
    """SmoothQuant (Xiao et al., 2023) on the products fed by a layer norm (QKV, FFN in): X·W =
    (X/s)·(s·W) with s_j = max|X_j|^a / max|W_j|^(1-a) per input channel j, X's maxima calibrated.
    Layer-norm outputs carry a few channels ~10x the rest (MiniLM: -16..30 where most lie within
    ±3); dividing them down lets one static scale serve the tensor. A Mul per product, on the
    product's branch only (the residual keeps X). Returns the products smoothed."""
    import onnx
    from onnx import numpy_helper

    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    weights = {i.name: i for i in model.graph.initializer}
    graph = list(model.graph.node)
    targets = [i for i, n in enumerate(graph) if n.op_type in ("MatMul", "Attention") and len(n.input) > 1
               and n.input[1] in weights and len(weights[n.input[1]].dims) == 2
               and producer.get(n.input[0], "").endswith("LayerNormalization")]
    if not targets:  # e.g. an adopted graph whose layer norms are primitive ops: quantized unsmoothed
        onnx.save(model, str(out))
        return 0
    maxima = _activation_ranges(model, sorted({graph[i].input[0] for i in targets}), feeds, per_channel=True)
    before: dict[int, Any] = {}
    for i in targets:
        node = graph[i]
        lo, hi = maxima[node.input[0]]
        x_max = np.maximum(np.maximum(-lo, hi), 1e-5)
        w = numpy_helper.to_array(weights[node.input[1]])
        if x_max.shape != (w.shape[0],):
            continue
        s = (x_max ** SMOOTH_ALPHA / np.maximum(np.abs(w).max(axis=1), 1e-5) ** (1 - SMOOTH_ALPHA)).astype(np.float32)
        w_name, inv_name, x_name = f"{node.input[1]}_smoothed_{i}", f"smooth_inv_{i}", f"{node.input[0]}_smoothed_{i}"
        model.graph.initializer.extend([numpy_helper.from_array((w * s[:, None]).astype(np.float32), w_name),
                                        numpy_helper.from_array((1.0 / s).astype(np.float32), inv_name)])
        before[i] = onnx.helper.make_node("Mul", [node.input[0], inv_name], [x_name], name=f"smooth_{i}")
        node.input[0], node.input[1] = x_name, w_name
    nodes = []
    for i, node in enumerate(graph):  # each Mul right before its product: the order stays topological
        if i in before:
            nodes.append(before[i])
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(out))
    return len(before)


def _activation_ranges(model: Any, names: Sequence[str], feeds: Iterable[Feed], *,
                       per_channel: bool = False) -> dict[str, tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]:
    """(min, max) of each tensor `names` of `model` over the attended tokens of `feeds`: scalars, or
    per last-axis channel with `per_channel`."""
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                              for n in names if n not in have)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    lo: dict[str, Any] = dict.fromkeys(names, np.inf)
    hi: dict[str, Any] = dict.fromkeys(names, -np.inf)
    axis = 0 if per_channel else None
    seen = 0
    for feed in feeds:
        mask = feed["attention_mask"].astype(bool)
        for name, got in zip(names, session.run(list(names), feed), strict=True):
            vals = got[mask] if got.ndim >= 2 and got.shape[:2] == mask.shape else got.reshape(-1, got.shape[-1])
            lo[name] = np.minimum(lo[name], vals.min(axis=axis))
            hi[name] = np.maximum(hi[name], vals.max(axis=axis))
        seen += 1
    if not seen:
        raise ModelError("int8 calibration: no calibration batches")
    return {n: (np.asarray(lo[n], dtype=np.float32), np.asarray(hi[n], dtype=np.float32)) for n in names}


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
    if precision == "int8":  # the variant served by default must not depend on its batch-mates
        ok = ok and figures.get("batch_max_abs", np.inf) <= BATCH_MAX_ABS
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
