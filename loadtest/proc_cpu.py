"""CPU time of the servers a load test started, from /proc: what each spent per request.

On a machine the model nearly fills, a server's latency under load depends on how much CPU every
process beside it takes; this puts a figure on each (tritonserver counted with its Python-backend
stubs, which are its child processes).
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                todo += [int(c) for c in (t / "children").read_text().split()]
            except OSError:
                continue
    return out


def cpu_s(pid: int) -> float:
    """User + system seconds of `pid` and its live descendants (0 for what has exited)."""
    total = 0
    for p in tree(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces; fields after it are fixed
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total * _TICK_S


class CpuMeter:
    """`start()`, run the load, `stop()` -> {name: CPU seconds over that span} for the named pids."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self._start: dict[str, float] = {}

    def start(self) -> None:
        self._start = {name: cpu_s(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        return {name: cpu_s(pid) - self._start.get(name, 0.0) for name, pid in self.pids.items()}
