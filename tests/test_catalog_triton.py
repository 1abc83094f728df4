"""The batch job over a real tritonserver: same vectors and model id as the embedded backend."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from catalog import store
from catalog.job import BuildSummary, build
from catalog.sources import Loaded
from catalog.spec import BuildSpec
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.manifest import Manifest

pytestmark = pytest.mark.triton


def test_triton_build_matches_the_embedded_build(
        settings: Settings, tmp_path: Path, manifest: Manifest, onnx_backend: OnnxBackend,
        grocery_slice: Loaded, grocery_build: BuildSummary, triton_server: Any) -> None:
    from inference.backends.triton import TritonBackend
    from tests.fixtures_catalog import catalog_settings_for

    s = catalog_settings_for(settings, tmp_path / "idx", in_flight=4)
    n = 96
    small = Loaded(grocery_slice.products[:n], [], "slice")

    async def run() -> BuildSummary:
        backend = TritonBackend([triton_server.grpc_url], manifest, variant="fp32", timeout_s=30.0)
        try:
            return await build(s, BuildSpec(), backend=backend, loaded=small, progress=False)
        finally:
            await backend.close()

    summary = asyncio.run(run())
    assert summary.model_id == onnx_backend.version_id  # one vector space, one id
    assert summary.version_dir is not None and grocery_build.version_dir is not None
    got = np.load(summary.version_dir / store.VECTORS_FILE)
    want = np.load(grocery_build.version_dir / store.VECTORS_FILE)[:n]
    assert float(np.min(np.sum(got * want, axis=1))) > 0.9999
