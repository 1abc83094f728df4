"""Search through the sidecar over a real FAISS + tantivy index built by the catalog code in a temp folder."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from catalog import store
from catalog.lexical import LEXICAL_DIR
from catalog.publish import publish_index
from catalog.sources import Product
from embedcar_client.client import Client
from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.embedder import Embedder
from inference.errors import FailedPrecondition, InvalidInput, Unavailable
from inference.tokenizer import QueryTokenizer
from sidecar.app import Sidecar, SidecarThread
from sidecar.http_api import SEARCH_REPLY
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
    s = sidecar_settings(settings, http_port=-1, index_dir=root, poll_s=0.1)
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
        assert c.search(["goa"], k=3, mode="lexical").hits == [[]]
        more = [*PRODUCTS, ("p9", "Goat milk yogurt", "yogurt", "dairy eggs")]
        publish(settings, root, onnx_backend, tokenizer, more)
        assert wait_for(lambda: c.search(["milk"], k=1).index_version != first_version)
        assert "p9" in {h.id for h in c.search(["goat milk yogurt"], k=3).hits[0]}
        # The swap replaced the lexical index with the FAISS one: the new product's prefix finds it.
        assert [h.id for h in c.search(["goa"], k=3, mode="lexical").hits[0]] == ["p9"]
        assert c.search(["goa"], k=3, mode="hybrid").hits[0][0].id == "p9"


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



@pytest.fixture(scope="module")
def search_sidecar(settings: Settings, onnx_backend: OnnxBackend, tokenizer: QueryTokenizer,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A sidecar (gRPC + HTTP) serving PRODUCTS, lexical index included."""
    root = tmp_path_factory.mktemp("modes-index")
    publish(settings, root, onnx_backend, tokenizer, PRODUCTS)
    s = sidecar_settings(settings, index_dir=root).with_section("catalog", use_gpu=False)
    with SidecarThread(s, backend=onnx_backend) as sc:
        assert wait_for(lambda: sc.index.current() is not None)
        yield sc


def test_search_modes_say_which_leg_found_each_hit_and_time_each_leg(search_sidecar: Sidecar) -> None:
    with Client(search_sidecar.grpc_target) as c:
        semantic = c.search(["oat milk"], k=3)  # mode 0: what callers got before modes existed
        assert semantic.hits[0][0].id == "p2" and all(h.legs == ("semantic",) for h in semantic.hits[0])
        assert semantic.timings_ns["search"] > 0 and semantic.timings_ns["lexical"] == 0

        lexical = c.search(["oat mi"], k=3, mode="lexical")
        assert lexical.hits[0][0].id == "p2" and all(h.legs == ("lexical",) for h in lexical.hits[0])
        assert {h.id for h in lexical.hits[0]} == {"p1", "p2", "p8"}  # "mi": milk, and the salad "mix"
        assert lexical.timings_ns["lexical"] > 0 and lexical.timings_ns["inference"] == 0  # nothing embedded
        assert lexical.cache_hits == [False] and lexical.backend == ""

        hybrid = c.search(["oat mi", "chocolat"], k=4, mode="hybrid")
        assert hybrid.hits[0][0].id == "p2" and hybrid.hits[1][0].id == "p5"
        assert "lexical" in hybrid.hits[0][0].legs and len(hybrid.hits[0]) == 4
        assert any(h.legs == ("semantic",) for h in hybrid.hits[0])  # the semantic leg filled the rest
        assert hybrid.timings_ns["search"] > 0 and hybrid.timings_ns["lexical"] > 0
        assert hybrid.timings_ns["total"] >= hybrid.timings_ns["search"] + hybrid.timings_ns["lexical"]

        produce = c.search(["mi"], k=5, mode="hybrid", department="Produce")
        assert produce.hits[0] and {h.id for h in produce.hits[0]} <= {"p7", "p8"}  # both legs filtered


@pytest.mark.parametrize("mode", ["lexical", "hybrid"])
def test_operators_quotes_unicode_and_empty_prefixes_are_searched_safely(search_sidecar: Sidecar, mode: str) -> None:
    texts = ['"milk" AND (', "title:*", "milk OR -", "NOT oat", "/mi.*/", "🍌", "***", "Bananas,", "ｍｉｌｋ",
             "oat\u0000mi", "x" * 5000]
    with Client(search_sidecar.grpc_target) as c:
        r = c.search(texts, k=3, mode=mode)
        assert len(r.hits) == len(texts)
        by_text = dict(zip(texts, r.hits, strict=True))
        assert "p7" in {h.id for h in by_text["Bananas,"]}
        if mode == "lexical":
            assert by_text["***"] == [] and by_text["🍌"] == [] and by_text["title:*"] == []
            assert {h.id for h in by_text['"milk" AND (']} >= {"p1", "p2"}
            milk = c.search(["milk"], k=3, mode=mode).hits[0]
            assert [h.id for h in by_text["ｍｉｌｋ"]] == [h.id for h in milk]  # fullwidth letters folded
        else:
            assert all(len(hits) == 3 for hits in r.hits)  # the semantic leg answers what the lexical cannot
        for bad in ([""], ["   "]):
            with pytest.raises(InvalidInput):
                c.search(bad, k=3, mode=mode)


