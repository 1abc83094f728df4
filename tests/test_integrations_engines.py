"""Contract tests: each search engine's embedding connector, replayed against a real sidecar.

For every connector the request is rebuilt byte for byte as the engine's own code builds it (the
source of each builder is cited beside it), sent to a sidecar on a free port configured as
docs/integrations/ says, and the answer is read by a parser that reads exactly the fields the
engine reads, as strictly as it does. A renamed or retyped reply field, or a body the sidecar
stops accepting, fails here. No engine runs here: what is replayed is each engine's request and
response code as published (upstream source and reference docs, read 2026-12).

Elasticsearch (`openai` inference service with a custom `url`), OpenSearch ML Commons (OpenAI
connector blueprint, with and without its pre/post-processing functions) and Solr's text-to-vector
module (LangChain4j's OpenAiEmbeddingModel) all speak the OpenAI embeddings API. Vespa calls out
from a Java component; its contract is the gRPC API, checked by tests/test_integrations_java.py.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from embedcar_settings import Settings
from sidecar.http_protocol import offers_upgrade
from tests.integrations_common import ENGINE_BATCH, KEY, TITLES, WRONG_KEY, EngineSidecar, engine_sidecar

F32 = npt.NDArray[np.float32]


class ContractError(AssertionError):
    """The engine's own parser would have refused this answer."""


@pytest.fixture(scope="module")
def car(settings: Settings, model_dir: object) -> Iterator[EngineSidecar]:
    with engine_sidecar(settings) as c:
        yield c


def post(url: str, headers: dict[str, str], body: bytes) -> httpx.Response:
    # content=bytes: the body goes out exactly as the engine serialised it, not re-encoded.
    return httpx.post(url, headers=headers, content=body, timeout=60)


def compact(doc: dict[str, Any]) -> bytes:
    """JSON as Jackson writes it (Elasticsearch XContent, LangChain4j): no spaces, UTF-8 unescaped."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def assert_unit_dot_product_ready(vectors: list[F32]) -> None:
    """Elasticsearch's `dot_product` dense_vector refuses a vector whose float32 squared magnitude is
    off 1 by more than 1e-4 (DenseVectorFieldMapper.checkVectorMagnitude); OpenSearch and Solr's
    dot-product spaces assume unit length too."""
    for v in vectors:
        sq = float(np.sum(v * v, dtype=np.float32))
        assert abs(sq - 1.0) <= 1e-4, sq


# --- Elasticsearch: inference API, `openai` service -------------------------------------------------
# PUT _inference/text_embedding/embedcar
#   {"service": "openai", "service_settings": {"api_key": KEY, "model_id": <served model>,
#    "url": "http://127.0.0.1:8080/v1/embeddings"[, "dimensions": n]}, "task_settings": {"user": ...}}


def es_openai_request(texts: list[str], model_id: str, *, api_key: str, user: str | None = None,
                      dimensions: int | None = None, organization: str | None = None) -> tuple[dict[str, str], bytes]:
    """x-pack/plugin/inference/.../services/openai/request/OpenAiEmbeddingsRequest.java: Content-Type
    `application/json`, the secret applied as `Authorization: Bearer`, `OpenAI-Organization` when
    organization_id is set. Body: OpenAiEmbeddingsRequestEntity.toXContent: `input` (always a list),
    `model`, `user` if the task settings have one, `dimensions` only if the user set it."""
    doc: dict[str, Any] = {"input": texts, "model": model_id}
    if user is not None:
        doc["user"] = user
    if dimensions is not None:
        doc["dimensions"] = dimensions
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    if organization is not None:
        headers["OpenAI-Organization"] = organization
    return headers, compact(doc)


def es_openai_parse(body: bytes) -> list[F32]:
    """OpenAiEmbeddingsResponseEntity.fromResponse: `data` is a required array (unknown fields
    ignored); each entry's `embedding` is a float array or a base64 little-endian float32 string,
    anything else or a missing one fails; entries are taken in array order (`index` is not read)."""
    doc = json.loads(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ContractError("[EmbeddingFloatResult] failed to parse field [data]")
    out = []
    for entry in doc["data"]:
        emb = entry.get("embedding") if isinstance(entry, dict) else None
        if isinstance(emb, str):
            raw = base64.b64decode(emb, validate=True)
            if len(raw) % 4:
                raise ContractError("[embedding] base64-decoded length is not a multiple of 4")
            out.append(np.frombuffer(raw, dtype="<f4").astype(np.float32))
        elif isinstance(emb, list) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in emb):
            out.append(np.asarray(emb, dtype=np.float32))
        else:
            raise ContractError("Required [embedding]: a float array or a base64 string")
    return out


def es_error_message(body: bytes) -> str:
    """ErrorMessageResponseEntity: an error reply's `error.message` is what Elasticsearch reports."""
    doc = json.loads(body)
    message = doc["error"]["message"]
    assert isinstance(message, str) and message
    return message


