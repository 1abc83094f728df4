"""The sidecar section and the sidecar layer's `Settings` (with the catalog's: Search opens its index)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from catalog import settings as catalog
from inference.backends.factory import KINDS
from inference.settings import PORT_MAX, setting

INT32_MAX = 2**31 - 1  # gRPC takes its channel arguments as C ints


@dataclass(frozen=True, slots=True)
class SidecarSettings:
    host: str = setting("127.0.0.1", "Address the sidecar binds to; non-loopback requires API keys.")
    grpc_port: int = setting(50051, "Sidecar gRPC port (0 = pick a free one).", min=0, max=PORT_MAX)
    uds_path: Path | None = setting(
        None, "Also serve gRPC on this Unix socket, mode 0660 (same-host callers; access by file permissions). "
        "A bare file name (`grpc.sock`) is in this user's private folder, created 0700: $XDG_RUNTIME_DIR/embedcar, "
        "else var/run in the data home. Any other path is taken as given; its folder must belong to this user "
        "(or root) with nobody else allowed to write to it, so a world-writable folder such as /tmp is refused: "
        "another user could bind the name first and receive callers' API keys. Empty = off."
    )
    grpc_max_connections: int = setting(
        1000, "gRPC connections open at once, TCP and the Unix socket together: past it gRPC closes a new "
        "connection as soon as it is accepted (the caller reconnects later). Lowered with http_max_connections "
        "where the open-files limit (raised to its hard limit at start) would not hold both.", min=1,
        max=INT32_MAX, advanced=True)
    listener_dead_s: float = setting(
        60.0, "The sidecar checks each of its listeners (gRPC port, Unix socket, HTTP port) on a new connection "
        "every 2 s: health says NOT_SERVING while one does not answer, and one silent this long ends the process "
        "(exit status 70, one log line) so that its supervisor restarts it. 0 = never exit.", min=0,
        advanced=True)
    http_port: int = setting(8080, "HTTP facade port (0 = pick a free one, -1 = off).", min=-1, max=PORT_MAX)
    http_header_timeout_s: float = setting(
        10.0, "HTTP: a request's header block must be complete this long after the connection opened or its "
        "first byte came (408, the connection closed). Idle keep-alive connections close after 5 s (uvicorn).",
        min=0.01, advanced=True)
    http_body_timeout_s: float = setting(
        10.0, "HTTP: a POST's body must be complete this long after its headers (408, the connection closed); "
        "only a caller whose key passed waits for its body, and it holds no in-flight place meanwhile.",
        min=0.01, advanced=True)
    http_max_connections: int = setting(
        1024, "HTTP connections open at once: past it a new one closes the connection that has waited longest "
        "without a request in progress (idle keep-alive, or a header block still coming) or with a reply the "
        "client has left unread for 1 s, else it is answered 503 and closed, never queued.", min=1, advanced=True)
    http_write_timeout_s: float = setting(
        10.0, "HTTP: a connection whose reply the client leaves unread this long (bytes the kernel would not take, "
        "none of them taken since) is aborted and its buffers freed. Nothing more is written to a connection "
        "while any of its reply is unsent: it holds one reply at most.", min=0.01, advanced=True)
    http_max_pipelined: int = setting(
        32, "HTTP: requests one connection may send ahead of the reply it is owed (pipelining), their bytes within "
        "max_message_bytes together: past either the connection is aborted.", min=1, advanced=True)
    models: tuple[str, ...] = setting(
        (), "Models this sidecar serves (prepared directories under model.models_dir), the first the default; "
        "a request names one with its `model` field (gRPC) or body (HTTP). Empty = model.name alone."
    )
    backend: str = setting("embedded", "Inference backend: embedded (in-process ORT), triton, or torch (in-process "
                           "PyTorch with CUDA graphs, for a GPU; the torch extra).", choices=KINDS)
    embedded_fallback: bool = setting(
        True, "Triton backend: answer with the embedded model while no Triton URL answers (only when the "
        "model's ONNX file is present in model_dir; replies and metrics name the backend that answered)."
    )
    tls_cert_file: Path | None = setting(
        None, "PEM certificate (chain) gRPC and HTTP serve TLS with; required beyond loopback (sidecar/tls.py).")
    tls_key_file: Path | None = setting(None, "PEM private key of tls_cert_file (0600).")
    tls_client_ca_file: Path | None = setting(
        None, "PEM CA: clients must present a certificate it signed (mutual TLS); empty = any client (keys decide).")
    plaintext_beyond_loopback: bool = setting(
        False, "Serve plaintext on a non-loopback host (TLS ends in a proxy in front, e.g. a service mesh).")
    api_keys: str = setting("", "tenant=key pairs, comma-separated.", secret=True)
    api_keys_file: Path | None = setting(None, "File of `tenant key` lines (or `tenant sha256:hex`).")
    rate_per_s: float = setting(1000.0, "Token bucket refill rate per tenant (requests/s).", min=0, advanced=True)
    burst: int = setting(200, "Token bucket size per tenant.", min=1, advanced=True)
    cache_entries: int = setting(100_000, "Hot-query cache size in entries (0 = off).", min=0, advanced=True)
    cache_max_bytes: int = setting(
        192 * 1024 * 1024, "Hot-query cache size in bytes, each entry counted as its vector, its 16-byte key "
        "(a digest, never the text) and ~500 bytes of bookkeeping: ~2 KB for a 384-dimension model (0 = off).",
        min=0, advanced=True)
    max_message_bytes: int = setting(4 * 1024 * 1024, "Largest gRPC/HTTP request body.",
                                     min=1024, max=INT32_MAX, advanced=True)
    grpc_max_connection_age_s: float = setting(
        0.0, "gRPC: a connection older than this is asked to go away, its calls given grace_s to finish "
        "(behind a load balancer, to spread reconnections). 0 = no limit: a search node's Stream may stay open.",
        min=0, max=INT32_MAX // 1000, advanced=True)
    admission_budget_ms: float = setting(
        8.0, "Admission: reject a request that would wait behind more than this much queued inference "
        "(keeps accepted latency within the 20 ms SLA under overload, the excess refused at once: the wait, "
        "the pass and the transport; docs/reliability.md). 0 = deadline only.", min=0, advanced=True)
    transport_backlog: int = setting(
        0, "gRPC calls that may wait in gRPC's C core for the event loop to take them: beyond this many "
        "(refusing at random between it and twice it), gRPC refuses a new call itself, before any Python runs "
        "(~70 µs of CPU against ~500 µs for the cheapest refusal in a handler); the caller sees CANCELLED "
        "(inference.errors.Shed). Calls their client has already reset count until the loop takes them, so a "
        "rapid-reset client (HEADERS then RST_STREAM, no key needed) keeps a small backlog full and every caller "
        "of the method it targets is refused meanwhile (docs/reliability.md): set it (e.g. admission_budget_ms "
        "÷ ~0.5 ms of event-loop time per call) only where every caller is trusted. 0 = gRPC's defaults "
        "(1000 / 3000).", min=0, max=INT32_MAX // 2, advanced=True)
    max_in_flight: int = setting(
        0, "HTTP requests (once their body has arrived) and Stream messages in progress at once, each front at "
        "most 3/4 of it (neither can starve the other): beyond it a new one is refused at once (HTTP 429 + "
        "Retry-After; a Stream message's error reply before decoding it; a gRPC unary call while it is full). "
        "0 = the admission queue's own size, 3 x max_rows_per_pass (two batches may wait behind the running one).",
        min=0, advanced=True)
    default_deadline_ms: int = setting(1000, "Deadline for requests that carry none.", min=1, advanced=True)
    warm_queries_file: Path | None = setting(None, "Optional file of top queries to pre-load the cache.",
                                             flag="warm-queries", advanced=True)
    index_dir: Path | None = setting(None, "Catalog index root to serve Search from (None = no Search).")
    grace_s: float = setting(5.0, "Graceful shutdown: time for in-flight requests to finish.", min=0, advanced=True)
    max_text_chars: int = setting(
        10_000, "Texts longer than this are rejected (INVALID_ARGUMENT), before model.truncate_text_chars "
        "could cut them; a text that Unicode normalisation (NFKC) grows past that cut is cut and flagged "
        "`truncated`.", min=1, advanced=True)
    max_rows_per_pass: int = setting(
        32, "Most texts in one backend call (one forward pass): the embedded micro-batcher fills batches up "
        "to it and a bigger request is split into calls of it; 3 x it sizes admission. "
        "A request may carry up to model.max_texts_per_call texts.", min=1, advanced=True)
    max_k: int = setting(100, "Largest k a Search may ask for.", min=1, advanced=True)
    poll_s: float = setting(
        5.0, "How often to look for a newer catalog index version and a new version of each served model (its "
        "manifest, after `model prepare` or `model rollback`): a new model is loaded and warmed beside the one in "
        "service and switched in together with an index built by it (sidecar/rollout.py). 0 = the model never: "
        "a new version needs a restart (the index is still looked for, every 5 s).", min=0, advanced=True)
    event_loop: str = setting(
        "uvloop", "`sidecar serve`'s event loop: `uvloop` (libuv's, which uvicorn[standard] installs: less CPU per "
        "gRPC call than asyncio's in 7 of 8 paired runs, docs/performance.md) or `asyncio` (the standard "
        "library's); both serve grpc.aio and HTTP alike.",
        choices=("asyncio", "uvloop"), advanced=True)
    allocator: str = setting(
        "auto", "The sidecar's malloc: `auto` = mimalloc where it is installed (`make native` installs it; "
        "0.07 ms less CPU per Triton-backend query on a 2-vCPU host, docs/benchmarks.md), else the C library's; "
        "`system` = the C library's; or a malloc library's path (jemalloc, say). Preloaded: `sidecar serve` "
        "starts itself again with it (sidecar/allocator.py).", advanced=True)


@dataclass(frozen=True, slots=True)
class Settings(catalog.Settings):
    """model, triton, catalog and sidecar: what `embedcar sidecar serve` runs with."""

    sidecar: SidecarSettings = field(default_factory=SidecarSettings)
