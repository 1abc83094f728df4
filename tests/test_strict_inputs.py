"""Strict inputs, one-line errors: settings ranges, bind failures, --index-dir, the
client's str handling. The one-line checks run `embedcar` as a real subprocess; the rest real sidecars."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from embedcar_client.client import AsyncClient, Client
from embedcar_settings import Settings
from inference.backends.onnx import OnnxBackend
from inference.errors import EmbedcarError, InvalidInput, Unavailable
from inference.settings import range_text
from inference.tokenizer import QueryTokenizer
from sidecar import app
from sidecar.app import Sidecar, SidecarThread
from sidecar.settings import Settings as SidecarAppSettings
from tests.conftest import ROOT
from tests.fixtures_sidecar import sidecar_settings
from tests.test_sidecar_search import PRODUCTS, publish

# --- settings ranges ------------------------------------------------------------------------------


def _numeric_fields() -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """(section, field, default) of every int / float (or tuple of them) field the sidecar reads."""
    for sec in dataclasses.fields(SidecarAppSettings):
        cls = typing.get_type_hints(SidecarAppSettings)[sec.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            item = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp
            if item in (int, float):
                yield sec.name, f, f.default


def test_every_numeric_setting_has_a_range_holding_its_default() -> None:
    unbounded = [f"{sec}.{f.name}" for sec, f, _ in _numeric_fields() if not range_text(f)]
    assert not unbounded, f"give these setting(..., min=..., max=...): {unbounded}"
    for sec, f, default in _numeric_fields():
        low, high = f.metadata["min"], f.metadata["max"]
        for v in default if isinstance(default, tuple) else (default,):
            assert (low is None or v >= low) and (high is None or v <= high), f"{sec}.{f.name} default {v}"


@pytest.mark.parametrize(("environ", "overrides", "message"), [
    ({"EMBEDCAR_SIDECAR_GRPC_PORT": "99999"}, None,
     "EMBEDCAR_SIDECAR_GRPC_PORT: 99999 is out of range: 0 to 65535 (0 = a free one)"),
    ({}, {"sidecar": {"http_port": 70000}},
     "--http-port: 70000 is out of range: -1 to 65535 (0 = a free one, -1 = off)"),
    ({}, {"model": {"intra_op_threads": -1}}, "--threads: -1 is out of range: 0 to 1024"),
    ({"EMBEDCAR_MODEL_FORWARD_LANES": "0"}, None, "EMBEDCAR_MODEL_FORWARD_LANES: 0 is out of range: 1 to 256"),
    ({"EMBEDCAR_SIDECAR_RATE_PER_S": "nan"}, None, "EMBEDCAR_SIDECAR_RATE_PER_S: nan is out of range: at least 0"),
    ({"EMBEDCAR_TRITON_INSTANCES": "-2"}, None, "EMBEDCAR_TRITON_INSTANCES: -2 is out of range: at least 0"),
    ({"EMBEDCAR_CATALOG_MAX_BAD_SHARE": "1.5"}, None, "1.5 is out of range: 0 to 1"),
    ({"EMBEDCAR_SIDECAR_GRPC_PORT": "50o51"}, None,
     "EMBEDCAR_SIDECAR_GRPC_PORT: cannot read '50o51' as a whole number"),
])
def test_out_of_range_settings_are_refused_naming_the_source_value_and_range(
        environ: dict[str, str], overrides: dict[str, dict[str, Any]] | None, message: str) -> None:
    with pytest.raises(InvalidInput) as err:
        SidecarAppSettings.load(environ=environ, overrides=overrides)
    assert message in err.value.message


def test_the_ends_of_a_range_and_the_special_ports_are_accepted() -> None:
    s = SidecarAppSettings.load(environ={"EMBEDCAR_SIDECAR_GRPC_PORT": "65535", "EMBEDCAR_SIDECAR_HTTP_PORT": "-1",
                                         "EMBEDCAR_SIDECAR_CACHE_ENTRIES": "0"},
                                overrides={"triton": {"grpc_port": 0}, "model": {"forward_lanes": 1}})
    assert (s.sidecar.grpc_port, s.sidecar.http_port, s.triton.grpc_port) == (65535, -1, 0)
    assert s.sidecar.cache_entries == 0 and s.model.forward_lanes == 1


# --- the command line: one line, exit status 2 ----------------------------------------------------


def embedcar(*args: str, env: dict[str, str] | None = None, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDCAR_")}
    return subprocess.run([sys.executable, "-m", "inference.cli_main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s, check=False, env=clean | (env or {}))


def one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    """The `embedcar: ...` line a failed command ended with: its only one, last, no traceback."""
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    said = [line for line in p.stderr.splitlines() if line.startswith("embedcar: ")]
    assert len(said) == 1 and p.stderr.rstrip().splitlines()[-1] == said[0], p.stderr
    return said[0]


@pytest.mark.parametrize(("args", "env", "message"), [
    (("--grpc-port", "99999"), None, "--grpc-port: 99999 is out of range: 0 to 65535"),
    (("--grpc-port", "65536"), None, "--grpc-port: 65536 is out of range: 0 to 65535"),
    (("--http-port", "70000"), None, "--http-port: 70000 is out of range: -1 to 65535"),
    (("--threads", "-1"), None, "--threads: -1 is out of range"),
    (("--lanes", "0"), None, "--lanes: 0 is out of range"),
    (("--cache-entries", "-5"), None, "--cache-entries: -5 is out of range: at least 0"),
    ((), {"EMBEDCAR_SIDECAR_HTTP_PORT": "70000"}, "EMBEDCAR_SIDECAR_HTTP_PORT: 70000 is out of range"),
])
def test_serve_refuses_out_of_range_numbers_in_one_line(args: tuple[str, ...], env: dict[str, str] | None,
                                                        message: str) -> None:
    assert message in one_line_error(embedcar("sidecar", "serve", *args, env=env))


@pytest.mark.parametrize("args", [("build", "products.csv"), ("quality",)])
def test_a_catalog_limit_under_one_is_refused(args: tuple[str, ...]) -> None:
    p = embedcar("catalog", *args, "--limit", "-1")
    assert p.returncode == 2 and "argument --limit: -1 is out of range: at least 1" in p.stderr, p.stderr


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def _serve_args(settings: Settings, *args: str) -> list[str]:
    return ["sidecar", "serve", "--models-dir", str(settings.model.models_dir), "--variant", "fp32",
            "--threads", "1", *args]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ("--grpc-port", "{busy}", "--http-port", "-1"),
    ("--grpc-port", "0", "--http-port", "{busy}"),
])
def test_a_port_in_use_is_one_line_naming_its_flag_and_port(settings: Settings, busy_port: int,
                                                            flags: tuple[str, ...]) -> None:
    args = [a.format(busy=busy_port) for a in flags]
    flag = args[args.index(str(busy_port)) - 1]
    line = one_line_error(embedcar(*_serve_args(settings, *args)))
    assert line.startswith(f"embedcar: {flag} {busy_port}: cannot listen on 127.0.0.1:{busy_port}: the port is in use")


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_serve_refuses_an_index_dir_that_is_not_a_folder(settings: Settings, tmp_path: Path, kind: str) -> None:
    target = tmp_path / "indexes" / "grocery"
    if kind == "file":
        target.parent.mkdir()
        target.write_text("not an index")
    line = one_line_error(embedcar(*_serve_args(settings, "--grpc-port", "0", "--http-port", "-1",
                                                "--index-dir", str(target))))
    what = "no such folder" if kind == "missing" else "a file, not a folder"
    assert line.startswith(f"embedcar: --index-dir {target}: {what}")


# --- bind failures past the up-front check (another process took the port in between) ---------------


@pytest.fixture
def no_precheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leave the bind to the servers themselves, as when another process takes a port after the check."""
    monkeypatch.setattr(app, "check_listenable", lambda *_a, **_k: None)