def test_filters_on_any_field_and_their_mistakes_over_grpc_stream_and_http(search_sidecar: Sidecar) -> None:
    """`filters` takes the index's filter fields by name, case-insensitively; a field the index lacks or a
    value no product has is INVALID_ARGUMENT / 400 naming what there is, never an empty list."""
    url = f"http://127.0.0.1:{search_sidecar.http_port}/v1/search"
    with Client(search_sidecar.grpc_target) as c:
        got = c.search(["milk"], k=5, mode="hybrid", filters={"Department": " DAIRY EGGS", "aisle": "eggs"})
        assert [h.id for h in got.hits[0]] == ["p4"]
        with pytest.raises(InvalidInput, match="has no filter field 'brand'; its filter fields: department, aisle"):
            c.search(["milk"], filters={"brand": "acme"})
        with pytest.raises(InvalidInput, match="has department 'frozn'; did you mean 'frozen'"):
            c.search(["pizza"], department="frozn", mode="lexical")
        with pytest.raises(InvalidInput, match="given twice"):
            c.search(["pizza"], department="frozen", filters={"department": "produce"})

        async def streamed() -> None:
            from embedcar_client.client import AsyncClient

            async with AsyncClient(search_sidecar.grpc_target, stream=True) as ac:
                with pytest.raises(InvalidInput, match="did you mean 'frozen'"):
                    await ac.search(["pizza"], filters={"department": "frozn"})
                ok = await ac.search(["pizza"], k=2, filters={"department": "frozen"})
                assert [h.id for h in ok.hits[0]] == ["p6"]

        asyncio.run(streamed())
    ok = httpx.post(url, json={"input": "milk", "filters": {"AISLE": "eggs"}}, timeout=30)
    assert ok.status_code == 200 and [h["id"] for h in ok.json()["data"][0]["hits"]] == ["p4"]
    for body, needle in (({"input": "milk", "filters": {"brand": "x"}}, "its filter fields: department, aisle"),
                         ({"input": "milk", "filters": {"aisle": "egs"}}, "did you mean 'eggs'"),
                         ({"input": "milk", "filters": ["aisle"]}, "`filters` must be an object"),
                         ({"input": "milk", "filters": {"aisle": 3}}, "`filters` must be an object")):
        bad = httpx.post(url, json=body, timeout=30)
        assert bad.status_code == 400 and needle in bad.json()["error"]["message"], (body, bad.text)


def test_an_unknown_search_mode_is_invalid_argument(search_sidecar: Sidecar) -> None:
    with grpc.insecure_channel(search_sidecar.grpc_target) as ch:
        call = ch.unary_unary("/embedcar.v1.Embedder/Search")
        with pytest.raises(grpc.RpcError) as err:
            call(pb.SearchRequest(texts=["milk"], mode=7).SerializeToString(), timeout=30)  # type: ignore[arg-type]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "search mode" in (err.value.details() or "")


def test_http_search_facade(search_sidecar: Sidecar) -> None:
    url = f"http://127.0.0.1:{search_sidecar.http_port}/v1/search"
    r = httpx.post(url, json={"input": ["oat mi"], "k": 3, "mode": "hybrid"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == set(SEARCH_REPLY)  # docs/http.md is written from that table
    assert body["mode"] == "hybrid" and body["index_version"] and body["timings_ns"]["lexical"] > 0
    top = body["data"][0]["hits"][0]
    assert top["id"] == "p2" and "lexical" in top["legs"] and top["fields"]["aisle"] == "dairy alternatives"
    semantic = httpx.post(url, json={"input": "whole milk", "department": "dairy eggs"}, timeout=30).json()
    assert semantic["mode"] == "semantic" and semantic["data"][0]["hits"][0]["legs"] == ["semantic"]
    assert len(semantic["data"][0]["hits"]) == 3  # the three dairy-eggs products
    for body_, needle in (({"input": "milk", "mode": "fuzzy"}, "search mode"), ({"input": "milk", "k": "3"}, "`k`"),
                          ({"input": "milk", "k": 500}, "k must"), ({"input": 5}, "`input`"),
                          ({"input": "milk", "modes": "x"}, "unknown fields"), ({"input": ""}, "empty")):
        bad = httpx.post(url, json=body_, timeout=30)
        assert bad.status_code == 400 and needle in bad.json()["error"]["message"], (body_, bad.text)
    assert httpx.post(url, content=b"{", timeout=30).status_code == 400
    lone = httpx.post(url, content=b'{"input": "oat mi\\ud800", "mode": "lexical"}', timeout=30)
    assert lone.status_code == 400 and "surrogate" in lone.json()["error"]["message"]


def test_an_index_version_without_a_lexical_index_serves_hybrid_as_semantic(
        settings: Settings, onnx_backend: OnnxBackend, tokenizer: QueryTokenizer, tmp_path: Path) -> None:
    root = tmp_path / "index"
    publish(settings, root, onnx_backend, tokenizer, PRODUCTS)
    version = store.newest_version(root)
    assert version is not None
    shutil.rmtree(version / LEXICAL_DIR)  # as versions were published before lexical search
    manifest = store.read_manifest(version)
    del manifest["lexical"]
    (version / store.MANIFEST_FILE).write_text(json.dumps(manifest))
    s = sidecar_settings(settings, http_port=-1, index_dir=root).with_section("catalog", use_gpu=False)
    with SidecarThread(s, backend=onnx_backend) as sc, Client(sc.grpc_target) as c:
        r = c.search(["oat milk"], k=3, mode="hybrid")
        assert r.hits[0][0].id == "p2" and all(h.legs == ("semantic",) for h in r.hits[0])
        with pytest.raises(FailedPrecondition, match="no lexical index"):
            c.search(["oat mi"], mode="lexical")
