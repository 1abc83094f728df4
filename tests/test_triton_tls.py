"""Integration: a real tritonserver in the hardened profile (TLS, mutual TLS, API groups behind keys).

Certificates and keys are made at test time (`make_pool_certs`), never committed. Each refusal is
checked against the same running server, and after each one the server still answers a client that
holds the right credentials.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from embedcar_client.client import Client
from embedcar_settings import Settings
from inference.backends.factory import make_backend
from inference.backends.onnx import OnnxBackend
from inference.backends.triton import CredentialsRefused, TritonBackend
from inference.errors import FailedPrecondition, Unavailable
from inference.manifest import Manifest
from inference.ports import free_port
from inference.tokenizer import QueryTokenizer
from inference.triton.certs import PoolFiles, make_pool_certs
from inference.triton.launcher import TritonServer
from inference.triton.tls import (
    CLIENT_KEY_NAME,
    GRPC_HEADER_PREFIX,
    OPERATOR_KEY_NAME,
    ClientCredentials,
    client_credentials,
    secret_markers,
)
from sidecar.app import SidecarThread
from tests.components import require_triton
from tests.fixtures_sidecar import sidecar_settings

pytestmark = pytest.mark.triton

RESTRICTED = "restricted"  # Triton 2.51: "This protocol is restricted, expecting header '...'"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> PoolFiles:
    return make_pool_certs(tmp_path_factory.mktemp("secrets"), ["triton-a"], ["sidecar"])


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> PoolFiles:
    """Another CA's pool: its certificates must not open ours."""
    return make_pool_certs(tmp_path_factory.mktemp("foreign"), ["triton-x"], ["intruder"])


def copy_dir(*sources: Path, to: Path, drop: tuple[str, ...] = (), replace: dict[str, Path] | None = None) -> Path:
    """A tls_dir made of `sources`' files (later ones win), less `drop`, with `replace`'s files put in."""
    to.mkdir(parents=True)
    for folder in sources:
        for f in folder.iterdir():
            shutil.copy2(f, to / f.name)
    for name in drop:
        (to / name).unlink()
    for name, src in (replace or {}).items():
        shutil.copy2(src, to / name)
    return to


def hardened_settings(settings: Settings, pool: PoolFiles, root: Path) -> Settings:
    """Triton host triton-a with the sidecar's client certificate beside it (the launcher presents that)."""
    tls_dir = copy_dir(pool.dirs["triton-a"], pool.dirs["sidecar"], to=root / "tls")
    return settings.with_section("triton", repo_dir=root / "repo", tls_dir=tls_dir)


