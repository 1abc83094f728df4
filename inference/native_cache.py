"""C++ compiled on first use into a private per-user cache, verified before each first use.

What we build is code we then load or run, so it lives in a private per-user cache folder, never
the working folder ($XDG_CACHE_HOME/embedcar/native, else ~/.cache/embedcar/native): created 0700,
refused when it or a folder above it is not ours (or root's) or others may write to it. A build is
made in a temporary folder and renamed into place whole (parallel runs are safe: the first one wins),
with the SHA-256 of the binary recorded beside it; before its first use in a process the folder, the
binary and the record are checked (owner, mode, digest). Every failure raises Unavailable saying why,
so a caller can fall back. loadtest/native_build.py builds gRPC programs on it; the Triton launcher
its argument shim (inference/triton/argv_secrets.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from inference.errors import Unavailable
from inference.files import sha256_file
from inference.private_paths import owned_file_problem, private_dir_problem

log = logging.getLogger(__name__)

DIGEST_FILE = "SHA256"  # in each build's folder: the binary's digest, written when it was built
NO_COMPILER = "no C++ compiler (Debian: apt-get install g++)"

BUILT: dict[tuple[Path, str], Path] = {}  # (cache folder, build name) -> binary, verified in this process


def default_build_dir() -> Path:
    """The per-user cache folder (XDG base directories; a relative XDG_CACHE_HOME is ignored, as the
    specification says). Read here, like tempfile reads TMPDIR: it is where files go, not a setting."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    try:
        base = Path(xdg) if Path(xdg).is_absolute() else Path.home() / ".cache"
    except RuntimeError:  # no home folder: a per-uid folder in /tmp, checked like any other
        base = Path(tempfile.gettempdir()) / f"embedcar-{os.getuid()}"
    return base / "embedcar" / "native"


def flag_tag(extra_flags: Sequence[str]) -> str:
    """A readable part of a build's name for its extra flags ("-fsanitize=address" → "-fsanitize-address"),
    so a sanitizer build is told apart at a glance; the key digest is what makes names unique."""
    words = (re.sub(r"[^A-Za-z0-9]+", "-", f).strip("-") for f in extra_flags)
    tag = "_".join(w for w in words if w)[:64]
    return f"-{tag}" if tag else ""


def verify(binary: Path) -> Path:
    """`binary` if its folder and it are this user's alone and its digest is the one recorded when it
    was built; else Unavailable saying what is wrong."""
    folder = binary.parent
    record = folder / DIGEST_FILE
    problem = private_dir_problem(folder) or owned_file_problem(binary) or owned_file_problem(record)
    if problem is not None:
        raise Unavailable(f"refusing to use the build {folder}: {problem} (remove it to rebuild)")
    if record.read_text().strip() != sha256_file(binary):
        raise Unavailable(f"refusing to use the build {folder}: {binary.name} does not match the digest recorded "
                          "when it was built (remove the folder to rebuild it)")
    return binary


def build_cached(source: Path, name: str, *, root: Path, flags: Sequence[str], libs: Sequence[str],
                 filename: str, tag: str = "", hint: str = NO_COMPILER) -> Path:
    """`source` compiled with `flags` and linked with `libs` into `root`/<name><tag>-<key>/`filename`, once
    per source and flags, verified. Unavailable (with `hint` where the compiler fails) on any failure."""
    try:
        return _build(source, name, root, [*flags], [*libs], filename, tag, hint)
    except OSError as exc:  # a folder or file we could not make or read: say which
        where = f" ({exc.filename})" if exc.filename else ""
        raise Unavailable(f"cannot build {name}: {exc.strerror or exc}{where}") from exc


def _build(source: Path, name: str, root: Path, flags: list[str], libs: list[str], filename: str, tag: str,
           hint: str) -> Path:
    key = hashlib.sha256(source.read_bytes() + "\0".join(flags).encode()).hexdigest()[:12]
    if (problem := private_dir_problem(root)) is not None:
        raise Unavailable(f"cannot build {name} in {root}: {problem}")
    root = root.absolute()
    folder = root / f"{name}{tag}-{key}"
    if (root, folder.name) in BUILT:
        return BUILT[root, folder.name]
    if not os.path.lexists(folder):
        _compile(source, name, flags, libs, folder, filename, hint)
    BUILT[root, folder.name] = verify(folder / filename)
    return BUILT[root, folder.name]


def _compile(source: Path, name: str, flags: list[str], libs: list[str], folder: Path, filename: str,
             hint: str) -> None:
    """Compile into a fresh private folder, record the digest, rename the folder into place (the first
    of parallel builders wins; the others drop theirs)."""
    # clang++ too: the Triton image (docker-compose.yml builds argv_secrets' shim in it) installs clang.
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise Unavailable(f"cannot build {name}: no C++ compiler; {hint}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))  # 0700
    try:
        log.info("building %s (%s)", name, folder / filename)
        proc = subprocess.run([cxx, *flags, "-o", str(tmp / filename), str(source), *libs],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = " ".join(proc.stderr.strip().splitlines()[-3:])[:400]
            raise Unavailable(f"cannot build {name} ({tail}); {hint}")
        (tmp / filename).chmod(0o700)
        (tmp / DIGEST_FILE).write_text(sha256_file(tmp / filename) + "\n")
        try:
            tmp.rename(folder)
        except OSError:
            if not os.path.lexists(folder):
                raise  # not a parallel builder's finished folder: a real failure
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
