"""int8 gives a text the same vector whatever its batch.

ORT's dynamic quantization ranged each activation over the whole [batch, sequence, hidden] tensor,
padding included: "greek yogurt" alone vs in a batch of 4 moved by cos 0.9908 / 0.023 per
component. The served int8 now has its activation ranges fixed at prepare; `model prepare` checks
a text alone vs in mixed batches beside the fp32 check and refuses an int8 that moves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from inference import export, model_checks, runtimes
from inference.backends.onnx import OnnxBackend
from inference.embedder import load_tokenizer
from inference.head import Head
from inference.manifest import Manifest
from inference.prepare import prepare_model
from inference.tokenizer import QueryTokenizer
from tests.components import require_variant
from tests.fixtures_models import tiny_st_folder

MATES = ["family size organic whole grain gluten free breakfast cereal with almonds and honey clusters",
         "tea", "low sodium chicken broth for soup"]


def test_served_int8_is_the_same_alone_and_in_a_batch(model_dir: Path, manifest: Manifest,
                                                      tokenizer: QueryTokenizer) -> None:
    """The issue's reproduction, on the served path: 'greek yogurt' alone vs with batch-mates of
    other lengths, in either order."""
    require_variant(manifest, "int8")
    ids = tokenizer.encode(["greek yogurt", *MATES]).ids
    backend = OnnxBackend(model_dir, manifest, variant="int8", threads=2)
    alone = backend.embed_sync(tokenizer.batch(ids[:1]))
    for batch in (ids, ids[::-1]):
        row = 0 if batch is ids else len(ids) - 1
        together = backend.embed_sync(tokenizer.batch(batch))[row : row + 1]
        assert float(np.abs(together - alone).max()) <= export.BATCH_MAX_ABS
        assert float((together * alone).sum()) >= 0.99999


def test_prepare_recorded_the_batch_check(manifest: Manifest) -> None:
    require_variant(manifest, "int8")
    check = manifest.variants["int8"].check
    assert check["batch_max_abs"] <= export.BATCH_MAX_ABS and check["min_cos"] >= export.MIN_COS["int8"]
    assert manifest.variants["fp32"].check["batch_max_abs"] <= 1e-5  # fp32 is batch-free, as it always was


def test_the_check_catches_dynamic_int8(tmp_path: Path, model_dir: Path, manifest: Manifest) -> None:
    """The check can fail: the old dynamic int8 of the same fp32 graph moves beyond the tolerance,
    the calibrated one of the same graph does not."""
    fp32 = model_dir / manifest.variant("fp32").file
    dynamic, static = tmp_path / "dynamic.onnx", tmp_path / "static.onnx"
    export.quantize_dynamic_int8(fp32, dynamic)
    calibration = load_tokenizer(model_dir, manifest)
    ids = sorted(calibration.encode(export.calibration_texts()["query"]).ids, key=len)
    feeds = [{k: v for k, v in calibration.batch(ids[i : i + 32]).arrays().items() if k in manifest.inputs}
             for i in range(0, len(ids), 32)]
    assert export.quantize_int8(fp32, static, feeds) > 0
    head = Head.from_manifest(model_dir, manifest)
    texts = [*export.CHECK_TEXTS, "greek yogurt"]
    drift = {p.name: model_checks.batch_drift(runtimes.open_graph(p, "int8", 2), calibration, head, texts)
             for p in (dynamic, static)}
    assert drift["dynamic.onnx"]["batch_max_abs"] > export.BATCH_MAX_ABS, drift
    assert drift["static.onnx"]["batch_max_abs"] <= export.BATCH_MAX_ABS, drift
    ops = {n.op_type for n in onnx.load(str(static)).graph.node}
    assert "DynamicQuantizeLinear" not in ops and "QuantizeLinear" in ops


def test_prepare_refuses_a_batch_dependent_int8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 whose vectors move with their batch is left out with its figures; fp32 is served."""
    src = tiny_st_folder(tmp_path / "st", "bert", pooling="mean")
    ok = prepare_model(tmp_path / "models", "tiny", from_dir=src, say=lambda _m: None)
    assert ok.default_variant == "int8" and ok.variants["int8"].check["batch_max_abs"] <= export.BATCH_MAX_ABS

    def dynamic(fp32: Path, out: Path, feeds: object) -> int:  # the old scheme in the new one's place
        export.quantize_dynamic_int8(fp32, out)
        return 0

    monkeypatch.setattr(export, "quantize_int8", dynamic)
    said: list[str] = []
    m = prepare_model(tmp_path / "models", "tiny-dynamic", from_dir=src, say=said.append)
    assert "int8" not in m.variants and m.default_variant == "fp32"
    assert m.refused["int8"]["batch_max_abs"] > export.BATCH_MAX_ABS
    assert any("int8 variant refused" in s and "batch max abs" in s for s in said), said


