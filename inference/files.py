"""Crash-safe file writes and checksums, shared by every package that persists something."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write through `write` into a temp file in the same folder, fsync, rename over `path`.

    Readers see the old file or the new one, never half of one; a crash leaves no partial file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide models/reports from other users
            os.fsync(f.fileno())
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