def test_elasticsearch_openai_endpoint_creation_probe(car: EngineSidecar) -> None:
    """PUT _inference calls the endpoint once with "how big" (ServiceUtils.getEmbeddingSize) and
    records the answer's length as the endpoint's dimensions."""
    headers, body = es_openai_request(["how big"], car.model, api_key=KEY)
    r = post(f"{car.http}/v1/embeddings", headers, body)
    assert r.status_code == 200, r.text
    vectors = es_openai_parse(r.content)
    assert len(vectors) == 1 and vectors[0].shape == (384,)
    assert np.array_equal(vectors[0], car.reference(["how big"])[0])
    assert_unit_dot_product_ready(vectors)


def test_elasticsearch_openai_ingest_batch_in_input_order(car: EngineSidecar) -> None:
    """semantic_text / the inference processor send up to EMBEDDING_MAX_BATCH_SIZE (2048) texts in one
    request, with the task settings' `user`; the answers must come back in input order, since the
    parser ignores `index`."""
    texts = [f"{TITLES[i % 97 % len(TITLES)]} #{i % 97}" for i in range(ENGINE_BATCH)]  # 97 distinct, repeated
    headers, body = es_openai_request(texts, car.model, api_key=KEY, user="catalog-ingest", organization="shop")
    r = post(f"{car.http}/v1/embeddings", headers, body)
    assert r.status_code == 200, r.text[:300]
    vectors = es_openai_parse(r.content)
    assert len(vectors) == ENGINE_BATCH
    ref = car.reference(texts[:97])
    for i in (0, 1, 96, 97, 1000, ENGINE_BATCH - 1):
        assert np.array_equal(vectors[i], ref[i % 97]), i
    assert_unit_dot_product_ready(vectors[:50])


def test_elasticsearch_openai_dimensions_and_base64(car: EngineSidecar) -> None:
    """`dimensions` set in service_settings is sent on every call and the answers must have that
    length and, for `dot_product`, unit length; the parser also takes OpenAI's base64 shape."""
    headers, body = es_openai_request(TITLES, car.model, api_key=KEY, dimensions=128)
    vectors = es_openai_parse(post(f"{car.http}/v1/embeddings", headers, body).content)
    assert [v.shape for v in vectors] == [(128,)] * len(TITLES)
    assert_unit_dot_product_ready(vectors)
    ref = car.reference(TITLES)[:, :128]
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    assert min(float(np.dot(v, w)) for v, w in zip(vectors, ref, strict=True)) >= 0.9999
    b64 = json.loads(body) | {"encoding_format": "base64"}
    again = es_openai_parse(post(f"{car.http}/v1/embeddings", headers, compact(b64)).content)
    assert all(np.array_equal(a, b) for a, b in zip(again, vectors, strict=True))


def test_elasticsearch_openai_errors_are_4xx_with_a_message(car: EngineSidecar) -> None:
    """OpenAiResponseHandler: 401 is an authentication failure, 404/400 a request failure, each
    reported with the body's `error.message`; only 429 and 5xx are retried."""
    url = f"{car.http}/v1/embeddings"
    headers, body = es_openai_request(["milk"], car.model, api_key=WRONG_KEY)
    r = post(url, headers, body)
    assert r.status_code == 401 and "API key" in es_error_message(r.content)
    headers, body = es_openai_request(["milk"], "text-embedding-3-small", api_key=KEY)  # model_id not served
    r = post(url, headers, body)
    assert r.status_code == 404 and car.model in es_error_message(r.content)
    headers, body = es_openai_request(["x" * 20_000], car.model, api_key=KEY)
    r = post(url, headers, body)
    assert r.status_code == 400 and es_error_message(r.content)


def test_elasticsearch_hugging_face_body_is_refused_clearly(car: EngineSidecar) -> None:
    """The `hugging_face` service posts TEI's `{"inputs": [...]}` (HuggingFaceEmbeddingsRequestEntity)
    to its `url`. embedcar serves the OpenAI shape only (the `openai` service covers what
    `hugging_face` does, plus `model` and `dimensions`), so an endpoint created that way fails at
    creation with a 400 naming the field, never later with a 5xx."""
    body = compact({"inputs": ["how big"]})
    r = post(f"{car.http}/v1/embeddings", {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}, body)
    assert r.status_code == 400 and "inputs" in es_error_message(r.content)