def test_a_model_with_the_old_int8_is_prepared_again(tmp_path: Path) -> None:
    """A model prepared before the batch check (its int8 dynamic) is not 'already prepared'."""
    import dataclasses

    src = tiny_st_folder(tmp_path / "st", "bert", pooling="mean")
    m = prepare_model(tmp_path / "models", "tiny", from_dir=src, say=lambda _m: None)
    old = {k: v for k, v in m.variants["int8"].check.items() if not k.startswith("batch_")}
    variants = {**m.variants, "int8": dataclasses.replace(m.variants["int8"], check=old)}
    dataclasses.replace(m, variants=variants).save(tmp_path / "models" / "tiny")
    said: list[str] = []
    again = prepare_model(tmp_path / "models", "tiny", from_dir=src, say=said.append)
    assert any("predates the batch check" in s for s in said), said
    assert "batch_max_abs" in again.variants["int8"].check


def _saturation_free() -> bool:
    """ONNX Runtime's u8 x s8 kernel on a CPU without VNNI (AVX2 alone: Zen 3, older Xeons) sums pairs of
    products in int16 (vpmaddubsw), which saturates where full-range activations meet full-range weights,
    as this tiny graph's do (ORT's quantization docs); VNNI and AMX sum in int32."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").is_file() else []
    return any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def test_a_graph_without_layer_norms_is_calibrated_unsmoothed(tmp_path: Path) -> None:
    """Nothing to smooth (no layer norm feeds a product): still a static, runnable int8 graph."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.arange(8, dtype=np.float32).reshape(2, 4) / 8, "w")
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["x"], to=TensorProto.FLOAT),
         helper.make_node("Concat", ["x", "x"], ["x2"], axis=-1),
         helper.make_node("MatMul", ["x2", "w"], ["last_hidden_state"])],
        "no-ln",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s", 1]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["b", "s", 4])], [w])
    fp32 = tmp_path / "fp32.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(fp32))
    feed = {"input_ids": np.arange(6, dtype=np.int64).reshape(2, 3, 1), "attention_mask": np.ones((2, 3), np.int64)}
    assert export.quantize_int8(fp32, tmp_path / "int8.onnx", [feed]) == 1
    got = runtimes.hidden_once(tmp_path / "int8.onnx", "int8", feed)
    want = runtimes.hidden_once(fp32, "fp32", feed)
    # Calibrated on this very feed, the static ranges are the ones dynamic quantization computes per call:
    # the same answer on any CPU, its integer kernel included.
    export.quantize_dynamic_int8(fp32, tmp_path / "dynamic.onnx")
    dynamic = runtimes.hidden_once(tmp_path / "dynamic.onnx", "int8", feed)
    np.testing.assert_allclose(got, dynamic, atol=0.01 * float(np.abs(want).max()))
    if _saturation_free():
        np.testing.assert_allclose(got, want, atol=0.05 * float(np.abs(want).max()))
    assert "DynamicQuantizeLinear" not in {n.op_type for n in onnx.load(str(tmp_path / "int8.onnx")).graph.node}
