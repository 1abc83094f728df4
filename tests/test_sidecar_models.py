"""Several models in one sidecar: each request names its model (gRPC field, OpenAI body), gets the
first by default, and an unknown name is refused listing the served ones. Real sidecar, real ORT:
the bundled MiniLM (384-d) beside a user's model prepared from a folder (a tiny CLS-pooled BERT
with a Dense head to 16 dimensions and E5 prompts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from embedcar_client.client import AsyncClient, Client
from embedcar_settings import Settings
from inference.backends.factory import make_backend
from inference.embedder import Embedder, load_tokenizer
from inference.errors import FailedPrecondition, InvalidInput
from inference.manifest import Manifest, load_manifest
from inference.prepare import prepare_model
from sidecar.app import Sidecar, SidecarThread
from sidecar.models import model_settings
from tests.fixtures_models import tiny_st_folder
from tests.fixtures_sidecar import sidecar_settings

MINE = "shop-tiny"


@pytest.fixture(scope="module")
def two_models(settings: Settings, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    root = tmp_path_factory.mktemp("two-models")
    models = root / "models"
    models.mkdir()
    (models / model_dir.name).symlink_to(model_dir)  # the bundled model, as prepared by `make test`
    src = tiny_st_folder(root / "st", "bert", pooling="cls", dense=16, prompts={"query": "query: "})
    prepare_model(models, MINE, from_dir=src, say=lambda _m: None)
    s = sidecar_settings(settings, models=(model_dir.name, MINE))
    s = s.with_section("model", models_dir=models, variant="")  # each model's own default variant
    with SidecarThread(s) as sc:
        yield sc


def _own(sc: Sidecar, name: str, texts: list[str]) -> tuple[np.ndarray, Manifest]:
    """What the named model computes for `texts` in-process, with its own default variant and prompt,
    on a backend built as the sidecar builds its own (int8's activation scales follow the padding)."""
    model_dir = sc.settings.model.models_dir / name
    m = load_manifest(model_dir)
    backend = make_backend(model_settings(sc.settings, name), "embedded")
    return asyncio.run(Embedder(load_tokenizer(model_dir, m), backend).embed(texts)).embeddings, m


def test_v1_models_lists_what_is_served_first_the_default(two_models: Sidecar) -> None:
    r = httpx.get(f"http://127.0.0.1:{two_models.http_port}/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert [d["id"] for d in data] == ["all-MiniLM-L6-v2", MINE]
    assert [d["default"] for d in data] == [True, False] and [d["dimensions"] for d in data] == [384, 16]
    assert all(d["object"] == "model" and "@" in d["version"] for d in data)


def test_http_embeddings_come_from_the_model_the_body_names(two_models: Sidecar) -> None:
    url = f"http://127.0.0.1:{two_models.http_port}/v1/embeddings"
    texts = ["greek yogurt", "organic pasta sauce"]
    mine = httpx.post(url, json={"input": texts, "model": MINE}).json()
    want, m = _own(two_models, MINE, texts)
    got = np.array([d["embedding"] for d in mine["data"]], dtype=np.float32)
    assert mine["model"] == m.variant_id(m.default_variant) and got.shape == (2, 16)
    np.testing.assert_allclose(got, want, atol=1e-5)  # its prompt, CLS pooling and Dense head applied
    default = httpx.post(url, json={"input": texts}).json()
    assert len(default["data"][0]["embedding"]) == 384 and default["model"].startswith("all-MiniLM-L6-v2@")
    # The version id names the model as well as its name does.
    by_version = httpx.post(url, json={"input": texts, "model": mine["model"]}).json()
    assert by_version["model"] == mine["model"]


def test_an_unknown_model_is_refused_listing_the_served_ones(two_models: Sidecar) -> None:
    r = httpx.post(f"http://127.0.0.1:{two_models.http_port}/v1/embeddings",
                   json={"input": "milk", "model": "text-embedding-3-small"})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "model_not_found"
    assert "all-MiniLM-L6-v2" in r.json()["error"]["message"] and MINE in r.json()["error"]["message"]
    with Client(two_models.grpc_target) as c, pytest.raises(InvalidInput, match=MINE):
        c.embed(["milk"], model="nope")
    assert two_models.serving  # refusals do not disturb the service


def test_grpc_unary_and_stream_take_the_model_field(two_models: Sidecar) -> None:
    with Client(two_models.grpc_target) as c:
        mine = c.embed(["whole milk"], model=MINE)
        default = c.embed(["whole milk"])
    assert mine.embeddings.shape == (1, 16) and default.embeddings.shape == (1, 384)
    assert mine.model.startswith(f"{MINE}@") and default.model.startswith("all-MiniLM-L6-v2@")

    async def streamed() -> tuple[int, int]:
        async with AsyncClient(two_models.grpc_target, stream=True) as ac:
            a, b = await asyncio.gather(ac.embed(["whole milk"], model=MINE), ac.embed(["whole milk"]))
            return a.embeddings.shape[1], b.embeddings.shape[1]

    assert asyncio.run(streamed()) == (16, 384)
    # Each model has its own cache: the same text is a hit in both now, with each model's vector.
    with Client(two_models.grpc_target) as c:
        again = c.embed(["whole milk"], model=MINE)
    assert again.cache_hits == [True] and np.array_equal(again.embeddings, mine.embeddings)


def _series(sc: Sidecar) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The sidecar's /metrics as {(sample name, labels): value}."""
    text = httpx.get(f"http://127.0.0.1:{sc.http_port}/metrics").text
    return {(smp.name, frozenset(smp.labels.items())): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def test_metrics_are_per_model_version(two_models: Sidecar) -> None:
    with Client(two_models.grpc_target) as c:
        version = c.embed(["metrics probe"], model=MINE).model
        before = _series(two_models)
        c.embed(["per model a", "per model b", "per model c"], model=MINE)
        after = _series(two_models)
    mine = {("model", MINE), ("version", version)}
    default = next(dict(labels) for (name, labels) in after if name == "embedcar_model_info"
                   and dict(labels)["model"] != MINE)

    def delta(name: str, labels: set[tuple[str, str]]) -> float:
        key = (name, frozenset(labels))
        return after[key] - before.get(key, 0.0)

    assert delta("embedcar_cache_misses_total", mine) == 3
    assert delta("embedcar_cache_misses_total", set(default.items())) == 0  # the other model saw nothing
    assert delta("embedcar_stage_seconds_count", mine | {("rpc", "embed"), ("stage", "total")}) == 1
    assert delta("embedcar_batch_size_count", mine) >= 1
    assert delta("embedcar_backend_answers_total", mine | {("backend", "embedded")}) == 1
    assert after[("embedcar_backend_up", frozenset(mine))] == 1
    assert after[("embedcar_cache_entries", frozenset(mine))] >= 4


def test_dimensions_truncates_and_renormalises(two_models: Sidecar) -> None:
    url = f"http://127.0.0.1:{two_models.http_port}/v1/embeddings"
    full = np.array(httpx.post(url, json={"input": "green tea"}).json()["data"][0]["embedding"], dtype=np.float32)
    short = np.array(httpx.post(url, json={"input": "green tea", "dimensions": 64}).json()["data"][0]["embedding"],
                     dtype=np.float32)
    assert short.shape == (64,) and abs(float(np.linalg.norm(short)) - 1.0) < 1e-5
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)
    too_many = httpx.post(url, json={"input": "green tea", "dimensions": 385})
    assert too_many.status_code == 400 and "dimension 384" in too_many.json()["error"]["message"]


def test_a_model_named_twice_is_refused_at_start(settings: Settings) -> None:
    # Several models on the Triton backend are served (tests/test_triton_versions.py); twice the same is not.
    s = sidecar_settings(settings, models=("a", "a"), backend="triton")
    with pytest.raises(FailedPrecondition, match="names a model twice"):
        Sidecar(s)
