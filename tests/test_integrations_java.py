"""The Java gRPC client (sidecar/java/, built by sidecar/java_client.py with Debian's grpc-java and
no Maven) against a real sidecar: what a JVM search node or a Vespa component would call.

`make test` installs the Debian packages when it can (`make java`); without them these tests skip
and say why.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from embedcar_client.client import Client
from embedcar_settings import Settings
from sidecar.java_client import build_java_client, java_command, java_unavailable_reason
from tests.integrations_common import KEY, TITLES, EngineSidecar, engine_sidecar
from tests.test_integrations_engines import langchain4j_parse, langchain4j_request


@pytest.fixture(scope="module")
def java_classes() -> Path:
    reason = java_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return build_java_client()


@pytest.fixture(scope="module")
def car(settings: Settings, model_dir: object, grocery_index_root: Path) -> Iterator[EngineSidecar]:
    with engine_sidecar(settings.with_section("catalog", use_gpu=False), index_dir=grocery_index_root) as c:
        yield c


def run_java(classes: Path, main: str, *args: str) -> str:
    done = subprocess.run(java_command(classes, main, *args), capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_java_example_answers_the_python_clients_vectors(java_classes: Path, car: EngineSidecar) -> None:
    texts = ["greek yogurt", *TITLES[:3]]
    out = json.loads(run_java(java_classes, "embedcar.client.Example", car.grpc, KEY, *texts))
    got = np.asarray(out["embeddings"], dtype=np.float32)
    ref = car.reference(texts)
    assert out["dim"] == 384 and got.shape == ref.shape
    cos = np.sum(got * ref, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos
    assert np.array_equal(got, ref)  # float32 decimals in, the same float32 out
    with Client(car.grpc, api_key=KEY) as c:
        py = c.search(texts[:1], k=3, mode="hybrid")
    assert [h["id"] for h in out["search"]] == [h.id for h in py.hits[0]]
    assert out["search"][0]["title"] and out["model"] == py.model
    assert out["spent_deadline"] == "DEADLINE_EXCEEDED"
    assert out["wrong_key"] == "UNAUTHENTICATED"
    # The same request three times as messages on one open Stream call: the unary call's vectors
    # each time; a wrong key ends the stream with the unary call's status.
    assert out["stream_embeddings"] == ["same", "same", "same"]
    assert out["wrong_key_stream"] == "UNAUTHENTICATED"


def test_jdk_http_client_with_langchain4j_headers(java_classes: Path, car: EngineSidecar, tmp_path: Path) -> None:
    """Solr's text-to-vector module reaches the facade through LangChain4j on the JDK HttpClient, which
    offers an h2c upgrade on plain http: the facade answers it over HTTP/1.1, and the body parses."""
    path, _headers, body = langchain4j_request(["Café Bustelo Espresso Ground Coffee"], car.model, KEY)
    (tmp_path / "body.json").write_bytes(body)
    head, reply = run_java(java_classes, "embedcar.client.JdkHttpProbe", car.http + path, KEY,
                           str(tmp_path / "body.json")).split("\n", 1)
    assert head == "HTTP_1_1 200", head
    vectors, _ = langchain4j_parse(reply.encode())
    assert np.array_equal(vectors[0], car.reference(["Café Bustelo Espresso Ground Coffee"])[0])
