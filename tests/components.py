"""What a test needs that may be missing here, and whether its absence is a skip or a failure.

`make test` builds the venv (Python packages, among them the nvidia-pytriton wheel whose tritonserver
the Triton tests run, ray and playwright), prepares the bundled model with every variant, and tries
to install Chromium and gRPC's C++ library (best effort: it prints what it could not install). A
component that make installed must not be missing: a skip there would hide a broken install, a
broken export or a broken build, so `require` fails the test instead. It skips only for what cannot
exist here, and says why: a GPU, a platform the tritonserver wheel does not support, a system package
`make` could not install, or a Python package in a venv that `make install` did not build.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from inference.manifest import Manifest

# What `make native` installs (the Makefile tests this very file) and what the build needs besides.
GRPCPP_HEADER = Path("/usr/include/grpcpp/generic/generic_stub.h")


def make_installed() -> bool:
    """This interpreter is the venv `make install` built: its stamp file (Makefile STAMP) is there,
    written only after every Python package, the nvidia-pytriton wheel included, installed."""
    return (Path(sys.prefix) / ".installed").is_file()


def _missing(what: str, reason: str, *, installed_by_make: bool) -> None:
    if installed_by_make:
        pytest.fail(f"{what}: {reason} (`make test` installs it: a skip here would hide a failure)")
    pytest.skip(reason, allow_module_level=True)


def triton_platform() -> str | None:
    """None where the wheel's tritonserver is built to run (Linux x86_64, glibc >= 2.35); else why not."""
    from inference.triton.launcher import platform_unsupported

    return platform_unsupported()


def require_triton() -> None:
    """The wheel's tritonserver runs here; a failure where make installed it on a platform it supports."""
    from inference.triton.launcher import triton_unavailable_reason

    reason = triton_unavailable_reason()
    if reason is None:
        return
    _missing("tritonserver", reason, installed_by_make=make_installed() and triton_platform() is None)


def require_native() -> None:
    """The compiled load generator builds. `make native` is best effort: without gRPC's C++ headers
    or a compiler it skips; with both present, a build that fails is a failure (a compile error)."""
    from loadtest.native import native_unavailable_reason

    reason = native_unavailable_reason()
    if reason is None:
        return
    toolchain = GRPCPP_HEADER.exists() and (shutil.which("g++") or shutil.which("c++")) is not None
    _missing("the native load generator", reason, installed_by_make=toolchain)


def native_available() -> bool:
    """For tests that add the native rows where they can: True, False, or a failure as `require_native`."""
    try:
        require_native()
    except pytest.skip.Exception:
        return False
    return True


def require_package(module: str) -> None:
    """A Python package of the project's extras ([export,dev,ray]), which `make install` installs."""
    try:
        __import__(module)
    except ImportError as exc:
        _missing(f"the {module} package", f"{module} is not installed ({exc}): pip install -c constraints.txt "
                 "-e '.[export,dev,ray]'", installed_by_make=make_installed())


def require_variant(manifest: Manifest, variant: str) -> None:
    """The bundled model's variant exists: `make model` exports and checks fp32, fp16 and int8, so one
    missing from the manifest is a refused export (its figures are in the manifest), a failure."""
    if variant not in manifest.variants:
        figures = manifest.refused.get(variant)
        why = f"refused at export, its check figures {figures}" if figures is not None else "not in the manifest"
        pytest.fail(f"the {variant} variant of {manifest.name}: {why} (`make model` exports it)")
