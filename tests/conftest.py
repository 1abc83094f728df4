"""Shared fixtures: the real prepared model (made by `make test` before pytest runs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.embedder import load_tokenizer
from inference.manifest import Manifest, load_manifest
from inference.tokenizer import QueryTokenizer

pytest_plugins = [
    "tests.fixtures_triton",
    "tests.fixtures_sidecar",
    "tests.fixtures_catalog",
    "tests.fixtures_demo",
    "tests.fixtures_loadtest",
]

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"


@pytest.fixture(scope="session")
def settings() -> Settings:
    # fp32: the golden vectors and the session's shared indexes are the exact model's (the int8 default
    # has tests of its own).
    return Settings.load(environ={}, overrides={"model": {"models_dir": ROOT / "models", "variant": "fp32"}})


@pytest.fixture(scope="session")
def model_dir(settings: Settings) -> Path:
    d = settings.model.model_dir
    if not (d / "manifest.json").exists():
        pytest.fail(f"no prepared model in {d}: run `make test` (it runs `embedcar model prepare`)")
    return d


@pytest.fixture(scope="session")
def manifest(model_dir: Path) -> Manifest:
    return load_manifest(model_dir)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path, manifest: Manifest) -> QueryTokenizer:
    return load_tokenizer(model_dir, manifest)


@pytest.fixture(scope="session")
def onnx_backend(model_dir: Path, manifest: Manifest) -> Iterator[OnnxBackend]:
    b = OnnxBackend(model_dir, manifest, variant="fp32", threads=2)
    b.warm_up()
    yield b
