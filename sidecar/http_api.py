"""HTTP facade (FastAPI): OpenAI-compatible POST /v1/embeddings and GET /v1/models, POST /v1/search,
GET /health, GET /metrics.

The body's `model` picks a served model (its name, version id or variant id; absent = the default);
an unknown one is 404 listing the served ones. `dimensions` truncates each vector to its first n
values and L2-normalises it again (Matryoshka-style), refused above the model's dimension.

Bodies are read and checked by hand (size cap, UTF-8, JSON types and depth, unknown fields) so every
bad request gets a 4xx with a message that says what was wrong. A POST's key is checked from its headers
(once: the tenant found goes with the request to its route) and its body read whole, within a timeout, by
`HttpGate` (sidecar.shedding) before it is routed: a caller without a key never has its body read, nor
one slow to send it a place among those in progress. The route then takes the path every request
takes (sidecar.calls.Requests: admit -> embed / search, counted); errors answer what every transport
answers (sidecar.errors.status); a bug is a JSON 500, logged (sidecar.calls.failure).

With API keys set, /v1/embeddings, /v1/search and /metrics need one (`Authorization: Bearer <key>` or
`x-api-key`; Prometheus sends the former with `authorization: {credentials: ...}`): the metrics name
tenants and traffic. /health stays open for load balancers: it says only whether it serves, and the model.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers

from catalog.filters import merged
from catalog.fusion import SearchMode, parse_mode
from inference.errors import EmbedcarError, InvalidInput, Unauthenticated
from inference.pooling import l2_normalize
from sidecar.auth import HTTP_KEY
from sidecar.calls import Requests, SearchArgs, failure
from sidecar.errors import status
from sidecar.shedding import HttpGate, Scope

# Each body's fields: name -> (JSON type, meaning). The parsers accept exactly these names, and
# docs/http.md is written from these tables (sidecar/http_reference.py), replies' likewise.
_MODEL = ("string", "a served model's name, version id or variant id (`GET /v1/models`); absent: the default")
EMBEDDINGS_FIELDS: dict[str, tuple[str, str]] = {
    "input": ("string or [string]", "required: the texts; a string is one text"),
    "model": _MODEL,
    "encoding_format": ('"float" or "base64"', "how each vector is written: numbers, or base64 of little-endian "
                        "float32 (default float)"),
    "user": ("string", "accepted and ignored (OpenAI's field)"),
    "dimensions": ("integer >= 1", "the first n values of each vector, L2-normalised again where the model "
                   "normalises (Matryoshka-style); at most the model's dimension"),
}
SEARCH_FIELDS: dict[str, tuple[str, str]] = {
    "input": ("string or [string]", "required: the queries; a string is one query"),
    "k": ("integer", "hits per query (default 10, at most sidecar.max_k)"),
    "filters": ("{field: string}", "only products with these values (case-insensitive) of the index's filter "
                "fields (`catalog build --filter-fields`); a field or value the index lacks is a 400 naming what "
                "it has"),
    "department": ("string", "shorthand for filters.department"),
    "aisle": ("string", "shorthand for filters.aisle"),
    "mode": ('"semantic", "lexical" or "hybrid"', "the embedding's nearest products, BM25 + last-word prefix, or "
             "both fused by reciprocal rank (default semantic)"),
    "model": _MODEL,
}
EMBEDDINGS_REPLY: dict[str, str] = {
    "object": '"list"',
    "data": 'one per input, in order: {"object": "embedding", "index": i, "embedding": [float] or base64}',
    "model": "the model's version id that computed it",
    "usage": '{"prompt_tokens": n, "total_tokens": n}: tokens of the texts (cache hits included)',
}
SEARCH_REPLY: dict[str, str] = {
    "object": '"list"',
    "data": 'one per query, in order: {"index": i, "cache_hit": bool, "hits": [{"id", "score", "fields", "legs", '
            '"matched"}]} (legs: which of semantic / lexical found the hit; matched: the typed attributes it '
            'carries, e.g. "dairy free")',
    "model": "the model's version id",
    "mode": "the mode searched",
    "index_version": "the catalog index version that answered",
    "timings_ns": "nanoseconds per stage of the request",
}
ALLOWED_FIELDS = frozenset(EMBEDDINGS_FIELDS)


def error_parts(exc: EmbedcarError) -> tuple[int, dict[str, str], bytes]:
    """An error reply's status, headers and JSON body."""
    headers: dict[str, str] = {"content-type": "application/json"}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = f"{max(1, round(exc.retry_after_s))}"
    if isinstance(exc, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    # A message may quote the caller's input, lone surrogates included: escape what UTF-8 cannot carry.
    message = exc.message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = json.dumps({"error": {"message": message, "type": exc.code}}, ensure_ascii=False,
                      separators=(",", ":")).encode()  # as JSONResponse writes it
    return status(exc).http, headers, body


def _error(exc: EmbedcarError) -> Response:
    status, headers, body = error_parts(exc)
    return Response(body, status_code=status, headers=headers)


@dataclass(frozen=True, slots=True)
class EmbeddingsBody:
    texts: list[str]
    encoding_format: str  # "float" | "base64"
    model: str | None
    dimensions: int | None


def parse_embeddings_request(body: bytes) -> EmbeddingsBody:
    """An OpenAI-style embeddings body, or InvalidInput saying what is wrong."""
    doc = _json_object(body)
    _reject_unknown(doc, ALLOWED_FIELDS)
    if "input" not in doc:
        raise InvalidInput("missing field `input` (a string or a list of strings)")
    if _token_ids(doc["input"]):
        raise InvalidInput(TOKEN_IDS)
    texts = _input_texts(doc["input"], " (token arrays are not supported)")
    fmt = doc.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise InvalidInput("`encoding_format` must be \"float\" or \"base64\"")
    if "user" in doc and not isinstance(doc["user"], str):
        raise InvalidInput("`user` must be a string")
    dims = doc.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise InvalidInput("`dimensions` must be a positive integer")
    return EmbeddingsBody(texts, fmt, _model_field(doc), dims)


def _model_field(doc: dict[str, Any]) -> str | None:
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidInput("`model` must be a string")
    return model or None


def truncate_dimensions(emb: np.ndarray, dims: int | None, *, normalize: bool = True) -> np.ndarray:
    """The first `dims` values of each row, L2-normalised again where the model normalises its
    vectors; InvalidInput above the model's width."""
    if dims is None or dims == emb.shape[1]:
        return emb
    if dims > emb.shape[1]:
        raise InvalidInput(f"`dimensions` {dims} is over the model's dimension {emb.shape[1]}")
    return l2_normalize(emb[:, :dims]) if normalize else emb[:, :dims]


@dataclass(frozen=True, slots=True)
class SearchBody:
    texts: list[str]
    args: SearchArgs
    model: str | None = None

    @property
    def mode(self) -> SearchMode:
        return parse_mode(self.args.mode)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"request body is not valid UTF-8 (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"request body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    except RecursionError as exc:  # the C decoder recurses per [ or {
        raise InvalidInput("request body is not JSON we accept: nested too deeply") from exc
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise InvalidInput(f"request body is not JSON we accept: {str(exc).split(':')[0]}") from exc
    if not isinstance(doc, dict):
        raise InvalidInput(f"request body must be a JSON object, got {type(doc).__name__}")
    return doc

def _reject_unknown(doc: dict[str, Any], allowed: Collection[str]) -> None:
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        # Field names come from the caller: quote a few, shortened, never the whole body.
        shown = ", ".join(repr(name[:40]) for name in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise InvalidInput(f"unknown fields: {shown} (allowed: {', '.join(sorted(allowed))})")


# OpenAI's API also takes token ids; ours would be another tokenizer's. LangChain sends them by default.
TOKEN_IDS = ("`input` holds token ids (token arrays), which this server does not take: it tokenizes the texts "
             "with its model's own tokenizer, so send strings. LangChain's OpenAIEmbeddings sends token ids "
             "unless created with check_embedding_ctx_length=False (docs/integrations/python-frameworks.md)")


def _token_ids(raw: object) -> bool:
    """`input` as OpenAI's token-id shapes: a list of integers, or a list of such lists."""
    def ids(x: object) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    return ids(raw) or (isinstance(raw, list) and bool(raw) and all(ids(x) for x in raw))


def _input_texts(raw: object, detail: str = "") -> list[str]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and all(isinstance(t, str) for t in raw):
        return raw
    raise InvalidInput(f"`input` must be a string or a list of strings{detail}")


def parse_search_request(body: bytes) -> SearchBody:
    """`{"input": str | [str], "k"?, "filters"?: {field: value}, "department"?, "aisle"?, "mode"?:
    "semantic" | "lexical" | "hybrid"}`,
    or InvalidInput saying what is wrong; mode defaults to semantic, as in gRPC."""
    doc = _json_object(body)
    _reject_unknown(doc, SEARCH_FIELDS)
    texts = _input_texts(doc.get("input"))
    k = doc.get("k", 10)
    if not isinstance(k, int) or isinstance(k, bool):
        raise InvalidInput("`k` must be an integer")
    shorthand: list[str | None] = []
    for name in ("department", "aisle"):
        value = doc.get(name)
        if value is not None and not isinstance(value, str):
            raise InvalidInput(f"`{name}` must be a string")
        shorthand.append(value or None)
    given = doc.get("filters") or {}
    if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
        raise InvalidInput("`filters` must be an object of strings ({\"brand\": \"acme\"})")
    filters = merged(given, department=shorthand[0], aisle=shorthand[1])
    mode = doc.get("mode", SearchMode.SEMANTIC.value)
    if not isinstance(mode, str):
        raise InvalidInput("`mode` must be \"semantic\", \"lexical\" or \"hybrid\"")
    return SearchBody(texts, SearchArgs(k, filters, parse_mode(mode).value), _model_field(doc))


def _api_key(headers: Headers) -> str | None:
    key = headers.get("x-api-key")
    if key:
        return key
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


_RPC = {"/v1/embeddings": "http_embed", "/v1/search": "http_search"}  # metric label of a POST route
_TENANT = "embedcar.tenant"  # the scope's state: the tenant the gate found for a POST's key


def _tenant(request: Request) -> str:
    tenant: str = request.scope["state"][_TENANT]
    return tenant


def create_app(requests: Requests, *, max_body_bytes: int, serving: Callable[[], bool],
               body_timeout_s: float = 10.0) -> FastAPI:
    """`requests.gate`: refuse POSTs at once under overload (sidecar.shedding), before routing and the
    body, and count them in flight once their body has arrived."""
    service, metrics, gate = requests.service, requests.metrics, requests.gate
    app = FastAPI(title="embedcar sidecar", docs_url=None, redoc_url=None, openapi_url=None)

    def check(scope: Scope) -> EmbedcarError | None:
        try:
            tenant = service.caller(_api_key(Headers(scope=scope)))
        except Unauthenticated as exc:
            return exc
        scope.setdefault("state", {})[_TENANT] = tenant  # the route's `Request.state`: not checked again
        return None

    def refused(scope: Scope, exc: EmbedcarError) -> tuple[int, dict[str, str], bytes]:
        rpc = _RPC.get(scope.get("path", ""))
        if rpc is not None:
            metrics.requests.labels(rpc, exc.code).inc()
        return error_parts(exc)

    app.add_middleware(HttpGate, gate=gate, check=check, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s, error=refused)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        try:
            body = parse_embeddings_request(await request.body())
            call = requests.admit(_tenant(request), body.model)
            out = await requests.embed("http_embed", call, body.texts)
            emb = truncate_dimensions(out.embeddings, body.dimensions, normalize=call.served.manifest.normalize)
        except Exception as exc:  # a bug too: a JSON 500 like gRPC's INTERNAL, not a crash
            return _error(failure(metrics, "http_embed", exc))
        data: list[dict[str, Any]] = [
            {"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
             else row.tolist()}
            for i, row in enumerate(emb)
        ]
        n_tokens = sum(out.tokens)
        headers = {"x-embedcar-backend": out.backend} if out.backend else None  # who computed the misses
        return JSONResponse({"object": "list", "data": data, "model": out.model,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}, headers=headers)

    @app.post("/v1/search")
    async def search(request: Request) -> Response:
        try:
            q = parse_search_request(await request.body())
            out = await requests.search("http_search", requests.admit(_tenant(request), q.model), q.texts, q.args)
        except Exception as exc:
            return _error(failure(metrics, "http_search", exc))
        data = [{"index": i, "cache_hit": hit, "hits": [
                    {"id": h.id, "score": h.score, "fields": h.fields, "legs": list(h.legs),
                     "matched": list(h.matched)} for h in hits]}
                for i, (hits, hit) in enumerate(zip(out.hits, out.cache_hits, strict=True))]
        headers = {"x-embedcar-backend": out.backend} if out.backend else None
        return JSONResponse({"object": "list", "data": data, "model": out.model, "mode": q.mode.value,
                             "index_version": out.index_version, "timings_ns": out.timings_ns}, headers=headers)

    def keyless(request: Request) -> Response | None:
        """The 401 reply of a request without one of our keys; None for a keyed one (no token taken)."""
        try:
            service.keys.tenant_for(_api_key(request.headers), how=HTTP_KEY)
        except Unauthenticated as exc:
            return _error(exc)
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The served models, OpenAI's list shape: `id` is what a request's `model` may name."""
        if (refused := keyless(request)) is not None:
            return refused
        data = [{"id": m.name, "object": "model", "owned_by": "embedcar", "version": m.version_id,
                 "dimensions": m.backend.dim, "default": i == 0} for i, m in enumerate(service.models)]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        ok = serving()
        return JSONResponse({"status": "SERVING" if ok else "NOT_SERVING", "model": service.model},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if (refused := keyless(request)) is not None:  # keys only (no rate limit): a scrape eats no budget
            return refused
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