@pytest.mark.parametrize(("changes", "flag"), [
    ({"grpc_port": "busy"}, "--grpc-port"),
    ({"http_port": "busy"}, "--http-port"),
])
@pytest.mark.usefixtures("no_precheck")
def test_each_server_s_own_bind_failure_names_its_flag_and_port(
        settings: Settings, onnx_backend: OnnxBackend, busy_port: int, changes: dict[str, str], flag: str) -> None:
    s = sidecar_settings(settings, **({"http_port": -1} | {k: busy_port for k in changes}))
    with pytest.raises(EmbedcarError) as err, SidecarThread(s, backend=onnx_backend):
        pass
    assert err.value.message.startswith(f"{flag} {busy_port}: cannot listen on 127.0.0.1:{busy_port}: ")
    assert "\n" not in err.value.message


# --- --index-dir ---------------------------------------------------------------------------------------


def test_an_index_version_given_as_the_index_dir_is_refused(settings: Settings, onnx_backend: OnnxBackend,
                                                            tokenizer: QueryTokenizer, tmp_path: Path) -> None:
    root = tmp_path / "index"
    publish(settings, root, onnx_backend, tokenizer, PRODUCTS)
    version = next(p for p in root.iterdir() if (p / "manifest.json").is_file())
    with pytest.raises(InvalidInput, match="one index version, not the index root above it"):
        Sidecar(sidecar_settings(settings, index_dir=version), backend=onnx_backend)


