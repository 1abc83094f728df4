"""The real model against golden vectors computed by PyTorch at export time."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from inference.backends.onnx import OnnxBackend
from inference.embedder import Embedder
from inference.errors import InvalidInput
from inference.manifest import Manifest, verify_files
from inference.tokenizer import QueryTokenizer
from tests.components import require_variant
from tests.conftest import GOLDEN

GOLDEN_FILE = GOLDEN / "all-MiniLM-L6-v2.json"


def _golden() -> tuple[list[str], np.ndarray]:
    rows = json.loads(GOLDEN_FILE.read_text())["texts"]
    return [r["text"] for r in rows], np.array([r["embedding"] for r in rows], dtype=np.float32)


def test_manifest_matches_files(model_dir: Path, manifest: Manifest) -> None:
    assert verify_files(model_dir, manifest) == []
    assert manifest.dim == 384 and manifest.max_length == 256 and manifest.pooling == "mean"
    assert manifest.buckets == (16, 32, 64, 128, 256)
    assert set(manifest.variants) >= {"fp32", "int8"}
    assert manifest.variants["fp32"].fused


@pytest.mark.parametrize(("variant", "min_cos"), [("fp32", 0.9999), ("fp16", 0.9999), ("int8", 0.98)])
def test_variants_match_pytorch_golden(model_dir: Path, manifest: Manifest, tokenizer: QueryTokenizer,
                                       variant: str, min_cos: float) -> None:
    require_variant(manifest, variant)
    texts, gold = _golden()
    backend = OnnxBackend(model_dir, manifest, variant=variant, threads=2)
    got = asyncio.run(Embedder(tokenizer, backend).embed(texts)).embeddings
    cos = (got * gold).sum(axis=1)
    assert cos.min() >= min_cos, dict(zip(texts, cos.round(6), strict=True))


def test_padding_never_changes_an_embedding(tokenizer: QueryTokenizer, onnx_backend: OnnxBackend) -> None:
    texts = ["tea", "best marathon training shoes for women", "low fat greek yogurt strawberry"]
    enc = tokenizer.encode(texts)
    alone = np.vstack([onnx_backend.embed_sync(tokenizer.batch([ids])) for ids in enc.ids])
    for length in (16, 32, 128, 256):
        together = onnx_backend.embed_sync(tokenizer.batch(enc.ids, length=length))
        assert (alone * together).sum(axis=1).min() >= 0.99999


def test_bucketed_embed_keeps_input_order(tokenizer: QueryTokenizer, onnx_backend: OnnxBackend) -> None:
    texts = ["x " * 40, "tea", "y " * 20, "milk"]
    emb = asyncio.run(Embedder(tokenizer, onnx_backend).embed(texts)).embeddings
    for i, t in enumerate(texts):
        single = asyncio.run(Embedder(tokenizer, onnx_backend).embed([t])).embeddings[0]
        assert float(single @ emb[i]) >= 0.99999


def test_bad_input(tokenizer: QueryTokenizer, onnx_backend: OnnxBackend) -> None:
    e = Embedder(tokenizer, onnx_backend, max_batch=8)
    for bad, msg in (([], "empty batch"), (["  "], "empty"), (["a"] * 9, "over the maximum")):
        with pytest.raises(InvalidInput, match=msg):
            asyncio.run(e.embed(bad))
    r = asyncio.run(e.embed(["zz " * 3_400, "🛒 лук 洋葱"]))
    assert r.truncated == [True, False]
    assert np.allclose(np.linalg.norm(r.embeddings, axis=1), 1.0, atol=1e-5)
