"""An exclusive lock per input: one lock file, held with fcntl for the duration of a block."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from inference.errors import Unavailable


@contextlib.contextmanager
def exclusive(lock_path: Path, *, wait: bool = False) -> Iterator[None]:
    """Hold `lock_path` (waiting for it with `wait`, else Unavailable when another process has it).

    The kernel drops the lock when its holder dies, so a SIGKILLed build never leaves it stuck."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise Unavailable(f"another build of the same input is running (lock {lock_path})") from exc
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