# --- OpenSearch: ML Commons remote model, OpenAI connector blueprint --------------------------------
# docs/remote_inference_blueprints/openai_connector_embedding_blueprint.md (ml-commons), with the
# action's url pointed at the sidecar and `parameters.model` set to the served model's name.
OPENSEARCH_REQUEST_BODY = '{ "input": ${parameters.input}, "model": "${parameters.model}" }'
OPENSEARCH_HEADERS = {"Authorization": "Bearer ${credential.openAI_key}"}


def opensearch_substitute(template: str, parameters: dict[str, str], credential: dict[str, str]) -> str:
    """ML Commons fills `${parameters.x}` and `${credential.x}` as plain text (StringSubstitutor) and
    refuses a payload with a placeholder left over."""
    out = re.sub(r"\$\{parameters\.([\w.-]+)\}", lambda m: parameters[m.group(1)], template)
    out = re.sub(r"\$\{credential\.([\w.-]+)\}", lambda m: credential[m.group(1)], out)
    assert "${" not in out, out
    return out


def gson_json(value: object) -> str:
    """Gson's default output: compact, with HTML characters escaped as \\uXXXX (the same JSON)."""
    out = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for ch in "<>&='":
        out = out.replace(ch, f"\\u{ord(ch):04x}")
    return out


def opensearch_request(texts: list[str], model: str, api_key: str) -> tuple[dict[str, str], bytes]:
    """`connector.pre_process.openai.embedding` (OpenAIEmbeddingPreProcessFunction) turns the text docs
    into `parameters.input`, a JSON array string (gson, compact); the 2.14+ standard blueprint gets the
    same string from the ML inference processor. ConnectorUtils.buildSdkRequest adds
    `Content-Type: application/json` when the connector's headers have none."""
    params = {"input": gson_json(texts), "model": model}
    creds = {"openAI_key": api_key}
    body = opensearch_substitute(OPENSEARCH_REQUEST_BODY, params, creds)
    headers = {k: opensearch_substitute(v, params, creds) for k, v in OPENSEARCH_HEADERS.items()}
    return headers | {"Content-Type": "application/json"}, body.encode()


def opensearch_openai_post_process(body: bytes) -> list[dict[str, Any]]:
    """`connector.post_process.openai.embedding`: JSONPath `$.data[*].embedding` (MLPostProcessFunction),
    then EmbeddingPostProcessFunction: a list whose first item is a non-empty list of numbers, each
    becoming a `sentence_embedding` FLOAT32 tensor of shape [len]."""
    doc = json.loads(body)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ContractError("$.data[*].embedding matched nothing")
    filtered = [e["embedding"] for e in data if isinstance(e, dict) and "embedding" in e]
    if filtered and (not isinstance(filtered[0], list) or not filtered[0]
                     or not isinstance(filtered[0][0], int | float)):
        raise ContractError("The embedding should be a non-empty List containing List of Float values.")
    return [{"name": "sentence_embedding", "data_type": "FLOAT32", "shape": [len(e)], "data": e} for e in filtered]


def test_opensearch_openai_blueprint_predict(car: EngineSidecar) -> None:
    """_predict / the text_embedding ingest processor / a neural query: docs in, one tensor per doc out."""
    headers, body = opensearch_request(TITLES, car.model, KEY)
    assert body.startswith(b'{ "input": ["Organic Whole Milk, 1 gal","Ben \\u0026 Jerry\\u0027s \\"Chunky')
    r = post(f"{car.http}/v1/embeddings", headers, body)
    assert r.status_code == 200, r.text
    tensors = opensearch_openai_post_process(r.content)
    assert [t["shape"] for t in tensors] == [[384]] * len(TITLES)
    got = [np.asarray(t["data"], dtype=np.float32) for t in tensors]
    ref = car.reference(TITLES)
    assert all(np.array_equal(g, w) for g, w in zip(got, ref, strict=True))
    assert_unit_dot_product_ready(got)


def test_opensearch_standard_blueprint_output_path(car: EngineSidecar) -> None:
    """The standard blueprint (no post-processing) hands the whole reply to the ML inference
    processor, whose output_map reads e.g. `data[0].embedding`: that path must hold the vector."""
    headers, body = opensearch_request(["greek yogurt"], car.model, KEY)
    doc = json.loads(post(f"{car.http}/v1/embeddings", headers, body).content)
    vec = np.asarray(doc["data"][0]["embedding"], dtype=np.float32)
    assert np.array_equal(vec, car.reference(["greek yogurt"])[0])


