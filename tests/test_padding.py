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
from inference.tokenizer import QueryTokenizer, TokenBatch
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


def _embed_all(backend: OnnxBackend, tokenizer: QueryTokenizer, ids: list[list[int]], *,
               bucket: bool = False) -> np.ndarray:
    """Each query alone at its bucket, then all of them as one batch padded to the largest bucket;
    `bucket`: each pass computed at its bucket's length (the old padding), not cut to its longest."""
    def embed(batch: TokenBatch) -> np.ndarray:
        if not bucket:
            return backend.embed_sync(batch)
        hidden = backend.hidden_sync(batch)  # the batch as given: no cut
        return backend.head(hidden, batch.attention_mask, input_ids=batch.input_ids, skip=batch.pool_skip)

    alone = [embed(tokenizer.batch([x])) for x in ids]
    together = embed(tokenizer.batch(ids, length=tokenizer.batch(ids).shape[1]))
    return np.vstack([*alone, together])


def test_exact_padding_equals_bucket_padding_fp32(model_dir: Path, manifest: Manifest,
                                                   tokenizer: QueryTokenizer) -> None:
    ids = _queries(tokenizer)
    backend = OnnxBackend(model_dir, manifest, variant="fp32", threads=2)
    np.testing.assert_allclose(_embed_all(backend, tokenizer, ids), _embed_all(backend, tokenizer, ids, bucket=True),
                               rtol=0, atol=1e-5)


def test_exact_padding_equals_bucket_padding_int8(model_dir: Path, manifest: Manifest,
                                                   tokenizer: QueryTokenizer) -> None:
    require_variant(manifest, "int8")
    ids = _queries(tokenizer)
    ref = _embed_all(OnnxBackend(model_dir, manifest, variant="fp32", threads=2), tokenizer, ids)
    int8 = OnnxBackend(model_dir, manifest, variant="int8", threads=2)
    bucket, exact = _embed_all(int8, tokenizer, ids, bucket=True), _embed_all(int8, tokenizer, ids)
    np.testing.assert_allclose(exact, bucket, rtol=0, atol=export.BATCH_MAX_ABS)
    assert (exact * ref).sum(axis=1).min() >= 0.98


def test_settings_make_an_exactly_padded_backend(model_dir: Path, tokenizer: QueryTokenizer) -> None:
    env = {"EMBEDCAR_MODEL_MODELS_DIR": str(model_dir.parent), "EMBEDCAR_MODEL_NAME": model_dir.name}
    backend = make_backend(Settings.load(environ=env), "embedded")
    assert isinstance(backend, OnnxBackend)
    seen: list[tuple[int, int]] = []
    hidden_sync = backend.hidden_sync

    def spy(batch: TokenBatch) -> np.ndarray:
        seen.append(batch.shape)
        return hidden_sync(batch)

    backend.hidden_sync = spy  # type: ignore[method-assign]
    backend.embed_sync(tokenizer.batch(tokenizer.encode(["tea"]).ids, length=32))
    assert seen == [(1, len(tokenizer.encode(["tea"]).ids[0]))]
