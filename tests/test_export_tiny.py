"""The exporter on tiny randomly initialised BERT and ModernBERT models built here (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="export tests need the `export` extra (torch, transformers)")

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from inference.backends.onnx import OnnxBackend
from inference.embedder import Embedder, load_tokenizer
from inference.prepare import build_model_dir

WORDS = ["best", "marathon", "training", "shoes", "for", "women", "running", "organic", "pasta", "sauce", "milk", "tea"]


def _tokenizer(path: Path, *, cls: str, sep: str, pad: str) -> None:
    vocab = {t: i for i, t in enumerate([pad, "[UNK]", cls, sep, *WORDS])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.add_special_tokens([pad, "[UNK]", cls, sep])
    tok.save(str(path))


def _tiny(tmp: Path, kind: str) -> Path:  # transformers is untyped
    import torch
    from transformers import AutoModel, BertConfig, ModernBertConfig

    torch.manual_seed(0)
    src = tmp / f"src-{kind}"
    src.mkdir()
    n_vocab = 4 + len(WORDS)
    cfg: Any
    if kind == "bert":
        cfg = BertConfig(  # type: ignore[no-untyped-call]
            vocab_size=n_vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64)
        _tokenizer(src / "tokenizer.json", cls="[CLS]", sep="[SEP]", pad="[PAD]")
    else:
        cfg = ModernBertConfig(vocab_size=n_vocab, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                               pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2,
                               eos_token_id=3, global_attn_every_n_layers=1)
        _tokenizer(src / "tokenizer.json", cls="[CLS]", sep="[SEP]", pad="[PAD]")
    AutoModel.from_config(cfg, attn_implementation="eager").save_pretrained(src)  # type: ignore[no-untyped-call]
    return src


@pytest.mark.parametrize("kind", ["bert", "modernbert"])
def test_tiny_export_round_trips_through_ort(tmp_path: Path, kind: str) -> None:
    import asyncio

    src = _tiny(tmp_path, kind)
    out = tmp_path / f"model-{kind}"
    manifest = build_model_dir(src, out, name=f"tiny-{kind}", source=None, say=lambda _m: None,
                               with_golden=False)
    assert manifest.dim == 32
    assert manifest.has_token_type_ids == (kind == "bert")
    assert manifest.variants["fp32"].check["max_abs_diff"] <= 1e-3
    backend = OnnxBackend(out, manifest, variant="fp32", threads=1)
    emb = asyncio.run(Embedder(load_tokenizer(out, manifest), backend).embed(
        ["best marathon shoes", "milk tea", "organic pasta sauce for women"])).embeddings
    assert emb.shape == (3, 32)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert manifest.version_id.startswith(f"tiny-{kind}@")