def test_an_empty_index_folder_starts_and_says_search_waits(settings: Settings, onnx_backend: OnnxBackend,
                                                            tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Deliberately not refused: a sidecar may start before the catalog job's first publish.
    root = tmp_path / "index"
    root.mkdir()
    s = sidecar_settings(settings, http_port=-1, index_dir=root).with_section("catalog", use_gpu=False)
    with caplog.at_level(logging.WARNING, logger="sidecar.app"), SidecarThread(s, backend=onnx_backend) as sc, \
            Client(sc.grpc_target) as c:
        assert sc.serving  # Embed is served
        with pytest.raises(Unavailable, match="no product index"):
            c.search("milk")
    assert any("Search answers UNAVAILABLE until an index loads" in r.getMessage() and str(root) in r.getMessage()
               for r in caplog.records), caplog.text


# --- the client: a str is one text ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def search_car(settings: Settings, onnx_backend: OnnxBackend, tokenizer: QueryTokenizer,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    root = tmp_path_factory.mktemp("str-index")
    publish(settings, root, onnx_backend, tokenizer, PRODUCTS)
    s = sidecar_settings(settings, index_dir=root).with_section("catalog", use_gpu=False)
    with SidecarThread(s, backend=onnx_backend) as sc:
        assert sc.index.current() is not None
        yield sc


def test_sync_client_takes_a_str_as_one_text(search_car: Sidecar) -> None:
    with Client(search_car.grpc_target) as c:
        one = c.embed("greek yogurt")  # was 12 texts, one a space: "text 5 is empty"
        assert one.embeddings.shape == (1, 384)
        assert c.embed("yogurt").embeddings.shape == (1, 384)  # was 6 rows, one per letter
        np.testing.assert_allclose(one.embeddings, c.embed(["greek yogurt"]).embeddings, atol=1e-6)
        hits = c.search("whole milk", k=3).hits
        assert len(hits) == 1 and hits[0][0].id == "p1"
        assert [h[0].id for h in c.search(("whole milk", "chocolate"), k=1).hits] == ["p1", "p5"]


@pytest.mark.parametrize("stream", [False, True])
async def test_async_client_takes_a_str_as_one_text(search_car: Sidecar, stream: bool) -> None:
    async with AsyncClient(search_car.grpc_target, stream=stream) as c:
        one = await c.embed("greek yogurt")
        assert one.embeddings.shape == (1, 384)
        np.testing.assert_allclose(one.embeddings, (await c.embed(["greek yogurt"])).embeddings, atol=1e-6)
        hits = (await c.search("whole milk", k=3)).hits
        assert len(hits) == 1 and hits[0][0].id == "p1"


def test_http_keeps_a_bare_string_input_as_one_text_like_openai(search_car: Sidecar) -> None:
    url = f"http://127.0.0.1:{search_car.http_port}"
    data = httpx.post(f"{url}/v1/embeddings", json={"input": "greek yogurt"}, timeout=60).json()["data"]
    assert len(data) == 1
    with Client(search_car.grpc_target) as c:
        np.testing.assert_allclose(np.array(data[0]["embedding"]), c.embed("greek yogurt").embeddings[0], atol=1e-5)
    results = httpx.post(f"{url}/v1/search", json={"input": "whole milk", "k": 3}, timeout=60).json()["data"]
    assert len(results) == 1 and results[0]["hits"][0]["id"] == "p1"
