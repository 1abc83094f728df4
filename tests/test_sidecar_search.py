"""Search through the sidecar over a real FAISS index built by the catalog code in a temp folder."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from catalog.publish import publish_index
from catalog.sources import Product
from demo_ui.settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.embedder import Embedder
from inference.errors import FailedPrecondition, InvalidInput, Unavailable
from inference.tokenizer import QueryTokenizer
from sidecar.app import SidecarThread
from sidecar.client import Client
from tests.fixtures_sidecar import sidecar_settings
from tests.test_sidecar_reliability import wait_for

PRODUCTS = [
    ("p1", "Organic whole milk 1 gallon", "dairy", "dairy eggs"),
    ("p2", "Oat milk barista edition", "dairy alternatives", "dairy eggs"),
    ("p3", "Sourdough bread loaf", "bakery", "bakery"),
    ("p4", "Free range large eggs dozen", "eggs", "dairy eggs"),
    ("p5", "Dark chocolate bar 85% cocoa", "candy chocolate", "snacks"),
    ("p6", "Frozen pepperoni pizza", "frozen pizza", "frozen"),
    ("p7", "Bananas, bunch", "fresh fruits", "produce"),
    ("p8", "Baby spinach salad mix", "packaged vegetables", "produce"),
]


def publish(settings: Settings, root: Path, onnx_backend: OnnxBackend, tokenizer: QueryTokenizer,
            products: list[tuple[str, str, str, str]]) -> None:
    items = [Product(pid, {"title": t, "aisle": a, "department": d}, n + 1)
             for n, (pid, t, a, d) in enumerate(products)]
    vectors = asyncio.run(Embedder(tokenizer, onnx_backend).embed([p.fields["title"] for p in items])).embeddings
    s = settings.with_section("catalog", index_root=root, index_type="flat", use_gpu=False)
    publish_index(s, vectors, items, {"model_id": onnx_backend.version_id})


def test_search_unavailable_until_index_then_hot_reload(settings: Settings, onnx_backend: OnnxBackend,
                                                        tokenizer: QueryTokenizer, tmp_path: Path) -> None:
    root = tmp_path / "index"
    root.mkdir()
    s = sidecar_settings(settings, http_port=-1, index_dir=root, index_poll_s=0.1)
    s = s.with_section("catalog", use_gpu=False)
    with SidecarThread(s, backend=onnx_backend) as sc, Client(sc.grpc_target) as c:
        with pytest.raises(Unavailable, match="no product index"):
            c.search(["milk"])
        assert c.embed(["milk"]).embeddings.shape == (1, 384)  # Embed does not need the index

        publish(settings, root, onnx_backend, tokenizer, PRODUCTS)
        assert wait_for(lambda: sc.index.current() is not None)
        r = c.search(["whole milk", "chocolate"], k=3)
        assert [len(h) for h in r.hits] == [3, 3]
        assert r.hits[0][0].id == "p1" and r.hits[1][0].id == "p5"
        assert r.hits[0][0].fields["aisle"] == "dairy"
        assert r.hits[0][0].score >= r.hits[0][1].score
        assert r.model == onnx_backend.version_id and r.timings_ns["search"] > 0
        assert r.cache_hits == [False, False]
        assert c.search(["whole milk"], k=3).cache_hits == [True]

        only_produce = c.search(["milk"], k=5, department="produce")
        assert {h.id for h in only_produce.hits[0]} <= {"p7", "p8"}

        with pytest.raises(InvalidInput):
            c.search([""], k=3)

        first_version = r.index_version
        more = [*PRODUCTS, ("p9", "Goat milk yogurt", "yogurt", "dairy eggs")]
        publish(settings, root, onnx_backend, tokenizer, more)
        assert wait_for(lambda: c.search(["milk"], k=1).index_version != first_version)
        assert "p9" in {h.id for h in c.search(["goat milk yogurt"], k=3).hits[0]}


def test_search_without_index_dir_is_a_failed_precondition(sidecar_client: Client) -> None:
    # A configuration error: UNAVAILABLE would tell the client to retry something that cannot work.
    with pytest.raises(FailedPrecondition, match="no index_dir") as err:
        sidecar_client.search(["milk"])
    assert not isinstance(err.value, Unavailable) and err.value.code == "failed_precondition"


def test_search_on_an_index_of_another_model_is_a_failed_precondition(
        settings: Settings, onnx_backend: OnnxBackend, tmp_path: Path) -> None:
    root = tmp_path / "index"
    items = [Product(pid, {"title": t, "aisle": a, "department": d}, n + 1)
             for n, (pid, t, a, d) in enumerate(PRODUCTS)]
    vectors = np.zeros((len(items), onnx_backend.dim), dtype=np.float32)
    vectors[:, 0] = 1.0
    s = settings.with_section("catalog", index_root=root, index_type="flat", use_gpu=False)
    publish_index(s, vectors, items, {"model_id": "some-other-model@fp32"})
    s = sidecar_settings(s, http_port=-1, index_dir=root)
    with SidecarThread(s, backend=onnx_backend) as sc, Client(sc.grpc_target) as c, \
            pytest.raises(FailedPrecondition, match="built with model some-other-model"):
        c.search(["milk"])