@pytest.fixture(scope="module")
def server(settings: Settings, model_dir: Path, pool: PoolFiles, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[TritonServer]:
    require_triton()
    s = hardened_settings(settings, pool, tmp_path_factory.mktemp("triton-hardened"))
    t = TritonServer(s, variant="fp32")
    t.start()
    try:
        yield t
    finally:
        t.stop()


@pytest.fixture
def hs(settings: Settings, server: TritonServer) -> Settings:
    """The hardened settings pointed at the running server (as a sidecar on another host would have them)."""
    return settings.with_section("triton", **_fields(server.settings.triton) | {"urls": (server.grpc_url,)})


def _keys(pool: PoolFiles) -> tuple[str, str]:
    return pool.client_key.read_text().strip(), pool.operator_key.read_text().strip()


def _tls_client(server: TritonServer, pool: PoolFiles, client: str = "sidecar",
                source: PoolFiles | None = None) -> Any:
    cert, key = (source or pool).clients[client]
    return grpcclient.InferenceServerClient(server.grpc_url, ssl=True, root_certificates=str(pool.ca_cert),
                                            certificate_chain=str(cert), private_key=str(key))


def _still_serving(server: TritonServer) -> None:
    assert server.answers(), "tritonserver stopped answering a client with the right credentials"


async def test_tls_client_with_key_embeds(hs: Settings, server: TritonServer, onnx_backend: OnnxBackend,
                                          tokenizer: QueryTokenizer) -> None:
    backend = make_backend(hs, "triton")  # the factory the sidecar and the catalog job use
    assert isinstance(backend, TritonBackend) and backend.credentials is not None
    await backend.start()
    try:
        batch = tokenizer.batch(tokenizer.encode(["organic whole milk", "dark chocolate"]).ids, length=16)
        got = await backend.embed(batch)
        want = onnx_backend.embed_sync(batch)
        cos = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        assert cos.min() >= 0.9999
        # Statistics are the operator's: this client holds the operator key, so they answer.
        assert (await backend.statistics())[backend.model_name]["inference_count"] >= 1
    finally:
        await backend.close()


async def test_client_without_operator_key_reads_no_statistics(hs: Settings, server: TritonServer,
                                                                manifest: Manifest, pool: PoolFiles) -> None:
    creds = client_credentials(hs.with_section("triton", tls_dir=pool.dirs["sidecar"]).triton)  # as written
    assert creds is not None and creds.operator_key is None
    backend = TritonBackend([server.grpc_url], manifest, variant="fp32", credentials=creds, timeout_s=10.0)
    await backend.start()  # inference, health, metadata and config: the sidecar key suffices
    try:
        with pytest.raises(CredentialsRefused, match=RESTRICTED):
            await backend.statistics()
    finally:
        await backend.close()
    _still_serving(server)


def _fields(obj: Any) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in obj.__dataclass_fields__}


async def test_plaintext_client_refused(server: TritonServer, manifest: Manifest) -> None:
    plain = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=10.0)
    finally:
        plain.close()
    backend = TritonBackend([server.grpc_url], manifest, variant="fp32", timeout_s=5.0)
    with pytest.raises(Unavailable, match=server.grpc_url):
        await backend.start()
    await backend.close()
    _still_serving(server)


async def test_certificate_from_another_ca_refused(server: TritonServer, pool: PoolFiles, foreign: PoolFiles,
                                                   hs: Settings, manifest: Manifest, tmp_path: Path) -> None:
    # Checked before connecting: the client's own certificate is not from the pool's CA.
    assert hs.triton.tls_dir is not None
    cert, key = foreign.clients["intruder"]
    bad = hs.with_section("triton", tls_dir=copy_dir(hs.triton.tls_dir, to=tmp_path / "bad",
                                                     replace={"client.pem": cert, "client.key": key}))
    with pytest.raises(FailedPrecondition, match="not issued by the CA"):
        client_credentials(bad.triton)
    # And by Triton itself (mutual TLS) when a client skips that check.
    good = client_credentials(hs.triton)
    assert good is not None
    intruder = ClientCredentials(good.root_ca, cert.read_bytes(), key.read_bytes(), good.client_key, None)
    backend = TritonBackend([server.grpc_url], manifest, variant="fp32", credentials=intruder, timeout_s=5.0)
    with pytest.raises(Unavailable, match=server.grpc_url) as info:
        await backend.start()
    await backend.close()
    assert "client certificate" in info.value.message  # says what to check
    raw = _tls_client(server, pool, "intruder", source=foreign)
    try:
        with pytest.raises(InferenceServerException):
            raw.is_server_live(headers={GRPC_HEADER_PREFIX + CLIENT_KEY_NAME: good.client_key}, client_timeout=10.0)
    finally:
        raw.close()
    _still_serving(server)


async def test_client_trusting_another_ca_refuses_triton(server: TritonServer, foreign: PoolFiles,
                                                         hs: Settings, manifest: Manifest) -> None:
    """A client whose CA did not sign Triton's certificate stops at start-up, naming the URL and TLS."""
    good = client_credentials(hs.triton)
    assert good is not None
    wrong_ca = ClientCredentials(foreign.ca_cert.read_bytes(), good.cert_chain, good.private_key, good.client_key, None)
    backend = TritonBackend([server.grpc_url], manifest, variant="fp32", credentials=wrong_ca, timeout_s=5.0)
    with pytest.raises(CredentialsRefused, match=server.grpc_url) as info:
        await backend.start()
    await backend.close()
    assert "handshake" in info.value.message.lower() or "certificate" in info.value.message.lower()


