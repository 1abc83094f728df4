"""embedcar-client (client/) is a distribution of its own: pip installs it alone into an empty venv,
which then holds grpcio, protobuf and numpy besides it and no server package, and its Client calls a
running sidecar from there.

The venv is made with `python -m venv` (no access to this one's packages) and the client installed
from a copy of client/ (the build writes into its source folder), its dependencies from the package
index at constraints.txt's versions. Where no venv can be made or the index cannot be reached, the
test skips and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embedcar_client.client import Client
from sidecar.app import Sidecar

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# What the venv may hold: the client, its three dependencies (typing_extensions is grpcio's) and what
# `python -m venv` puts there itself.
ALLOWED = {"embedcar-client", "grpcio", "protobuf", "numpy", "typing-extensions", "pip", "setuptools"}
# The server's packages and its model, index and web stack: none may be importable next to the client.
ABSENT = ("onnxruntime", "faiss", "fastapi", "tokenizers", "tantivy", "inference", "sidecar", "catalog",
          "demo_ui", "loadtest", "embedcar_settings")
# pip's words for an index it cannot reach (or that lacks a dependency): the environment, not the client.
OFFLINE = ("No matching distribution found", "Could not find a version", "NewConnectionError",
           "Failed to establish a new connection", "Temporary failure in name resolution", "Network is unreachable",
           "ConnectTimeout", "ReadTimeout", "ProxyError")

SCRIPT = """
import importlib.metadata, importlib.util, json, sys
import embedcar_client
from embedcar_client.client import Client
from embedcar_client.errors import InvalidInput

absent = json.loads(sys.argv[2])
with Client(sys.argv[1]) as c:
    r = c.embed(["milk"])
    try:
        c.search("milk", mode="fuzzy")
        refused = ""
    except InvalidInput as e:
        refused = e.code
print(json.dumps({
    "file": embedcar_client.__file__,
    "dists": sorted(d.metadata["Name"].lower().replace("_", "-") for d in importlib.metadata.distributions()),
    "importable": [m for m in absent if importlib.util.find_spec(m) is not None],
    "shape": list(r.embeddings.shape), "dtype": str(r.embeddings.dtype), "vector": r.embeddings[0].tolist(),
    "model": r.model, "refused": refused,
}))
"""


def _run(cmd: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding embedcar-client installed from a copy of client/, and nothing of the server."""
    tmp = tmp_path_factory.mktemp("client-package")
    source = tmp / "client"
    shutil.copytree(ROOT / "client", source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], tmp, 120)
    if made.returncode != 0:
        pytest.skip(f"cannot make a venv here (python -m venv: {made.stderr.strip()[-300:]})")
    installed = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                      "-c", str(ROOT / "constraints.txt"), str(source)], tmp, 300)
    if installed.returncode != 0:
        out = installed.stdout + installed.stderr
        offline = [line.strip() for line in out.splitlines() if any(word in line for word in OFFLINE)]
        if offline:
            pytest.skip(f"the package index is out of reach, so the client's dependencies cannot be installed: "
                        f"{offline[-1][:300]}")
        pytest.fail(f"pip install ./client failed:\n{out[-3000:]}")
    return venv


def test_the_client_installed_alone_calls_a_sidecar(client_venv: Path, sidecar_embedded: Sidecar,
                                                     sidecar_client: Client, tmp_path: Path) -> None:
    script = tmp_path / "call.py"
    script.write_text(SCRIPT)
    # -I: neither this checkout (the script's folder, the working directory) nor PYTHON* variables on its path
    done = _run([str(client_venv / "bin" / "python"), "-I", str(script), sidecar_embedded.grpc_target,
                 json.dumps(ABSENT)], tmp_path, 120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert Path(seen["file"]).is_relative_to(client_venv), seen["file"]  # the installed copy, not the checkout
    assert set(seen["dists"]) <= ALLOWED, seen["dists"]
    assert {"embedcar-client", "grpcio", "protobuf", "numpy"} <= set(seen["dists"])
    assert seen["importable"] == []
    reference = sidecar_client.embed(["milk"])
    assert seen["shape"] == [1, reference.embeddings.shape[1]] and seen["dtype"] == "float32"
    assert seen["model"] == reference.model
    np.testing.assert_allclose(np.array(seen["vector"], dtype=np.float32), reference.embeddings[0], atol=1e-6)
    assert seen["refused"] == "invalid_argument"  # the error types and their code table came along
