"""LangChain's `OpenAIEmbeddings` (langchain-openai) and LlamaIndex's `OpenAIEmbedding` /
`OpenAILikeEmbedding` (llama-index-embeddings-openai, -openai-like), unmodified from PyPI, against the
sidecar's HTTP facade, configured as docs/integrations/python-frameworks.md says; and what the
defaults that page warns about do instead. Each framework's tests skip where its package is not
installed (neither is a dependency of the project).

What each sends, read in its source (langchain_openai/embeddings/base.py, llama_index/embeddings/
openai/base.py): both call the `openai` client's `embeddings.create` (base64 on the wire); LangChain
by default first tokenizes with tiktoken and sends token ids, LlamaIndex replaces newlines by spaces.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from embedcar_settings import Settings
from tests.integrations_common import KEY, TITLES, WRONG_KEY, EngineSidecar, engine_sidecar


@pytest.fixture(scope="module")
def car(settings: Settings, model_dir: object) -> Iterator[EngineSidecar]:
    with engine_sidecar(settings) as c:
        yield c


@pytest.fixture
def langchain_openai() -> Any:  # the module (importorskip is untyped)
    return pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (not a dependency of "
                               "this project): pip install langchain-openai to run LangChain's client here")


@pytest.fixture
def llama_openai() -> Any:  # the module (importorskip is untyped)
    return pytest.importorskip("llama_index.embeddings.openai", reason="llama-index-embeddings-openai is not "
                               "installed (not a dependency of this project): pip install "
                               "llama-index-embeddings-openai")


@pytest.fixture
def llama_openai_like() -> Any:  # the module (importorskip is untyped)
    return pytest.importorskip("llama_index.embeddings.openai_like", reason="llama-index-embeddings-openai-like is "
                               "not installed (not a dependency of this project): pip install "
                               "llama-index-embeddings-openai-like")


def f32(rows: Any) -> np.ndarray[Any, np.dtype[np.float32]]:
    return np.asarray(rows, dtype=np.float32)


# --- LangChain -------------------------------------------------------------------------------------------
def lc_embeddings(langchain_openai: ModuleType, car: EngineSidecar, **kw: Any) -> Any:
    """As the docs configure it: the served model, the facade's /v1, the key, raw text (no tiktoken)."""
    return langchain_openai.OpenAIEmbeddings(**{
        "model": car.model, "base_url": f"{car.http}/v1", "api_key": KEY, "check_embedding_ctx_length": False,
        "chunk_size": 256, "max_retries": 0, **kw})


def test_langchain_documents_and_queries_equal_grpc(langchain_openai: ModuleType, car: EngineSidecar) -> None:
    ref = car.reference(TITLES)
    emb = lc_embeddings(langchain_openai, car)
    assert np.array_equal(f32(emb.embed_documents(TITLES)), ref)  # base64 on the wire: exact float32
    assert np.array_equal(f32(emb.embed_query(TITLES[-1])), ref[-1])
    # chunk_size splits a batch into several requests, answered in order
    assert np.array_equal(f32(lc_embeddings(langchain_openai, car, chunk_size=4).embed_documents(TITLES)), ref)


async def test_langchain_async_and_dimensions(langchain_openai: ModuleType, car: EngineSidecar) -> None:
    ref = car.reference(TITLES)
    assert np.array_equal(f32(await lc_embeddings(langchain_openai, car).aembed_documents(TITLES)), ref)
    short = f32(await lc_embeddings(langchain_openai, car, dimensions=64).aembed_query("greek yogurt"))
    assert short.shape == (64,) and abs(float(np.linalg.norm(short)) - 1.0) < 1e-5


def test_langchain_errors(langchain_openai: ModuleType, car: EngineSidecar) -> None:
    import openai

    with pytest.raises(openai.AuthenticationError, match="wrong API key"):
        lc_embeddings(langchain_openai, car, api_key=WRONG_KEY).embed_query("milk")
    with pytest.raises(openai.NotFoundError, match=car.model):  # its default model name is OpenAI's
        lc_embeddings(langchain_openai, car, model="text-embedding-ada-002").embed_query("milk")


def offline_tiktoken(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiktoken without its download (no internet here): one token per byte. LangChain's default path
    runs as it would with cl100k_base, and sends token ids."""
    import tiktoken

    enc = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={})
    monkeypatch.setattr(tiktoken, "encoding_for_model", lambda _name: enc)


def test_langchain_default_sends_token_ids_and_gets_a_400(langchain_openai: ModuleType, car: EngineSidecar,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import openai

    offline_tiktoken(monkeypatch)
    emb = lc_embeddings(langchain_openai, car, check_embedding_ctx_length=True)
    with pytest.raises(openai.BadRequestError, match="token arrays") as got:
        emb.embed_query("greek yogurt")
    assert got.value.status_code == 400


def test_langchain_default_400_says_what_to_set(langchain_openai: ModuleType, car: EngineSidecar,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import openai

    offline_tiktoken(monkeypatch)
    emb = lc_embeddings(langchain_openai, car, check_embedding_ctx_length=True)
    with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length=False"):
        emb.embed_query("greek yogurt")


# --- LlamaIndex ------------------------------------------------------------------------------------------
def test_llamaindex_model_name_equals_grpc(llama_openai: ModuleType, car: EngineSidecar) -> None:
    ref = car.reference(TITLES)
    emb = llama_openai.OpenAIEmbedding(model_name=car.model, api_base=f"{car.http}/v1", api_key=KEY, max_retries=0)
    assert np.array_equal(f32(emb.get_text_embedding_batch(TITLES)), ref)
    assert np.array_equal(f32(emb.get_query_embedding(TITLES[-1])), ref[-1])
    # `model` is checked against OpenAI's own names before any request: the served name is refused
    with pytest.raises(ValueError, match="not a valid OpenAIEmbeddingModelType"):
        llama_openai.OpenAIEmbedding(model=car.model, api_base=f"{car.http}/v1", api_key=KEY)


async def test_llamaindex_openai_like_equals_grpc(llama_openai_like: ModuleType, car: EngineSidecar) -> None:
    like = llama_openai_like
    ref = car.reference(TITLES)
    emb = like.OpenAILikeEmbedding(model_name=car.model, api_base=f"{car.http}/v1", api_key=KEY, max_retries=0,
                                   embed_batch_size=4)
    assert np.array_equal(f32(await emb.aget_text_embedding_batch(TITLES)), ref)
    short = like.OpenAILikeEmbedding(model_name=car.model, api_base=f"{car.http}/v1", api_key=KEY, dimensions=64)
    assert f32(short.get_query_embedding("greek yogurt")).shape == (64,)
