"""The `openai` Python client (PyPI), unmodified, against the sidecar's HTTP facade: one more real
OpenAI-API client besides the engines' (tests/test_integrations_engines.py). It asks for base64 by
default and decodes it itself; its typed errors come from the status codes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import openai
import pytest

from embedcar_settings import Settings
from tests.integrations_common import KEY, TITLES, WRONG_KEY, EngineSidecar, engine_sidecar


@pytest.fixture(scope="module")
def car(settings: Settings, model_dir: object) -> Iterator[EngineSidecar]:
    with engine_sidecar(settings) as c:
        yield c


def client(car: EngineSidecar, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{car.http}/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_client_embeddings_equal_grpc(car: EngineSidecar) -> None:
    ref = car.reference(TITLES)
    with client(car) as c:
        default = c.embeddings.create(model=car.model, input=TITLES)  # encoding_format=base64 on the wire
        floats = c.embeddings.create(model=car.model, input=TITLES, encoding_format="float", user="shop")
        one = c.embeddings.create(model=car.model, input="greek yogurt")
    for r in (default, floats):
        assert [d.index for d in r.data] == list(range(len(TITLES)))
        got = np.asarray([d.embedding for d in r.data], dtype=np.float32)
        assert np.array_equal(got, ref)
        assert r.usage.prompt_tokens == r.usage.total_tokens > len(TITLES)
    assert np.array_equal(np.asarray(one.data[0].embedding, dtype=np.float32), ref[-1])


def test_openai_client_dimensions_and_models(car: EngineSidecar) -> None:
    with client(car) as c:
        r = c.embeddings.create(model=car.model, input=TITLES[:2], dimensions=32)
        listed = c.models.list()
    got = np.asarray([d.embedding for d in r.data], dtype=np.float32)
    assert got.shape == (2, 32)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert [m.id for m in listed.data] == [car.model]


def test_openai_client_errors_are_typed(car: EngineSidecar) -> None:
    with client(car, WRONG_KEY) as c, pytest.raises(openai.AuthenticationError):
        c.embeddings.create(model=car.model, input="milk")
    with client(car) as c:
        with pytest.raises(openai.NotFoundError, match=car.model):
            c.embeddings.create(model="text-embedding-3-small", input="milk")
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            c.embeddings.create(model=car.model, input="milk", dimensions=4096)
        with pytest.raises(openai.BadRequestError, match="token arrays"):
            c.embeddings.create(model=car.model, input=[[101, 2023]])
