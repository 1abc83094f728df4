"""C++ built against gRPC's C++ library on first use: the load generator's sender and compiled
servers (loadtest/native), the sidecar's compiled gRPC front (sidecar/native).

Debian's `libgrpc++-dev` and g++ (`make test` installs them when it can), and Python's headers for
an extension module. Each build is keyed by its source and flags, written atomically (parallel runs
are safe), and reused; what cannot build raises Unavailable saying what it needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

from inference.errors import Unavailable

log = logging.getLogger(__name__)

BUILD_DIR = Path("var/native")
CXX_FLAGS = ("-O2", "-std=c++17", "-Wall", "-Wextra")
# Without pkg-config's answer (Debian's grpc++.pc wants protobuf's, absent without libprotobuf-dev).
FALLBACK_LIBS = ("-lgrpc++", "-lgrpc", "-lgpr", "-labsl_synchronization", "-lpthread")
INSTALL_HINT = "it needs g++ and gRPC's C++ library (Debian: apt-get install libgrpc++-dev)"

_built: dict[tuple[Path, str], Path] = {}


def _libs() -> list[str]:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["pkg-config", "--libs", "grpc++"], capture_output=True, text=True, check=True)
        return [*out.stdout.split(), "-lpthread"]
    return list(FALLBACK_LIBS)


def build_native(source: Path, name: str, *, module: bool = False, build_dir: Path | None = None) -> Path:
    """`source` compiled against gRPC's C++ library, once per source version: an executable `name`,
    or with `module` a Python extension module `name` (its file, in a folder of its own to import from)."""
    build_dir = BUILD_DIR if build_dir is None else build_dir
    key = (build_dir.resolve(), name)
    if key in _built and _built[key].exists():
        return _built[key]
    flags = [*CXX_FLAGS]
    if module:
        include = sysconfig.get_paths()["include"]
        if not (Path(include) / "Python.h").exists():
            raise Unavailable(f"cannot build {name}: no Python.h in {include} (Debian: apt-get install python3-dev)")
        flags += ["-shared", "-fPIC", f"-I{include}"]
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    if module:
        out = build_dir / f"{name}-{digest}" / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    else:
        out = build_dir / f"{name}-{digest}"
    if not out.exists():
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            raise Unavailable(f"cannot build {name}: no C++ compiler; {INSTALL_HINT}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
        log.info("building %s (%s)", name, out)
        proc = subprocess.run([cxx, *flags, "-o", str(tmp), str(source), *_libs()], capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            tail = " ".join(proc.stderr.strip().splitlines()[-3:])[:400]
            raise Unavailable(f"cannot build {name} ({tail}); {INSTALL_HINT}")
        tmp.replace(out)
    _built[key] = out
    return out


def load_module(source: Path, name: str, *, build_dir: Path | None = None) -> object:
    """The extension module `name` built from `source` (see build_native), imported."""
    import importlib.util

    path = build_native(source, name, module=True, build_dir=build_dir)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise Unavailable(f"cannot load {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