def test_opensearch_connector_without_key_is_refused(car: EngineSidecar) -> None:
    """A connector whose action has no `headers` block sends no Authorization: a 401, not a vector."""
    headers, body = opensearch_request(["milk"], car.model, KEY)
    del headers["Authorization"]
    r = post(f"{car.http}/v1/embeddings", headers, body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


# --- Solr: text-to-vector module, LangChain4j OpenAiEmbeddingModel ----------------------------------
# Model store JSON: {"class": "dev.langchain4j.model.openai.OpenAiEmbeddingModel", "name": "embedcar",
#   "params": {"baseUrl": "http://127.0.0.1:8080/v1", "apiKey": KEY, "modelName": <served model>}}
# (solr-ref-guide text-to-vector.adoc); the update processor and the knn_text_to_vector query parser
# both call EmbeddingModel.embed(text): one text per request.


def langchain4j_request(texts: list[str], model_name: str, api_key: str, *, dimensions: int | None = None,
                        user: str | None = None) -> tuple[str, dict[str, str], bytes]:
    """DefaultOpenAiClient.embedding: POST `baseUrl` + "embeddings" (joined with one slash),
    Content-Type `application/json`, `Authorization: Bearer`, `User-Agent: langchain4j-openai`.
    Body: EmbeddingRequest, Jackson snake_case, nulls left out, fields in declaration order
    (model, input, dimensions, user, encoding_format; OpenAiEmbeddingModel sets no encoding_format)."""
    doc: dict[str, Any] = {"model": model_name, "input": texts}
    if dimensions is not None:
        doc["dimensions"] = dimensions
    if user is not None:
        doc["user"] = user
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}",
               "User-Agent": "langchain4j-openai"}
    return "/v1/embeddings", headers, compact(doc)


def langchain4j_parse(body: bytes) -> tuple[list[F32], int | None]:
    """EmbeddingResponse (Jackson, unknown fields ignored): `model` a string, `data` a list (null would
    fail in OpenAiEmbeddingModel.embedTexts), each Embedding's `embedding` a list of numbers or a
    base64 string and `index` an Integer; `usage` gives prompt_tokens/total_tokens as Integers."""
    doc = json.loads(body)
    if not isinstance(doc.get("model"), str | None):
        raise ContractError("model: not a String")
    if not isinstance(doc.get("data"), list):
        raise ContractError("data: null or not a List")
    out = []
    for e in doc["data"]:
        if not isinstance(e.get("index"), int | None):
            raise ContractError("index: not an Integer")
        emb = e.get("embedding")
        if isinstance(emb, str):
            out.append(np.frombuffer(base64.b64decode(emb), dtype="<f4").astype(np.float32))
        elif isinstance(emb, list) and all(isinstance(x, int | float) for x in emb):
            out.append(np.asarray(emb, dtype=np.float32))
        else:
            raise ContractError(f"Illegal embedding: {emb!r:.40}")
    usage = doc.get("usage")
    tokens = None
    if usage is not None:
        for name in ("prompt_tokens", "total_tokens", "completion_tokens"):
            if not isinstance(usage.get(name), int | None):
                raise ContractError(f"usage.{name}: not an Integer")
        tokens = usage.get("total_tokens")
    return out, tokens


def test_solr_langchain4j_update_processor_and_query_parser(car: EngineSidecar) -> None:
    for text in ("Café Bustelo Espresso Ground Coffee", "greek yog"):
        path, headers, body = langchain4j_request([text], car.model, KEY)
        r = post(car.http + path, headers, body)
        assert r.status_code == 200, r.text
        vectors, tokens = langchain4j_parse(r.content)
        assert len(vectors) == 1 and np.array_equal(vectors[0], car.reference([text])[0])
        assert tokens is not None and tokens > 0
        assert_unit_dot_product_ready(vectors)


def test_solr_langchain4j_dimensions_user_and_unknown_dimension_probe(car: EngineSidecar) -> None:
    """`dimensions` and `user` from the model's params; with neither a known model name nor
    `dimensions`, DimensionAwareEmbeddingModel.dimension() embeds "test" once to learn it."""
    path, headers, body = langchain4j_request(["test"], car.model, KEY)
    vectors, _ = langchain4j_parse(post(car.http + path, headers, body).content)
    assert vectors[0].shape == (384,)
    path, headers, body = langchain4j_request(TITLES, car.model, KEY, dimensions=64, user="solr")
    vectors, _ = langchain4j_parse(post(car.http + path, headers, body).content)
    assert [v.shape for v in vectors] == [(64,)] * len(TITLES)
    assert_unit_dot_product_ready(vectors)


