"""embedcar_client.client is a client: importing it loads the stubs, the wire constants, the error types
and its result types from its own distribution (embedcar-client, client/), no module of the server's
packages, so a search node can use it with grpcio, protobuf and numpy alone (tests/test_client_package.py
installs it alone). The server depends on it: the same classes and the one copy of the stubs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import embedcar_client.errors
import inference.errors
from catalog.fusion import SearchMode
from embedcar_client import client
from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_client.wire import SERVICE
from inference.errors import InvalidInput
from sidecar.timings import STAGES

PROJECT = ("inference", "catalog", "sidecar", "demo_ui", "loadtest", "embedcar_settings", "embedcar_docs")
CLIENT = "embedcar_client"
MAX_MODULES = 10
# grpc imports grpc_tools, grpc_health and grpc_reflection where they are installed (its optional
# `grpc.tools`, `grpc.health` aliases); typing_extensions is grpcio's; cython_runtime is built in.
THIRD_PARTY = {"grpc", "google", "numpy", "typing_extensions", "grpc_tools", "grpc_health", "grpc_reflection",
               "cython_runtime"}


def test_importing_the_client_loads_no_server_module() -> None:
    code = "import json, sys; import embedcar_client.client; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    modules: list[str] = json.loads(out.stdout)
    assert not [m for m in modules if m.split(".")[0] in PROJECT]
    assert len([m for m in modules if m.split(".")[0] == CLIENT]) <= MAX_MODULES, modules
    # Third-party: grpcio, protobuf and numpy, what the client's pyproject depends on.
    tops = {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - {CLIENT}
    assert {t for t in tops if not t.startswith("_")} <= THIRD_PARTY, tops
    assert all(m.startswith(("google.protobuf", "google._upb")) for m in modules if m.startswith("google.")), modules


def test_the_server_uses_the_clients_errors_and_stubs() -> None:
    """inference.errors re-exports the client's classes (one hierarchy, one code table), and the stubs are
    registered once, under the client's path, for the service name callers dial."""
    assert inference.errors.InvalidInput is embedcar_client.errors.InvalidInput
    assert inference.errors.ERROR_CODES is embedcar_client.errors.ERROR_CODES
    assert pb.DESCRIPTOR.name == "embedcar_client/proto/embedcar.proto"
    assert SERVICE == "embedcar.v1.Embedder"


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