def _calls(c: Any, manifest: Manifest, ensemble: str) -> dict[str, Any]:
    """One call per API group; each takes the headers to send."""
    ids = np.ones((1, 16), dtype=np.int32)
    inputs = []
    for name in manifest.inputs:
        inp = grpcclient.InferInput(name, [1, 16], "INT32")
        inp.set_data_from_numpy(ids if name != "token_type_ids" else np.zeros_like(ids))
        inputs.append(inp)
    return {
        "inference": lambda h: c.infer(ensemble, inputs, headers=h, client_timeout=30.0),
        "health": lambda h: c.is_server_ready(headers=h, client_timeout=10.0),
        "metadata": lambda h: c.get_model_metadata(ensemble, headers=h, client_timeout=10.0),
        "model-config": lambda h: c.get_model_config(ensemble, headers=h, client_timeout=10.0),
        "logging": lambda h: c.get_log_settings(headers=h, client_timeout=10.0),
        "shared-memory": lambda h: c.get_system_shared_memory_status(headers=h, client_timeout=10.0),
        "model-repository": lambda h: c.get_model_repository_index(headers=h, client_timeout=10.0),
        "trace": lambda h: c.get_trace_settings(headers=h, client_timeout=10.0),
        "statistics": lambda h: c.get_inference_statistics(headers=h, client_timeout=10.0),
    }


SIDECAR_GROUPS = ("inference", "health", "metadata", "model-config")
OPERATOR_GROUPS = ("logging", "shared-memory", "model-repository", "trace", "statistics")


def test_every_group_needs_its_key(server: TritonServer, pool: PoolFiles, manifest: Manifest) -> None:
    key, op = _keys(pool)
    sidecar = {GRPC_HEADER_PREFIX + CLIENT_KEY_NAME: key}
    operator = {GRPC_HEADER_PREFIX + OPERATOR_KEY_NAME: op}
    swapped = {GRPC_HEADER_PREFIX + OPERATOR_KEY_NAME: key}  # the sidecar's key in the operator's header
    c = _tls_client(server, pool)
    try:
        calls = _calls(c, manifest, server.ensembles[0])
        for group, call in calls.items():
            with pytest.raises(InferenceServerException, match=RESTRICTED):
                call(None)  # TLS with a valid client certificate, but no key header
            mine = sidecar if group in SIDECAR_GROUPS else operator
            other = operator if group in SIDECAR_GROUPS else sidecar
            with pytest.raises(InferenceServerException, match=RESTRICTED):
                call(other)
            if group not in SIDECAR_GROUPS:
                with pytest.raises(InferenceServerException, match=RESTRICTED):
                    call(swapped)
            call(mine)  # the right key opens exactly its own group
    finally:
        c.close()
    _still_serving(server)


def test_repository_load_and_unload_refused(server: TritonServer, pool: PoolFiles) -> None:
    _key, op = _keys(pool)
    operator = {GRPC_HEADER_PREFIX + OPERATOR_KEY_NAME: op}
    c = _tls_client(server, pool)
    try:
        calls: list[Callable[[dict[str, str] | None], Any]] = [
            lambda h: c.load_model(server.ensembles[0], headers=h, client_timeout=30.0),
            lambda h: c.unload_model(server.ensembles[0], headers=h, client_timeout=30.0)]
        for call in calls:
            with pytest.raises(InferenceServerException, match=RESTRICTED):
                call(None)
            # Even the operator cannot: model control mode is none.
            with pytest.raises(InferenceServerException) as info:
                call(operator)
            assert RESTRICTED not in str(info.value)
    finally:
        c.close()
    _still_serving(server)