def jdk_http_request(port: int, path: str, headers: dict[str, str], body: bytes) -> bytes:
    """The bytes java.net.http.HttpClient (LangChain4j's default transport) sends for a connection's
    first request over plain http: its default version HTTP/2 becomes an h2c upgrade offer. Header
    order and the HTTP2-Settings value as captured from OpenJDK 17.0.15 running
    sidecar/java/embedcar/client/JdkHttpProbe.java against a socket, 2026-12-03."""
    head = (f"POST {path} HTTP/1.1\r\nConnection: Upgrade, HTTP2-Settings\r\nContent-Length: {len(body)}\r\n"
            f"Host: 127.0.0.1:{port}\r\nHTTP2-Settings: AAEAAEAAAAIAAAAAAAMAAAAAAAQBAAAAAAUAAEAAAAYABgAA\r\n"
            "Upgrade: h2c\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
    return head.encode() + body


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length (what the facade sends)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split(b" ", 2)[1]), rest[:length]


def test_solr_jdk_http_client_h2c_upgrade_offer_is_answered_over_http11(car: EngineSidecar) -> None:
    """LangChain4j on the JDK HttpClient offers `Upgrade: h2c` with its POST; the facade must ignore
    the offer and answer over HTTP/1.1 with the body read (uvicorn's httptools protocol answers 400:
    sidecar/http_protocol.py), then keep serving the connection."""
    path, headers, body = langchain4j_request(["Café Bustelo Espresso Ground Coffee"], car.model, KEY)
    headers = {"Authorization": headers["Authorization"], "Content-Type": headers["Content-Type"],
               "User-Agent": headers["User-Agent"]}  # the JDK's order
    port = int(car.http.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        raw = jdk_http_request(port, path, headers, body)
        sock.sendall(raw[:60])  # the header block split across packets: the protocol waits for all of it
        time.sleep(0.05)
        sock.sendall(raw[60:])
        status, reply = read_response(sock)
        assert status == 200, reply
        vectors, _ = langchain4j_parse(reply)
        assert np.array_equal(vectors[0], car.reference(["Café Bustelo Espresso Ground Coffee"])[0])
        # The JDK reuses the connection for its next call, now without the offer.
        _, _, body2 = langchain4j_request(["greek yogurt"], car.model, KEY)
        sock.sendall(f"POST {path} HTTP/1.1\r\nContent-Length: {len(body2)}\r\nHost: 127.0.0.1:{port}\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n\r\n".encode() + body2)
        status, reply = read_response(sock)
        assert status == 200 and len(langchain4j_parse(reply)[0][0]) == 384


@pytest.mark.parametrize(("head", "upgrade"), [
    (b"POST / HTTP/1.1\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c", True),
    (b"POST / HTTP/1.1\r\nupgrade:  H2C ", True),
    (b"POST / HTTP/1.1\nConnection: Upgrade\nUpgrade: h2c", True),  # bare LF line ends, as httptools takes
    (b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket", False),
    (b"POST /v1/embeddings HTTP/1.1\r\nContent-Type: application/json\r\nX-Upgrade-Note: h2c", False),
])
def test_upgrade_offer_detection(head: bytes, upgrade: bool) -> None:
    assert offers_upgrade(head) is upgrade


def test_parsers_fail_on_a_renamed_field() -> None:
    """The engine parsers above are strict where the engines are: a reply with `embedding` renamed or
    `data` missing is refused by each of them, so a regression in the facade cannot pass."""
    good = compact({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
                    "model": "m", "usage": {"prompt_tokens": 2, "total_tokens": 2}})
    renamed = good.replace(b'"embedding":[', b'"vector":[')
    no_data = compact({"object": "list", "results": [], "model": "m"})
    for parse in (es_openai_parse, opensearch_openai_post_process, langchain4j_parse):
        parse(good)
        with pytest.raises(ContractError):
            parse(no_data)
    with pytest.raises(ContractError):
        es_openai_parse(renamed)
    with pytest.raises(ContractError):
        langchain4j_parse(compact({"data": [{"embedding": [0.1], "index": "0"}]}))
    assert opensearch_openai_post_process(renamed) == []  # JSONPath matches nothing: no tensors, and
    # the text_embedding processor then fails the document for a missing vector.
