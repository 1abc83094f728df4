"""API keys on every surface: refused without (or with a wrong) key, served with it, never logged.

A real sidecar with one API key (gRPC + HTTP + a real index) and the demo server in front of it.
Each surface is called with no key, a wrong key and the right key:
  gRPC Embed, gRPC Search, gRPC Stream (both over one call), gRPC server reflection (v1alpha),
  HTTP POST /v1/embeddings (bearer and x-api-key), HTTP GET /metrics (bearer: what Prometheus
  sends), the demo websocket (header and ?api_key=). gRPC health and HTTP /health stay open by
  design (probes carry no key) and are checked to answer without one.
Every log line of the run (DEBUG and up, uvicorn's own included) is kept; neither key, nor its
SHA-256, may appear in one, nor in the settings' or key ring's repr.
`probe_surfaces` is shared with tests/test_sidecar_auth_surfaces.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_client.wire import API_KEY, SERVICE
from embedcar_settings import Settings
from loadtest.faults.result import ScenarioResult

NAME = "auth"
TITLE = ("With API keys set: every surface refuses a missing or wrong key and serves the right one; "
         "no key in any log line")


@dataclass(frozen=True, slots=True)
class SurfaceCheck:
    surface: str
    no_key: str  # what a call without a key got
    wrong_key: str
    right_key: str
    rejected: bool  # no key and wrong key both refused (or: open by design, and said so)
    served: bool  # the right key (or no key, where open by design) answered properly
    open_by_design: bool = False
    key_in_logs: bool = False  # a key or its digest in a log line written while probing this surface


# --- one call per surface and key ---------------------------------------------------------------------
def _md(key: str | None) -> tuple[tuple[str, str], ...] | None:
    return ((API_KEY, key),) if key else None


def _grpc(target: str, method: str, payload: bytes, key: str | None) -> str:
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=30, metadata=_md(key))
        except grpc.RpcError as exc:
            return exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    return "OK"


def _stream(target: str, key: str | None) -> str:
    """An Embed and a Search over one Stream call: "OK" when both are answered."""
    frames = [pb.StreamRequest(id=1, embed=pb.EmbedRequest(texts=["oat milk"])).SerializeToString(),
              pb.StreamRequest(id=2, search=pb.SearchRequest(texts=["oat milk"], k=3)).SerializeToString()]
    with grpc.insecure_channel(target) as channel:
        try:
            replies = [pb.StreamReply.FromString(r) for r in
                       channel.stream_stream(f"/{SERVICE}/Stream")(iter(frames), timeout=30, metadata=_md(key))]
        except grpc.RpcError as exc:
            return exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    kinds = {r.id: r.WhichOneof("result") for r in replies}
    return "OK" if kinds == {1: "embed", 2: "search"} else f"replies {kinds}"


def _reflection(target: str, key: str | None) -> str:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        try:
            replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                     timeout=30, metadata=_md(key)))
        except grpc.RpcError as exc:
            return exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    names = {s.name for r in replies for s in r.list_services_response.service}
    return "OK" if SERVICE in names else f"OK without {SERVICE}"


def _grpc_health(target: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        except grpc.RpcError as exc:
            return exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))


def _http(port: int, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> str:
    from loadtest.faults.surfaces import http_post, raw_http

    if method == "POST":
        reply = http_post(port, path, body, {"Content-Type": "application/json", **headers})
    else:
        lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", *(f"{k}: {v}" for k, v in
                                                                                   headers.items())]
        reply = raw_http(port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    return str(reply.status) if reply.status is not None else "no answer"


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


# The probe's own websocket client traces its handshake at DEBUG, the key it sends included: that is
# the caller's log, not the servers', so it goes to a logger of its own that writes nothing.
_PROBE_LOG = logging.Logger("auth-probe-client", level=logging.CRITICAL + 1)


def _ws(url: str, *, header_key: str | None = None, query_key: str | None = None) -> str:
    from urllib.parse import quote

    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect

    if query_key:
        url = f"{url}?api_key={quote(query_key)}"
    headers = {"x-api-key": header_key} if header_key else None
    try:
        with connect(url, additional_headers=headers, proxy=None, open_timeout=30, logger=_PROBE_LOG) as ws:
            with contextlib.suppress(ConnectionClosed):  # refused: the error is still there to read
                ws.send(json.dumps({"seq": 1, "text": "greek yogurt"}))
            reply = json.loads(ws.recv(timeout=30))
            if "error" in reply:
                code = reply["error"].get("code")
                try:
                    ws.recv(timeout=10)
                except ConnectionClosed as exc:
                    return f"error {code}, close {exc.rcvd.code if exc.rcvd else 1006}"
                return f"error {code}"
            return "results" if reply.get("results") else "no results"
    except InvalidStatus as exc:
        return f"HTTP {exc.response.status_code}"
    except ConnectionClosed as exc:
        return f"close {exc.rcvd.code if exc.rcvd else 1006}"


# --- all surfaces ------------------------------------------------------------------------------------------
def probe_surfaces(grpc_target: str, http_port: int, ws_url: str, key: str, wrong: str,
                   lines: Callable[[], list[str]] | None = None) -> list[SurfaceCheck]:
    """Every surface with no key, `wrong` and `key`. `lines` (e.g. LogCapture.lines) lets each
    surface say whether a key showed up in what was logged while it was probed."""
    embed = pb.EmbedRequest(texts=["oat milk"]).SerializeToString()
    search = pb.SearchRequest(texts=["oat milk"], k=3).SerializeToString()
    body = b'{"input": "oat milk"}'
    # surface -> (call with a key or None, what the right key must get, what the wrong ones must get)
    calls: dict[str, tuple[Callable[[str | None], str], str, tuple[str, ...]]] = {
        "gRPC Embed": (lambda k: _grpc(grpc_target, "Embed", embed, k), "OK", ("UNAUTHENTICATED",)),
        "gRPC Search": (lambda k: _grpc(grpc_target, "Search", search, k), "OK", ("UNAUTHENTICATED",)),
        "gRPC Stream": (lambda k: _stream(grpc_target, k), "OK", ("UNAUTHENTICATED",)),
        "gRPC reflection": (lambda k: _reflection(grpc_target, k), "OK", ("UNAUTHENTICATED",)),
        "HTTP POST /v1/embeddings (bearer)": (lambda k: _http(http_port, "POST", "/v1/embeddings", _bearer(k), body),
                                              "200", ("401",)),
        "HTTP POST /v1/embeddings (x-api-key)": (
            lambda k: _http(http_port, "POST", "/v1/embeddings", {"x-api-key": k} if k else {}, body), "200", ("401",)),
        "HTTP GET /metrics": (lambda k: _http(http_port, "GET", "/metrics", _bearer(k)), "200", ("401",)),
        "demo websocket (header)": (lambda k: _ws(ws_url, header_key=k), "results",
                                    ("error unauthenticated, close 1008",)),
        "demo websocket (?api_key=)": (lambda k: _ws(ws_url, query_key=k), "results",
                                       ("error unauthenticated, close 1008",)),
    }
    needles = _needles(key, wrong)
    out: list[SurfaceCheck] = []
    for surface, (call, good, refused) in calls.items():
        before = len(lines()) if lines is not None else 0
        no_key, bad, right = call(None), call(wrong), call(key)
        logged = lines()[before:] if lines is not None else []
        leaked = any(n in line for line in logged for n in needles)
        out.append(SurfaceCheck(surface, no_key, bad, right, rejected=no_key in refused and bad in refused,
                                served=right == good, key_in_logs=leaked))
    open_probes: list[tuple[str, Callable[[], str], str]] = [
        ("gRPC health", lambda: _grpc_health(grpc_target), "SERVING"),
        ("HTTP GET /health", lambda: _http(http_port, "GET", "/health", {}), "200")]
    for surface, probe, good in open_probes:
        got = probe()
        out.append(SurfaceCheck(surface, got, "(not checked)", "(not checked)", rejected=True, served=got == good,
                                open_by_design=True))
    return out


def _needles(*keys: str) -> list[str]:
    """The keys and their SHA-256 (hex), which is what the sidecar keeps in memory."""
    return [*keys, *(hashlib.sha256(k.encode()).hexdigest() for k in keys)]


def leaks(texts: list[str], *keys: str) -> list[str]:
    needles = _needles(*keys)
    return [t for t in texts if any(n in t for n in needles)]


# --- the scenario ---------------------------------------------------------------------------------------
def run(settings: Settings, work: Path, *, quick: bool) -> ScenarioResult:
    from loadtest.faults.surfaces import LogCapture, running_stack

    result = ScenarioResult(NAME, TITLE)
    t0 = time.monotonic()
    key = "sk-right-" + secrets.token_hex(16)
    wrong = "sk-wrong-" + secrets.token_hex(16)
    work.mkdir(parents=True, exist_ok=True)
    try:
        with running_stack(settings, work, api_key=key, items=100 if quick else 300) as stack, LogCapture() as logs:
            checks = probe_surfaces(stack.grpc_target, stack.http_port, stack.ws_url, key, wrong,
                                    lambda: logs.lines)
            reprs = [repr(stack.sidecar.settings), repr(stack.sidecar.settings.sidecar), repr(stack.sidecar.keys)]
        lines = logs.lines
    finally:
        result.seconds = round(time.monotonic() - t0, 1)
    keyed = [c for c in checks if not c.open_by_design]
    refused = [c.surface for c in keyed if not c.rejected]
    result.check("missing or wrong key refused", f"{len(keyed)} of {len(keyed)} surfaces",
                 f"{len(keyed) - len(refused)} of {len(keyed)}" + (f" (not: {', '.join(refused)})" if refused else ""),
                 not refused)
    unserved = [c.surface for c in checks if not c.served]
    result.check("right key served (open probes answer without)", f"{len(checks)} of {len(checks)} surfaces",
                 f"{len(checks) - len(unserved)} of {len(checks)}" + (f" (not: {', '.join(unserved)})" if unserved
                                                                     else ""), not unserved)
    leaked = leaks(lines, key, wrong)
    result.check("log lines holding a key or its digest", "0", f"{len(leaked)} of {len(lines)}", not leaked)
    shown = leaks(reprs, key, wrong)
    result.check("settings and key ring repr holding a key", "0", f"{len(shown)} of {len(reprs)}", not shown)
    result.figures = {"surfaces": [asdict(c) for c in checks], "log_lines": len(lines)}
    result.notes.append("gRPC health and HTTP /health are open by design: probes carry no key, and they say "
                        "only whether the sidecar serves")
    return result


__all__ = ["NAME", "TITLE", "SurfaceCheck", "leaks", "probe_surfaces", "run"]