def _http(server: TritonServer, method: str, path: str, headers: dict[str, str] | None = None,
          body: bytes | None = None) -> int:
    req = urllib.request.Request(server.http_url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_http_on_loopback_with_the_same_groups(server: TritonServer, pool: PoolFiles) -> None:
    key, op = _keys(pool)
    assert server.http_host == "127.0.0.1"
    assert _http(server, "GET", "/v2/health/ready") == 200  # the container healthcheck, no secret
    body = b'{"inputs":[{"name":"input_ids","shape":[1,16],"datatype":"INT32","data":[' + b",".join(
        [b"1"] * 16) + b"]}]}"
    model = f"/v2/models/{server.ensembles[0]}"
    for path, method, data, mine in ((f"{model}/infer", "POST", body, {CLIENT_KEY_NAME: key}),
                                     (model, "GET", None, {CLIENT_KEY_NAME: key}),
                                     ("/v2/logging", "GET", None, {OPERATOR_KEY_NAME: op}),
                                     ("/v2/models/stats", "GET", None, {OPERATOR_KEY_NAME: op}),
                                     ("/v2/trace/setting", "GET", None, {OPERATOR_KEY_NAME: op}),
                                     ("/v2/systemsharedmemory/status", "GET", None, {OPERATOR_KEY_NAME: op}),
                                     ("/v2/repository/index", "POST", b"{}", {OPERATOR_KEY_NAME: op})):
        refused = _http(server, method, path, body=data)
        assert refused in (401, 403), (path, refused)
        if path != f"{model}/infer":  # inference over HTTP needs every input: the key is what counts
            assert _http(server, method, path, headers=mine, body=data) == 200, path
    assert _http(server, "POST", f"/v2/repository/models/{server.ensembles[0]}/unload", headers={OPERATOR_KEY_NAME: op},
                 body=b"{}") != 200
    _still_serving(server)


async def test_failover_unchanged_a_dead_url_is_not_a_credential_error(hs: Settings, server: TritonServer,
                                                                        tokenizer: QueryTokenizer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    backend = make_backend(hs.with_section("triton", urls=(dead, server.grpc_url)), "triton")
    await backend.start()
    try:
        batch = tokenizer.batch(tokenizer.encode(["bread"]).ids, length=16)
        for _ in range(4):  # round-robin reaches the dead URL and moves on
            assert (await backend.embed(batch)).shape == (1, 384)
    finally:
        await backend.close()


async def test_no_key_material_in_any_log(hs: Settings, server: TritonServer, pool: PoolFiles, foreign: PoolFiles,
                                          manifest: Manifest, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    backend = make_backend(hs, "triton")
    await backend.start()
    await backend.close()
    bad = ClientCredentials(foreign.ca_cert.read_bytes(), None, None, "x" * 20, None)
    failing = TritonBackend([server.grpc_url], manifest, variant="fp32", credentials=bad, timeout_s=5.0)
    with pytest.raises(Exception) as info:
        await failing.start()
    await failing.close()
    key, op = _keys(pool)
    secrets = secret_markers(hs.triton)  # both keys, the server's and the client's private keys in pieces
    assert key in secrets and op in secrets and len(secrets) > 10
    texts = {"client log": caplog.text + str(info.value), "tritonserver log": server.log_file.read_text()}
    for where, text in texts.items():
        assert text, where
        for s in secrets:
            assert s not in text, f"key material in the {where}"


def test_the_keys_are_on_no_command_line(server: TritonServer, pool: PoolFiles) -> None:
    """`ps` shows every local user each process's arguments: tritonserver's show placeholders (the keys
    reach it through a preloaded shim, inference/triton/argv_secrets.py), and the backend processes it
    started hold the keys neither in their arguments nor in their environment."""
    key, op = _keys(pool)
    assert server.pid is not None
    group = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(int(p.name)) == server.pid]
    assert server.pid in group and len(group) > 1, "tritonserver and its Python-backend stubs"
    for pid in group:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline and op.encode() not in cmdline, f"a key on the command line of {pid}"
        if pid != server.pid:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert key.encode() not in environ and b"argv_secrets" not in environ
    assert b"--grpc-restricted-protocol=" in Path(f"/proc/{server.pid}/cmdline").read_bytes()
    _still_serving(server)  # and the keys work: test_every_group_needs_its_key


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


async def test_sidecar_key_in_wrong_file_is_a_startup_error(hs: Settings, server: TritonServer,
                                                            tmp_path: Path) -> None:
    assert hs.triton.tls_dir is not None
    wrong = copy_dir(hs.triton.tls_dir, to=tmp_path / "wrong")
    (wrong / "client_key.txt").write_text("W" * 32 + "\n")
    backend = make_backend(hs.with_section("triton", tls_dir=wrong), "triton")
    with pytest.raises(CredentialsRefused, match=server.grpc_url) as info:
        await backend.start()
    await backend.close()
    assert RESTRICTED in info.value.message and "W" * 32 not in info.value.message


def test_sidecar_embeds_and_searches_through_hardened_triton(hs: Settings, grocery_index_root: Path,
                                                             onnx_backend: OnnxBackend,
                                                             tokenizer: QueryTokenizer) -> None:
    s = sidecar_settings(hs.with_section("triton", timeout_ms=30_000), backend="triton",
                         http_port=-1, index_dir=grocery_index_root, embedded_fallback=False)
    with SidecarThread(s) as sc, Client(sc.grpc_target) as c:
        assert sc.backend.name == "triton"
        r = c.embed(["organic whole milk"])
        assert r.backend == "triton"  # Triton answered, not a fallback
        want = onnx_backend.embed_sync(tokenizer.batch(tokenizer.encode(["organic whole milk"]).ids, length=16))
        assert float(np.sum(r.embeddings[0] * want[0])) >= 0.9999
        hits = [h.id for h in c.search(["oat milk"], k=5).hits[0]]
    # The same search with the embedded model: the same products.
    with SidecarThread(sidecar_settings(hs, http_port=-1, index_dir=grocery_index_root)) as sc, \
            Client(sc.grpc_target) as c:
        assert [h.id for h in c.search(["oat milk"], k=5).hits[0]] == hits and len(hits) == 5


def test_compose_triton_command_serves_hardened(settings: Settings, model_dir: Path, pool: PoolFiles,
                                                tmp_path: Path) -> None:
    """docker-compose.yml's Triton command, run as compose would (the keys read from their files by
    inference.triton.argv_secrets, placeholders on the command line), against the wheel's tritonserver: it
    starts, refuses a call without the key and serves one with it, and `ps` shows no key. Only what a
    machine without Docker and a GPU must change is changed: binary, repository, ports, certificate
    folder, loopback instead of the container's 0.0.0.0, this Python and this checkout for the container's."""
    yaml: Any = importlib.import_module("yaml")  # untyped, as in tests/test_compose.py
    from inference.manifest import load_manifest
    from inference.triton.launcher import assemble_backend_dir, pytriton_root
    from inference.triton.names import served_names
    from inference.triton.repository import generate_repository

    require_triton()
    root = Path(__file__).resolve().parent.parent
    service = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]["triton"]
    binary = pytriton_root()
    assert binary is not None
    s = settings.with_section("triton", repo_dir=tmp_path / "repo")
    manifest = load_manifest(model_dir)
    repo = generate_repository(s, manifest, model_dir, target="cpu", variant="fp32", out_dir=tmp_path / "repo-cpu-fp32")
    ensemble = served_names(manifest, "fp32").ensemble
    ports = {p: free_port() for p in ("8001", "8000", "8002")}
    command: list[str] = []
    for arg in (str(a) for a in service["entrypoint"]):
        if arg == "python3":
            command.append(sys.executable)
        elif arg == "tritonserver":
            command.append(str(binary / "bin" / "tritonserver"))
        elif arg == "--model-repository=/repo":
            backends = assemble_backend_dir(tmp_path / "backends")
            command += [f"--model-repository={repo}", f"--backend-directory={backends}",
                        f"--backend-config=python,shm-region-prefix-name=embedcar_compose_{os.getpid()}_"]
        else:
            arg = arg.replace("/secrets/triton", str(pool.dirs["triton-a"])).replace("0.0.0.0", "127.0.0.1")
            for old, new in ports.items():
                arg = re.sub(rf"^(--\w+-port=){old}$", rf"\g<1>{new}", arg)
            command.append(arg)
    assert service["working_dir"] == "/opt/embedcar"  # where the container mounts inference/: this checkout
    env = TritonServer(s)._env() | {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    log = (tmp_path / "compose-triton.log").open("wb")
    proc = subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    key, op = _keys(pool)
    cert, ckey = pool.clients["sidecar"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['8001']}", ssl=True,
                                              root_certificates=str(pool.ca_cert), certificate_chain=str(cert),
                                              private_key=str(ckey))
    header = {GRPC_HEADER_PREFIX + CLIENT_KEY_NAME: key}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "compose-triton.log").read_text()[-3000:]
            try:
                if client.is_model_ready(ensemble, headers=header, client_timeout=5.0):
                    break
            except InferenceServerException:
                pass
            assert time.monotonic() < deadline, "compose's tritonserver command never became ready"
            time.sleep(0.5)
        with pytest.raises(InferenceServerException, match=RESTRICTED):
            client.is_model_ready(ensemble, client_timeout=5.0)
        with pytest.raises(InferenceServerException, match=RESTRICTED):
            client.get_log_settings(headers=header, client_timeout=5.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['8000']}/v2/health/ready", timeout=5) as r:
            assert r.status == 200  # the compose healthcheck's call
        assert key not in (tmp_path / "compose-triton.log").read_text()
        # The launcher exec'd tritonserver (one process): what `ps` shows holds placeholders, not keys.
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"tritonserver" in cmdline and b"@@EMBEDCAR_SECRET_0@@" in cmdline
        assert key.encode() not in cmdline and op.encode() not in cmdline
    finally:
        client.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log.close()
        for f in Path("/dev/shm").glob(f"embedcar_compose_{os.getpid()}_*"):
            f.unlink(missing_ok=True)


