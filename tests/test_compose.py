"""docker-compose.yml, checked without a Docker engine: structure, ports and paths against the settings."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from embedcar_settings import Settings
from inference.manifest import Manifest
from inference.triton import argv_secrets, tls
from inference.triton.certs import make_pool_certs
from inference.triton.tls import LOCKED_FLAGS, restricted_flags

# PyYAML arrives with uvicorn[standard]; imported untyped so the check holds with or without its stubs.
yaml: Any = importlib.import_module("yaml")
ROOT = Path(__file__).resolve().parent.parent
# A standard-library-only run from the checkout finds the client's package as Triton's container does, beside
# inference/ (its mount /opt/embedcar/embedcar_client): here in client/.
CLIENT_BESIDE = {**os.environ, "PYTHONPATH": str(ROOT / "client")}
DEFAULTS = Settings.load(environ={})


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _unset(value: object) -> str:
    """A compose value as compose reads it with none of its variables set: `${X:-default}` -> default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def _ports(service: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """container port -> (host address, host port)."""
    out = {}
    for p in service.get("ports", []):
        host, hport, cport = _unset(p).split(":")
        out[int(cport)] = (host, int(hport))
    return out


def _env(service: dict[str, Any]) -> dict[str, str]:
    return {k: _unset(v) for k, v in (service.get("environment") or {}).items()}


def _entry(service: dict[str, Any]) -> str:
    """The entrypoint as the shell receives it (compose turns `$$` into `$`)."""
    return " ".join(str(x) for x in service["entrypoint"]).replace("$$", "$")


def test_services_present(compose: dict[str, Any]) -> None:
    assert {"triton", "sidecar", "demo", "triton-repo", "catalog"} <= set(compose["services"])
    for name in ("triton", "sidecar", "demo"):
        hc = compose["services"][name]["healthcheck"]
        assert hc["test"][0] == "CMD" and len(hc["test"]) > 1


def test_triton_service_gpu_and_shm(compose: dict[str, Any]) -> None:
    t = compose["services"]["triton"]
    assert t["image"].startswith("nvcr.io/nvidia/tritonserver:")
    (dev,) = t["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    m = re.fullmatch(r"(\d+)(mb|gb)", str(t["shm_size"]).lower())
    assert m, t["shm_size"]
    shm_mb = int(m.group(1)) * (1024 if m.group(2) == "gb" else 1)
    # Room for one full-size hidden state (256 x 512 x 384 fp32) on its way to the pooling step.
    assert shm_mb * 2**20 >= 256 * 512 * 384 * 4


def test_triton_ports_match_settings(compose: dict[str, Any]) -> None:
    t = compose["services"]["triton"]
    entry = _entry(t)
    s = DEFAULTS.triton
    for flag, port in (("grpc", s.grpc_port), ("http", s.http_port), ("metrics", s.metrics_port)):
        assert f"--{flag}-port={port}" in entry
    for port in (s.grpc_port, s.metrics_port):
        assert _ports(t)[port] == ("127.0.0.1", port)
    # HTTP: the container's own loopback, for its healthcheck; never published.
    assert f"--http-address=127.0.0.1 --http-port={s.http_port}" in entry and s.http_port not in _ports(t)
    assert f"localhost:{s.http_port}/v2/health/ready" in " ".join(t["healthcheck"]["test"])


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """container path -> (source, read-only)."""
    out = {}
    for v in service["volumes"]:
        parts = _unset(v).split(":")
        out[parts[1]] = (parts[0], parts[2:] == ["ro"])
    return out


def test_triton_is_hardened(compose: dict[str, Any], tmp_path: Path) -> None:
    """Mutual TLS, the API groups of inference/triton/tls.py behind the key files, model control off,
    repository read-only, not root; the sidecar and the catalog job are clients of that profile. Each
    mounts a folder that `embedcar triton certs --hosts triton` (the default client: sidecar) writes, with
    the files the command line and the clients read."""
    pool = make_pool_certs(tmp_path / "var/secrets/triton", ["triton"])
    t = compose["services"]["triton"]
    entry = _entry(t)
    mounts = _mounts(t)
    secrets_dir, (host_dir, ro) = next((c, m) for c, m in mounts.items() if m[0].startswith("./var/secrets/triton/"))
    assert ro, "secrets read-only"
    assert (tmp_path / host_dir).resolve() == pool.dirs["triton"].resolve()
    for name in (tls.CA_CERT, tls.SERVER_CERT, tls.SERVER_KEY, tls.CLIENT_KEY_FILE, tls.OPERATOR_KEY_FILE):
        assert (pool.dirs["triton"] / name).is_file() and f"{secrets_dir}/{name}" in entry, name
    for flag in ("--grpc-use-ssl=true", "--grpc-use-ssl-mutual=true", f"--grpc-root-cert={secrets_dir}/ca.pem",
                 f"--grpc-server-cert={secrets_dir}/server.pem", f"--grpc-server-key={secrets_dir}/server.key",
                 *LOCKED_FLAGS, *restricted_flags(argv_secrets.placeholder(0), argv_secrets.placeholder(1))):
        assert flag in entry, flag
    # The n-th key file fills placeholder n (the restricted flags above): the client key, then the operator's.
    assert _secret_files(t) == [f"{secrets_dir}/{tls.CLIENT_KEY_FILE}", f"{secrets_dir}/{tls.OPERATOR_KEY_FILE}"]
    repo = re.search(r"--model-repository=(\S+)", entry)
    assert repo and mounts[repo.group(1)][1], "the model repository is mounted read-only"
    uid = _unset(t["user"]).split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "not root"
    for name in ("sidecar", "catalog"):
        svc = compose["services"][name]
        s = Settings.load(environ=_env(svc)).triton
        assert tls.hardened(s) and s.tls_dir is not None, name
        src, ro = _mounts(svc)[s.tls_dir.as_posix()]
        assert ro and (tmp_path / src).resolve() == pool.dirs["sidecar"].resolve(), (name, src)
        # The folder holds what a client reads: checked as the sidecar checks it at start-up.
        assert tls.client_credentials(s.__class__(tls_dir=tmp_path / src)) is not None


def _secret_files(service: dict[str, Any]) -> list[str]:
    """The --secret-file arguments of a service run through inference.triton.argv_secrets, in order."""
    entry = [str(x) for x in service["entrypoint"]]
    launcher = entry[: entry.index("--")]
    return [a.split("=", 1)[1] for a in launcher if a.startswith("--secret-file=")]


def test_no_key_is_on_a_command_line(compose: dict[str, Any], tmp_path: Path) -> None:
    """`ps` shows every process's arguments to every user of the host: Triton's keys reach tritonserver by
    file, through the project's launcher and its preloaded shim (as `embedcar triton serve` passes them),
    never as text a shell puts on a command line; no service names a key file in its command either."""
    t = compose["services"]["triton"]
    entry = [str(x) for x in t["entrypoint"]]
    assert entry[:3] == ["python3", "-m", "inference.triton.argv_secrets"], entry[:3]
    program = entry[entry.index("--") + 1:]
    assert program[0] == "tritonserver"
    # The launcher module is the repository's, through the bind mount, from the working folder `-m` searches.
    module = Path(t["working_dir"], *entry[2].split(".")).with_suffix(".py")
    mount, (src, _ro) = next((m, v) for m, v in _mounts(t).items() if module.is_relative_to(m))
    assert (ROOT / src / module.relative_to(mount)).resolve() == Path(argv_secrets.__file__).resolve()
    # Every key-bearing flag holds a placeholder, and each placeholder names one of the files.
    keyed = [a for a in program if a.startswith(("--grpc-restricted-protocol=", "--http-restricted-api="))]
    assert len(keyed) == 4
    files = _secret_files(t)
    for arg in keyed:
        value = arg.rsplit("=", 1)[1]
        assert value in {argv_secrets.placeholder(n) for n in range(len(files))}, arg
    # The shim is built where the container's user can write (its home may not exist): an absolute folder.
    assert Path(_env(t)["XDG_CACHE_HOME"]).is_absolute()
    # Nowhere a shell that could expand a file into an argument, nor a key file read into one.
    for name, svc in compose["services"].items():
        words = [str(x) for x in (svc.get("entrypoint") or []) + (svc.get("command") or [])]
        text = " ".join(words)
        assert "$(" not in text and "`" not in text and "cat " not in text, name
        for key_file in (tls.CLIENT_KEY_FILE, tls.OPERATOR_KEY_FILE, "api_keys"):
            assert all(w.startswith("--secret-file=") for w in words if key_file in w), (name, key_file)
    # And the launcher refuses to run where a placeholder has no file: nothing goes out unfilled.
    proc = subprocess.run([sys.executable, "-S", "-m", "inference.triton.argv_secrets", "--", *program],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, env=CLIENT_BESIDE)
    assert proc.returncode == 2 and "only 0 --secret-file given" in proc.stderr, proc.stderr


def test_entrypoint_builds_engine_into_cache_then_serves(compose: dict[str, Any], manifest: Manifest) -> None:
    t = compose["services"]["triton-engine"]
    entry = _entry(t)
    mounts = {v.split(":")[1]: v.split(":")[0] for v in t["volumes"]}
    script = re.search(r"python3 (\S+trt_engine\.py)", entry)
    assert script, entry
    # The script path inside the container maps to this repository's file through a bind mount.
    container_path = Path(script.group(1))
    mount = next(m for m in mounts if container_path.is_relative_to(m))
    assert (ROOT / mounts[mount] / container_path.relative_to(mount)).resolve() == \
        (ROOT / "inference" / "triton" / "trt_engine.py").resolve()
    cache = re.search(r"--cache-dir (\S+)", entry)
    assert cache and cache.group(1) in mounts and mounts[cache.group(1)] in compose["volumes"]
    # Every encoder the repository lists (one per model version, versioned folder names) gets its plan.
    install = re.search(r"--repo (\S+) --models-dir (\S+)", entry)
    assert install, entry
    assert mounts[install.group(2)] == "./models"
    served = compose["services"]["triton"]
    repo = re.search(r"--model-repository=(\S+)", _entry(served))
    assert repo and install.group(1) == repo.group(1)
    assert mounts[repo.group(1)] == _mounts(served)[repo.group(1)][0], "installed into the repository Triton serves"
    # Engine first, then serve: a failed build must not start a server without its engine.
    assert served["depends_on"]["triton-engine"]["condition"] == "service_completed_successfully"


def test_repo_service_writes_the_gpu_repository(compose: dict[str, Any]) -> None:
    r = compose["services"]["triton-repo"]
    cmd = r["command"]
    assert cmd[:3] == ["embedcar", "triton", "repo"]
    assert cmd[cmd.index("--target") + 1] == "gpu"
    out = cmd[cmd.index("--out") + 1]
    vol_of = {v.split(":")[1]: v.split(":")[0] for v in r["volumes"]}
    t_vol = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["triton"]["volumes"]}
    assert vol_of[out] in compose["volumes"]
    repo = re.search(r"--model-repository=(\S+)", _entry(compose["services"]["triton"]))
    assert repo and t_vol[repo.group(1)] == vol_of[out]
    project_root = cmd[cmd.index("--project-root") + 1]
    assert f"{project_root}/inference" in t_vol
    assert t_vol[f"{project_root}/embedcar_client"] == "./client/embedcar_client"  # what inference.errors imports
    # The repository is complete (engine installed) before Triton starts: repo -> engine -> triton.
    assert compose["services"]["triton-engine"]["depends_on"]["triton-repo"]["condition"] == \
        "service_completed_successfully"
    assert compose["services"]["triton"]["depends_on"]["triton-engine"]["condition"] == \
        "service_completed_successfully"


def test_sidecar_points_at_triton(compose: dict[str, Any]) -> None:
    sc = compose["services"]["sidecar"]
    env = _env(sc)
    s = Settings.load(environ=env)  # every variable must parse
    assert s.sidecar.backend == "triton"
    assert s.triton.urls == (f"triton:{DEFAULTS.triton.grpc_port}",)
    assert _ports(sc)[s.sidecar.grpc_port] == ("127.0.0.1", s.sidecar.grpc_port)
    assert _ports(sc)[s.sidecar.http_port] == ("127.0.0.1", s.sidecar.http_port)
    assert s.sidecar.host == "0.0.0.0" and s.sidecar.api_keys_file is not None, "non-loopback needs keys"
    assert sc["depends_on"]["triton"]["condition"] == "service_healthy"
    assert f"127.0.0.1:{s.sidecar.http_port}/health" in " ".join(sc["healthcheck"]["test"])
    assert sc["command"] == ["embedcar", "sidecar", "serve"]
    cat = _env(compose["services"]["catalog"])
    assert Settings.load(environ=cat).catalog.index_root == s.sidecar.index_dir


def test_demo_service(compose: dict[str, Any]) -> None:
    d = compose["services"]["demo"]
    assert d["command"][:2] == ["embedcar", "demo"]
    port = Settings.load(environ=_env(d)).demo.port
    assert _ports(d)[port] == ("127.0.0.1", port)


def test_every_published_port_is_loopback(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        for host, _port in _ports(svc).values():
            assert host == "127.0.0.1", name


def test_a_pool_is_set_by_variables_that_default_to_one_host(compose: dict[str, Any]) -> None:
    # docs/scale.md: Triton hosts publish on EMBEDCAR_PUBLISH_ADDR; search nodes and the job read the
    # pool from EMBEDCAR_TRITON_URLS. Unset, both give the single-host stack checked above.
    # gRPC on the pool's private interface, metrics on the monitoring one.
    published = {str(p).rsplit(":", 1)[1]: str(p) for p in compose["services"]["triton"]["ports"]}
    assert published[str(DEFAULTS.triton.grpc_port)].startswith("${EMBEDCAR_PUBLISH_ADDR:-127.0.0.1}:")
    assert published[str(DEFAULTS.triton.metrics_port)].startswith("${EMBEDCAR_METRICS_ADDR:-127.0.0.1}:")
    for name in ("sidecar", "catalog"):
        raw = compose["services"][name]["environment"]["EMBEDCAR_TRITON_URLS"]
        assert raw.startswith("${EMBEDCAR_TRITON_URLS:-")
        pool = Settings.load(environ={**_env(compose["services"][name]), "EMBEDCAR_TRITON_URLS": "a:8001,b:8001"})
        assert pool.triton.urls == ("a:8001", "b:8001")


def test_bind_mount_sources_are_project_folders(compose: dict[str, Any]) -> None:
    for svc in compose["services"].values():
        for v in svc.get("volumes", []):
            src = _unset(v).split(":")[0]
            if src.startswith("./"):
                assert src.split("/")[1] in {"models", "indexes", "inference", "client", "var"}, src


def test_entrypoint_script_is_stdlib_only() -> None:
    """The NGC image's python3 has no project dependencies: the engine script must run bare."""
    script = ROOT / "inference" / "triton" / "trt_engine.py"
    out = subprocess.run([sys.executable, "-I", "-S", str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--cache-dir" in out.stdout


def _dockerfile_runs() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def test_image_links_no_system_grpc_library() -> None:
    """The sidecar serves gRPC with grpcio's own C core: the image installs no distribution gRPC C++
    library (Debian's is 1.51, with open advisories) and builds nothing against one."""
    runs = _dockerfile_runs()
    assert not any("libgrpc" in r for r in runs)
    assert not any("unavailable_reason" in r or "native_front" in r for r in runs)
    assert any("pip install" in r for r in runs)


def test_image_holds_the_top_level_modules() -> None:
    """embedcar_settings.py and embedcar_docs.py (pyproject's py-modules) reach the image: copied with
    the context, not excluded by .dockerignore."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^COPY \. \.$", text, re.MULTILINE)
    ignored = (ROOT / ".dockerignore").read_text().split()
    for module in ("embedcar_settings.py", "embedcar_docs.py"):
        assert (ROOT / module).is_file() and not any(Path(module).match(p) for p in ignored)
    assert 'py-modules = ["embedcar_settings", "embedcar_docs"]' in (ROOT / "pyproject.toml").read_text()
