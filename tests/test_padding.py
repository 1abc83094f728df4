"""The embedded backend pads a forward pass to its longest sequence, not to the bucket's ceiling:
same tokens, same masks, the same embeddings (fp32 and int8 alike: int8's activation ranges are
fixed at prepare, so padding no longer moves it; tests/test_int8_batch.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inference import export
from inference.backends.factory import make_backend
from inference.backends.onnx import OnnxBackend
from inference.manifest import Manifest
from inference.padding import tight_length, trim
from inference.settings import Settings
from inference.tokenizer import QueryTokenizer
from loadtest.queries import QueryMix
from tests.components import require_variant


def _mask(lengths: list[int], width: int) -> np.ndarray:
    m = np.zeros((len(lengths), width), dtype=np.int64)
    for row, n in enumerate(lengths):
        m[row, :n] = 1
    return m


@pytest.mark.parametrize(("lengths", "width", "multiple", "want"), [
    ([5], 16, 1, 5), ([5, 11, 3], 16, 1, 11), ([5, 11], 16, 8, 16), ([9], 32, 8, 16), ([17], 32, 8, 24),
    ([30], 32, 8, 32), ([16], 16, 1, 16), ([0, 0], 16, 1, 1), ([31], 32, 64, 32),
])
def test_tight_length(lengths: list[int], width: int, multiple: int, want: int) -> None:
    assert tight_length(_mask(lengths, width), multiple) == want


def test_trim_keeps_every_token_and_mask(tokenizer: QueryTokenizer) -> None:
    ids = tokenizer.encode(["tea", "best marathon training shoes for women"]).ids
    batch = tokenizer.batch(ids, length=32)
    cut = trim(batch, 1)
    assert cut.shape == (2, max(len(x) for x in ids))
    n = cut.shape[1]
    assert np.array_equal(cut.input_ids, batch.input_ids[:, :n])
    assert np.array_equal(cut.attention_mask, batch.attention_mask[:, :n])
    assert not batch.attention_mask[:, n:].any()  # only columns of padding went
    assert cut.input_ids.flags.c_contiguous
    assert (cut.token_type_ids is None) == (batch.token_type_ids is None)
    assert trim(cut, 1) is cut  # nothing left to cut: the same batch


def _queries(tokenizer: QueryTokenizer) -> list[list[int]]:
    texts = [*QueryMix(tokenizer, seed=5, unique=True).take(12), "tea", "milk", "x " * 40]
    return tokenizer.encode(texts).ids


def _embed_all(backend: OnnxBackend, tokenizer: QueryTokenizer, ids: list[list[int]]) -> np.ndarray:
    """Each query alone at its bucket, then all of them as one batch padded to the largest bucket."""
    alone = [backend.embed_sync(tokenizer.batch([x])) for x in ids]
    together = backend.embed_sync(tokenizer.batch(ids, length=tokenizer.batch(ids).shape[1]))
    return np.vstack([*alone, together])


def test_exact_padding_equals_bucket_padding_fp32(model_dir: Path, manifest: Manifest,
                                                   tokenizer: QueryTokenizer) -> None:
    ids = _queries(tokenizer)
    bucket = OnnxBackend(model_dir, manifest, variant="fp32", threads=2, pad_multiple=0)
    exact = OnnxBackend(model_dir, manifest, variant="fp32", threads=2, pad_multiple=1)
    eight = OnnxBackend(model_dir, manifest, variant="fp32", threads=2, pad_multiple=8, small_pass_tokens=64)
    want = _embed_all(bucket, tokenizer, ids)
    for backend in (exact, eight):
        np.testing.assert_allclose(_embed_all(backend, tokenizer, ids), want, rtol=0, atol=1e-5)


def test_exact_padding_equals_bucket_padding_int8(model_dir: Path, manifest: Manifest,
                                                   tokenizer: QueryTokenizer) -> None:
    require_variant(manifest, "int8")
    ids = _queries(tokenizer)
    ref = _embed_all(OnnxBackend(model_dir, manifest, variant="fp32", threads=2, pad_multiple=1), tokenizer, ids)
    bucket = _embed_all(OnnxBackend(model_dir, manifest, variant="int8", threads=2, pad_multiple=0), tokenizer, ids)
    exact = _embed_all(OnnxBackend(model_dir, manifest, variant="int8", threads=2, pad_multiple=1), tokenizer, ids)
    np.testing.assert_allclose(exact, bucket, rtol=0, atol=export.BATCH_MAX_ABS)
    assert (exact * ref).sum(axis=1).min() >= 0.98


def test_small_pass_session_gives_the_same_embeddings(model_dir: Path, manifest: Manifest,
                                                      tokenizer: QueryTokenizer) -> None:
    ids = _queries(tokenizer)
    main = OnnxBackend(model_dir, manifest, variant="int8", threads=2, pad_multiple=1)
    split = OnnxBackend(model_dir, manifest, variant="int8", threads=2, pad_multiple=1, small_pass_tokens=64)
    split.warm_up()
    assert split._small is not None
    np.testing.assert_allclose(_embed_all(split, tokenizer, ids), _embed_all(main, tokenizer, ids), rtol=0, atol=1e-5)
    one = OnnxBackend(model_dir, manifest, variant="int8", threads=1, small_pass_tokens=64)
    one.load()
    assert one._small is None


def test_settings_default_to_exact_padding_without_spinning(model_dir: Path) -> None:
    env = {"EMBEDCAR_MODEL_MODELS_DIR": str(model_dir.parent), "EMBEDCAR_MODEL_NAME": model_dir.name}
    s = Settings.load(environ=env)
    assert s.model.ort_spinning is False
    backend = make_backend(s, "embedded")
    assert isinstance(backend, OnnxBackend)
    assert backend.pad_multiple == 1 and backend._spinning is False
    old = Settings.load(environ=env | {"EMBEDCAR_MODEL_PAD_MULTIPLE": "0"})
    assert make_backend(old, "embedded").pad_multiple == 0  # type: ignore[attr-defined]
