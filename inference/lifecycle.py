"""Process lifecycle helpers shared by the long-running commands (triton serve, demo)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C while blocking, so the same cleanup path runs for both."""

    def raise_interrupt(_sig: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def terminate(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float) -> None:
    """SIGTERM (a graceful drain), then SIGKILL if it has not exited within `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
