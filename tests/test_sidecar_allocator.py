"""sidecar/allocator.py: `sidecar serve` starts itself again with mimalloc preloaded (sidecar.allocator).
Each check runs in a child interpreter, since `use` replaces the program it runs in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inference.errors import InvalidInput
from sidecar.allocator import library
from tests.conftest import ROOT

CHILD = textwrap.dedent("""
    import json, os, subprocess, sys
    from sidecar.allocator import library, loaded, use
    said = use(sys.argv[1])
    lib = library(sys.argv[1])
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('LD_PRELOAD', '-'))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    print(json.dumps({"said": said, "pid": os.getpid(), "loaded": lib is not None and loaded(lib),
                      "own": os.environ.get("LD_PRELOAD", "-"), "child": child,
                      "marks": [k for k in os.environ if k.startswith(("EMBEDCAR_ALLOCATOR", "MIMALLOC_"))]}))
""")
MIMALLOC = library("auto")
needs_mimalloc = pytest.mark.skipif(MIMALLOC is None, reason="mimalloc is not installed here (`make allocator`)")


def _run(choice: str, preload: str | None = None, **extra: str) -> tuple[int, dict[str, object], str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("MIMALLOC_")} | extra
    if preload is not None:
        env["LD_PRELOAD"] = preload
    proc = subprocess.Popen([sys.executable, "-c", CHILD, choice], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return proc.pid, json.loads(out.strip().splitlines()[-1]), err


@needs_mimalloc
def test_auto_starts_the_program_again_with_mimalloc_and_its_children_get_the_environment_it_was_given() -> None:
    pid, got, _ = _run("auto")
    assert got["loaded"] is True
    assert got["said"] == MIMALLOC
    assert got["pid"] == pid  # the same process: a supervisor's signals still reach it
    assert got["own"] == got["child"] == "-"  # nothing left for what it starts
    assert got["marks"] == []


@needs_mimalloc
def test_an_operators_own_preload_and_mimalloc_options_stay_for_it_and_for_its_children() -> None:
    libm = next((p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6",
                             "/lib64/libm.so.6") if Path(p).is_file()), None)
    if libm is None:
        pytest.skip("no libm.so.6 at a known path to preload")
    _pid, got, _ = _run("auto", preload=libm, MIMALLOC_ALLOW_DECOMMIT="1")
    assert got["loaded"] is True
    assert got["own"] == got["child"] == libm
    assert got["marks"] == ["MIMALLOC_ALLOW_DECOMMIT"]  # the operator's, not removed with the sidecar's own


def test_system_keeps_the_c_librarys_malloc_without_starting_again() -> None:
    pid, got, _ = _run("system")
    assert got["said"] == "the C library's malloc"
    assert got["loaded"] is False and got["pid"] == pid and got["child"] == "-"


def test_a_library_the_loader_refuses_is_tried_once_and_said(tmp_path: Path) -> None:
    bogus = tmp_path / "libnotmalloc.so"
    bogus.write_text("not a shared object\n")
    _pid, got, err = _run(str(bogus))
    assert got["loaded"] is False
    assert "could not be preloaded" in str(got["said"])
    assert "libnotmalloc.so" in err  # the loader's own message
    assert got["own"] == got["child"] == "-"


def test_a_path_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=r"sidecar\.allocator: .* is not a file"):
        library(str(tmp_path / "missing.so"))
    assert library("system") is None
