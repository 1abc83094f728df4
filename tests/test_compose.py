"""docker-compose.yml, checked without a Docker engine: structure, ports and paths against the settings."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from demo_ui.settings import Settings
from inference.manifest import Manifest
from inference.triton.repository import PLAN_FILE

# PyYAML arrives with uvicorn[standard]; imported untyped so the check holds with or without its stubs.
yaml: Any = importlib.import_module("yaml")
ROOT = Path(__file__).resolve().parent.parent
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
    return " ".join(str(x) for x in service["entrypoint"])


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
        assert _ports(t)[port] == ("127.0.0.1", port)
    assert f"localhost:{s.http_port}/v2/health/ready" in " ".join(t["healthcheck"]["test"])


def test_entrypoint_builds_engine_into_cache_then_serves(compose: dict[str, Any], manifest: Manifest) -> None:
    t = compose["services"]["triton"]
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
    onnx = re.search(r"--onnx (\S+)", entry)
    assert onnx and onnx.group(1).endswith("/" + manifest.variants["fp16"].file)
    assert "${EMBEDCAR_MODEL_NAME}" in onnx.group(1)
    assert _env(t)["EMBEDCAR_MODEL_NAME"] == DEFAULTS.model.name
    install = re.search(r"--install (\S+)", entry)
    assert install and install.group(1).endswith(f"/encoder/1/{PLAN_FILE}")
    repo = re.search(r"--model-repository=(\S+)", entry)
    assert repo and install.group(1).startswith(repo.group(1) + "/")
    assert entry.index("trt_engine.py") < entry.index("exec tritonserver"), "engine first, then serve"
    assert "&&" in entry, "a failed build must not start a server without its engine"


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
    assert compose["services"]["triton"]["depends_on"]["triton-repo"]["condition"] == \
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
    for p in compose["services"]["triton"]["ports"]:
        assert str(p).startswith("${EMBEDCAR_PUBLISH_ADDR:-127.0.0.1}:")
    for name in ("sidecar", "catalog"):
        raw = compose["services"][name]["environment"]["EMBEDCAR_TRITON_URLS"]
        assert raw.startswith("${EMBEDCAR_TRITON_URLS:-")
        pool = Settings.load(environ={**_env(compose["services"][name]), "EMBEDCAR_TRITON_URLS": "a:8001,b:8001"})
        assert pool.triton.urls == ("a:8001", "b:8001")


def test_bind_mount_sources_are_project_folders(compose: dict[str, Any]) -> None:
    for svc in compose["services"].values():
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert src.split("/")[1] in {"models", "indexes", "inference", "var"}, src


def test_entrypoint_script_is_stdlib_only() -> None:
    """The NGC image's python3 has no project dependencies: the engine script must run bare."""
    script = ROOT / "inference" / "triton" / "trt_engine.py"
    out = subprocess.run([sys.executable, "-I", "-S", str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--cache-dir" in out.stdout
