"""The compiled gRPC front's own tests again, against a build with AddressSanitizer and UBSan.

The front is native code on the request path: its stream, cancel and concurrency tests (and the hostile
gRPC clients' attacks that run in-process) run in a child pytest whose Python has libasan preloaded and
whose front is built with `-fsanitize=address,undefined` (sidecar.native_front.SANITIZE_FLAGS). Any
sanitizer report fails the child (UBSan does not recover; ASan aborts on its first error). Leak checking
is off: CPython and the libraries it loads keep memory to the end by design. Skipped, saying why, where
g++ has no sanitizer runtimes or the front cannot build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar import native_front
from tests.conftest import ROOT, SANITIZE_ENV

# The front's tests: unary, Stream, cancellation, races between threads, keys, deadlines, read-ahead.
FRONT_TESTS = ("tests/test_sidecar_grpc_server.py", "tests/test_sidecar_native_front.py")
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")


def _runtime(name: str) -> Path | None:
    try:
        out = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(out.stdout.strip())
    return path if path.is_absolute() and path.exists() else None


def test_the_fronts_tests_pass_under_address_and_undefined_behaviour_sanitizers() -> None:
    asan = _runtime("libasan.so")
    if asan is None:
        pytest.skip("g++ has no AddressSanitizer runtime here (libasan.so): the sanitizer run cannot build")
    native_front.BUILD_FLAGS, saved = native_front.SANITIZE_FLAGS, native_front.BUILD_FLAGS
    try:
        reason = native_front.unavailable_reason()  # builds it here, where a failure can say why
    finally:
        native_front.BUILD_FLAGS = saved
    if reason is not None:
        pytest.skip(f"the sanitizer build of the front does not build here: {reason}")
    env = {**os.environ, SANITIZE_ENV: "1", "LD_PRELOAD": str(asan),
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_stack_use_after_return=0",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *FRONT_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    reports = [line for line in output.splitlines() if any(r in line for r in REPORTS)]
    assert reports == [], "\n".join(reports[:20]) + "\n" + output[-4000:]
    assert proc.returncode == 0, output[-4000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.split("\n")[-2], proc.stdout[-2000:]
