"""Model versions on a Triton pool: a client calls only its own version's ensemble, so a Triton that
serves another version (restarted with the next model's repository, say) is down for it, never a
source of another model's vectors; and one repository serves several models at once.

Real tritonservers and sidecars. Version A is the bundled model's fp32, version B its int8 (another
variant id, other vectors); the second model is the bundled one copied under another name (files
linked, manifest renamed: another version id).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from pathlib import Path

import numpy as np
import pytest

from embedcar_client.client import Client
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.backends.triton import TritonBackend
from inference.embedder import Embedder
from inference.errors import Unavailable
from inference.manifest import MANIFEST_FILE, Manifest, load_manifest
from inference.tokenizer import QueryTokenizer
from inference.triton.launcher import TritonServer
from inference.triton.names import served_names
from sidecar.app import SidecarThread
from tests.components import require_triton, require_variant
from tests.fixtures_triton import triton_settings
from tests.test_sidecar_embed import reference
from tests.test_sidecar_triton import triton_sidecar_settings

pytestmark = pytest.mark.triton


def _restart_as(server: TritonServer, settings: Settings, root: Path, variant: str) -> TritonServer:
    """Stop `server` and start another on its ports from a repository of `variant` (what an operator's
    restart with the next version's repository looks like to the clients)."""
    server.stop()
    other = TritonServer(triton_settings(settings, root), variant=variant, grpc_port=server.grpc_port,
                         http_port=server.http_port, metrics_port=server.metrics_port)
    return other.start()


async def _until(cond: object, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_triton_restarted_with_another_version_is_down_for_the_old_ones_clients(
        settings: Settings, own_triton: TritonServer, manifest: Manifest, onnx_backend: OnnxBackend,
        tokenizer: QueryTokenizer, tmp_path: Path) -> None:
    require_variant(manifest, "int8")
    a, b = served_names(manifest, "fp32"), served_names(manifest, "int8")
    texts = ["greek yogurt", "organic pasta sauce"]
    batch = tokenizer.batch(tokenizer.encode(texts).ids, length=16)
    backend = TritonBackend([own_triton.grpc_url], manifest, variant="fp32", timeout_s=10.0, probe_interval_s=0.2)
    await backend.start()
    # The sidecar keeps its default embedded fallback: it must answer with its own version's model.
    with SidecarThread(triton_sidecar_settings(settings, own_triton)) as sc, Client(sc.grpc_target) as c:
        before = c.embed(texts)
        assert before.backend == "triton" and before.model == manifest.variant_id("fp32")
        server = _restart_as(own_triton, settings, tmp_path / "b", "int8")
        try:
            assert server.ensembles == [b.ensemble]
            # Every call is refused (never B's vectors): first while the channel reconnects, then by
            # the new server, with an error naming both versions.
            for _ in range(200):
                with pytest.raises(Unavailable) as refused:
                    await backend.embed(batch)
                if "does not serve" in refused.value.message:
                    break
                await asyncio.sleep(0.05)
            assert re.search(rf"does not serve {re.escape(a.ensemble)} .*it serves {re.escape(b.ensemble)} "
                             rf"\({re.escape(b.variant_id)}\)", refused.value.message), refused.value.message
            # The probe finds the server answering, but not with this version: it stays down.
            await asyncio.sleep(1.0)  # five probe intervals with the new server up
            assert not backend.ready() and a.ensemble in backend.down_reason()
            # The sidecar's fresh queries come from its own version (the fallback), not from B.
            fresh = ["fresh query after the restart", "another fresh one"]
            r = c.embed(fresh)
            assert r.backend != "triton" and r.model == manifest.variant_id("fp32")
            own = (await Embedder(tokenizer, onnx_backend).embed(fresh)).embeddings  # version A, in-process
            np.testing.assert_allclose(r.embeddings, own, atol=1e-5)
            # Back on A: the same probe brings the endpoint back, nothing restarted on the client side.
            server = _restart_as(server, settings, tmp_path / "a", "fp32")
            await _until(backend.ready, "the probe never found version A back")
            assert (await backend.embed(batch)).shape == (2, manifest.dim)
        finally:
            server.stop()
            await backend.close()


def _renamed_copy(model_dir: Path, models: Path, name: str) -> Manifest:
    """The bundled model under another name: its files linked, its manifest renamed (a new version id)."""
    dst = models / name
    dst.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != MANIFEST_FILE:
            (dst / f.name).symlink_to(f.resolve())
    m = dataclasses.replace(load_manifest(model_dir), name=name).with_version()
    m.save(dst)
    return m


def test_one_repository_serves_two_models_to_one_sidecar(settings: Settings, model_dir: Path, manifest: Manifest,
                                                         onnx_backend: OnnxBackend, tokenizer: QueryTokenizer,
                                                         tmp_path: Path) -> None:
    require_triton()
    models = tmp_path / "models"
    models.mkdir()
    (models / model_dir.name).symlink_to(model_dir)
    other = _renamed_copy(model_dir, models, "minilm-copy")
    s = settings.with_section("triton", repo_dir=tmp_path / "repo")
    s = s.with_section("model", models_dir=models)
    with TritonServer(s, variant="fp32", models=(model_dir.name, other.name)) as server:
        assert sorted(server.ensembles) == sorted([served_names(manifest, "fp32").ensemble,
                                                   served_names(other, "fp32").ensemble])
        sc_settings = triton_sidecar_settings(s, server).with_section(
            "sidecar", models=(model_dir.name, other.name), embedded_fallback=False)
        texts = ["whole milk", "green tea"]
        want = reference(onnx_backend, tokenizer, texts)
        with SidecarThread(sc_settings) as sc, Client(sc.grpc_target) as c:
            for name, m in ((model_dir.name, manifest), (other.name, other)):
                r = c.embed(texts, model=name)
                assert r.backend == "triton" and r.model == m.variant_id("fp32"), name
                np.testing.assert_allclose(r.embeddings, want, atol=1e-5)
