"""C++ built against gRPC's C++ library on first use: the load generator's sender and the transport
bench's echo servers (loadtest/native). Benchmark tools only: nothing the sidecar serves with links it.

Debian's `libgrpc++-dev` and g++ (`make test` installs them when it can), and Python's headers for
an extension module. Each build is keyed by its source and flags, kept in the private per-user cache
of inference/native_cache.py (never the working folder: whoever can write there could give us code
to load) and verified before its first use; what cannot build, or fails a check, raises Unavailable
saying why, so the tool can say what it needs.
"""

from __future__ import annotations

import contextlib
import subprocess
import sysconfig
from pathlib import Path

from inference import native_cache
from inference.errors import Unavailable

CXX_FLAGS = ("-O2", "-std=c++17", "-Wall", "-Wextra")
# Without pkg-config's answer (Debian's grpc++.pc wants protobuf's, absent without libprotobuf-dev).
FALLBACK_LIBS = ("-lgrpc++", "-lgrpc", "-lgpr", "-labsl_synchronization", "-lpthread")
INSTALL_HINT = "it needs g++ and gRPC's C++ library (Debian: apt-get install libgrpc++-dev)"

BUILD_DIR = native_cache.default_build_dir()


def _libs() -> list[str]:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["pkg-config", "--libs", "grpc++"], capture_output=True, text=True, check=True)
        return [*out.stdout.split(), "-lpthread"]
    return list(FALLBACK_LIBS)


def build_native(source: Path, name: str, *, module: bool = False, build_dir: Path | None = None,
                 extra_flags: tuple[str, ...] = ()) -> Path:
    """`source` compiled against gRPC's C++ library, once per source version and flags, and verified: an
    executable `name`, or with `module` a Python extension module `name` (its file, in a folder of its own
    to import from). `extra_flags` (e.g. a sanitizer's) go after ours, into the key and the folder's name."""
    flags = [*CXX_FLAGS]
    if module:
        include = sysconfig.get_paths()["include"]
        if not (Path(include) / "Python.h").exists():
            raise Unavailable(f"cannot build {name}: no Python.h in {include} (Debian: apt-get install python3-dev)")
        flags += ["-shared", "-fPIC", f"-I{include}"]
    filename = f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}" if module else name
    return native_cache.build_cached(source, name, root=BUILD_DIR if build_dir is None else build_dir,
                                     flags=[*flags, *extra_flags], libs=_libs(), filename=filename,
                                     tag=native_cache.flag_tag(extra_flags), hint=INSTALL_HINT)


def load_module(source: Path, name: str, *, build_dir: Path | None = None,
                extra_flags: tuple[str, ...] = ()) -> object:
    """The extension module `name` built from `source` (see build_native), verified and imported."""
    import importlib.util

    path = build_native(source, name, module=True, build_dir=build_dir, extra_flags=extra_flags)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise Unavailable(f"cannot load {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:  # e.g. a library it links against is missing at run time
        raise Unavailable(f"cannot load {name} from {path}: {exc}") from exc
    return module
