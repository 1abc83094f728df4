"""sidecar.client is a client: importing it loads the stubs, the wire constants, the error types and
its result types, not the server (pipeline, batcher, backends, catalog), so a search node can use it
with the core dependencies alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from catalog.fusion import SearchMode
from inference.errors import InvalidInput
from sidecar import client
from sidecar.proto import embedcar_pb2 as pb
from sidecar.timings import STAGES

PROJECT = ("inference", "catalog", "sidecar", "demo_ui", "loadtest", "embedcar_settings", "embedcar_docs")
MAX_MODULES = 12
SERVER = ("sidecar.grpc_server", "sidecar.listeners", "sidecar.pipeline", "sidecar.batcher", "sidecar.service",
          "sidecar.app", "sidecar.timings", "inference.backends", "catalog")
# grpc imports grpc_tools, grpc_health and grpc_reflection where they are installed (its optional
# `grpc.tools`, `grpc.health` aliases); typing_extensions is grpcio's; cython_runtime is built in.
THIRD_PARTY = {"grpc", "google", "numpy", "typing_extensions", "grpc_tools", "grpc_health", "grpc_reflection",
               "cython_runtime"}


def test_importing_the_client_loads_no_server_module() -> None:
    code = "import json, sys; import sidecar.client; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    modules: list[str] = json.loads(out.stdout)
    loaded = [m for m in modules if m.split(".")[0] in PROJECT]
    assert len(loaded) <= MAX_MODULES, loaded
    server = [m for m in loaded if any(m == s or m.startswith(s + ".") for s in SERVER)]
    assert not server, server
    # Third-party: grpcio, protobuf and numpy, what docs/sidecar.md tells a search node to install.
    tops = {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - set(PROJECT)
    assert {t for t in tops if not t.startswith("_")} <= THIRD_PARTY, tops
    assert all(m.startswith(("google.protobuf", "google._upb")) for m in modules if m.startswith("google.")), modules


def test_its_names_match_the_servers() -> None:
    """The stage and mode names the client takes from the .proto are the server's."""
    assert STAGES == client.STAGES
    assert tuple(m.value for m in SearchMode) == client.SEARCH_MODES
    assert SearchMode.SEMANTIC.value == client.SEMANTIC


def test_search_modes_are_sent_as_the_protos_labels() -> None:
    for mode in SearchMode:  # the server's enum is a str: callers may pass it
        req = client.search_request("oat milk", 5, None, None, mode)
        assert pb.SearchMode.Name(req.mode).lower() == mode.value
    assert client.search_request(["x"], 5, None, None, " Hybrid ").mode == pb.HYBRID
    assert client.search_request(["x"], 5, None, None).mode == pb.SEMANTIC
    with pytest.raises(InvalidInput, match="unknown search mode 'fuzzy'; expected one of semantic, lexical, hybrid"):
        client.search_request(["x"], 5, None, None, "fuzzy")


def test_a_search_reply_decodes_to_the_clients_hits() -> None:
    reply = pb.SearchReply(results=[pb.HitList(hits=[pb.Hit(id="7", score=0.5, fields={"title": "oat milk"},
                                                            legs=["semantic", "lexical"])])],
                           model="m", index_version="v1", cache_hits=[True])
    res = client.decode_search(reply)
    assert res.hits == [[client.SearchHit("7", 0.5, {"title": "oat milk"}, ("semantic", "lexical"))]]
    assert (res.model, res.index_version, res.cache_hits) == ("m", "v1", [True])
    assert set(res.timings_ns) == set(STAGES)
