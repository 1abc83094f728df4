"""docs/http.md, written from the code: the HTTP facade's routes, each body's fields and reply
(sidecar/http_api.py's tables, which its parsers accept exactly), and the error code table
(inference/errors.py ERROR_CODES) both facades answer with."""

from __future__ import annotations

from inference.errors import ERROR_CODES
from sidecar.http_api import EMBEDDINGS_FIELDS, EMBEDDINGS_REPLY, SEARCH_FIELDS, SEARCH_REPLY

ROUTES = (
    ("POST", "/v1/embeddings", "key", "embeddings of texts (OpenAI's shape)"),
    ("POST", "/v1/search", "key", "products for queries from the served catalog index"),
    ("GET", "/v1/models", "key", "the served models (OpenAI's list shape); the first is the default"),
    ("GET", "/metrics", "key", "Prometheus metrics ([metrics.md](metrics.md))"),
    ("GET", "/health", "none", '`{"status": "SERVING", "model": ...}` (200), or `"NOT_SERVING"` (503)'),
)


def _fields(table: dict[str, tuple[str, str]]) -> list[str]:
    rows = ["| field | type | meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {tp} | {doc} |" for name, (tp, doc) in table.items()]
    return rows


def _reply(table: dict[str, str]) -> list[str]:
    rows = ["| field | value |", "|---|---|"]
    rows += [f"| `{name}` | {doc.replace('|', '/')} |" for name, doc in table.items()]
    return rows


def _route(path: str, fields: dict[str, tuple[str, str]], reply: dict[str, str], example: str) -> list[str]:
    """A POST route's section: its body's fields, its reply's, a curl call."""
    return [f"## POST {path}", "", *_fields(fields), "", "Reply, 200:", "", *_reply(reply), "", "```bash",
            f"curl -s localhost:8080{path} -H 'content-type: application/json' -d '{example}'", "```", ""]


def http_page() -> str:
    lines = [
        "# HTTP API reference",
        "",
        "<!-- Written by `embedcar docs reference` from sidecar/http_api.py and inference/errors.py; "
        "do not edit by hand. -->",
        "",
        "The sidecar's HTTP facade (`sidecar.http_port`, 8080; JSON bodies, UTF-8). With API keys set, a route "
        "marked *key* needs `Authorization: Bearer <key>` or `x-api-key: <key>`, checked from the headers "
        "before the body is read. A body is at most `sidecar.max_message_bytes`; a field the table does not "
        "list is refused (400), naming it.",
        "",
        "OpenAI clients take `http://HOST:8080/v1` as their base URL and the served model's name as `model`. "
        "LangChain's `OpenAIEmbeddings` also needs `check_embedding_ctx_length=False` (else it sends tiktoken's "
        "token ids, refused here) and LlamaIndex's `OpenAIEmbedding` `model_name=`: "
        "[integrations/python-frameworks.md](integrations/python-frameworks.md); search engines: "
        "[integrations/](integrations/README.md).",
        "",
        "| method | path | key | what |",
        "|---|---|---|---|",
        *(f"| {m} | `{path}` | {key} | {what} |" for m, path, key, what in ROUTES),
        "",
        *_route("/v1/embeddings", EMBEDDINGS_FIELDS, EMBEDDINGS_REPLY,
                '{"input": ["greek yogurt", "oat milk"]}'),
        *_route("/v1/search", SEARCH_FIELDS, SEARCH_REPLY, '{"input": "greek yog", "k": 5, "mode": "hybrid"}'),
        "## Errors",
        "",
        'Every error is `{"error": {"message": "...", "type": "<code>"}}` with the HTTP status below (gRPC '
        "answers the same errors with the status in the last column); a refusal under overload carries "
        "`Retry-After`, a missing or wrong key `WWW-Authenticate: Bearer`.",
        "",
        "| type | HTTP | gRPC | when |",
        "|---|---|---|---|",
        *(f"| `{row.label}` | {row.http} | {row.grpc} | {' '.join((cls.__doc__ or cls.__name__).split())} |"
          for cls, row in ERROR_CODES.items()),
        "",
    ]
    return "\n".join(lines)