async def test_load_test_reads_statistics_of_a_hardened_triton(hs: Settings, server: TritonServer) -> None:
    from loadtest.targets import TritonStats

    creds = client_credentials(hs.triton)
    for credentials, expect in ((creds, True), (None, False)):  # a plaintext reader is refused: no figures
        stats = TritonStats(server.grpc_url, credentials)
        await stats.start()
        try:
            got = await stats.read()
        finally:
            await stats.close()
        assert (got is not None and server.ensembles[0] in got) == expect, credentials


def test_catalog_job_embeds_through_hardened_triton(hs: Settings, tmp_path: Path, grocery_slice: Any,
                                                    grocery_build: Any, onnx_backend: OnnxBackend) -> None:
    """The batch job's own backend (`backend_kind="triton"`: the shared factory, hardened settings)."""
    import asyncio

    from catalog import store
    from catalog.job import build
    from catalog.sources import Loaded
    from catalog.spec import BuildSpec
    from tests.fixtures_catalog import catalog_settings_for

    n = 48
    s = catalog_settings_for(hs, tmp_path / "idx", in_flight=2)
    summary = asyncio.run(build(s, BuildSpec(), backend_kind="triton", progress=False,
                                loaded=Loaded(grocery_slice.products[:n], [], "slice")))
    assert summary.model_id == onnx_backend.version_id
    assert summary.version_dir is not None and grocery_build.version_dir is not None
    got = np.load(summary.version_dir / store.VECTORS_FILE)
    want = np.load(grocery_build.version_dir / store.VECTORS_FILE)[:n]
    assert float(np.min(np.sum(got * want, axis=1))) > 0.9999
