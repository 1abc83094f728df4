"""The sidecar's threads ask the kernel for a short CPU slice: woken beside a busy search engine, they
run at once instead of waiting for its thread's slice to end.

Linux's EEVDF scheduler (6.6+) gives each runnable thread a virtual deadline of its slice ahead; a
thread that wakes with an earlier deadline than the running one preempts it. Since 6.12 a thread may
ask for its own slice (`sched_setattr`, `sched_runtime` of SCHED_OTHER, 0.1-100 ms; unprivileged),
and threads and processes created afterwards inherit it. The sidecar sleeps between queries and
needs ~5 ms of CPU for one; the search engine's threads run for whole slices (1.4 ms on the 2-vCPU
reference host). With a 0.1 ms slice the sidecar's request runs when it arrives; it uses no more CPU
(the neighbour gets the same share, in shorter turns). Measured beside the one-core search-engine
stand-in of `embedcar bench neighbour` (docs/benchmarks.md).

Applied once at `embedcar sidecar serve` start to every thread the process has, before the model and
gRPC start theirs. Where the kernel keeps no custom slice (older than 6.12, not Linux, another
architecture) nothing changes and the log says why; a thread under a real-time or idle policy is left
as it is. Python's `os` has no `sched_setattr`, hence ctypes.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

SCHED_OTHER, SCHED_BATCH = 0, 3
MIN_US, MAX_US = 100, 100_000  # what the kernel accepts for a fair thread's slice
# The sidecar's slice: the shortest, so a query preempts the neighbour's thread; beside a busy one it
# cut refusals and P95 at no extra CPU (docs/benchmarks.md, the levers' "0.1 ms CPU slice" row).
SIDECAR_SLICE_US = MIN_US
# (sched_setattr, sched_getattr) by machine: the generic numbers (arm64, riscv) and x86_64's own.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275), "arm64": (274, 275), "riscv64": (274, 275)}


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64), ("sched_util_min", ctypes.c_uint32),
                ("sched_util_max", ctypes.c_uint32)]


def _calls() -> tuple[ctypes.CDLL, int, int] | None:
    numbers = _SYSCALLS.get(platform.machine())
    if not sys.platform.startswith("linux") or numbers is None:
        return None
    return ctypes.CDLL(None, use_errno=True), *numbers


def get_slice_ns(tid: int = 0) -> int | None:
    """The thread's slice as the kernel reports it (0 on kernels without custom slices), None if unknown."""
    calls = _calls()
    if calls is None:
        return None
    libc, _set, get = calls
    attr = _SchedAttr()
    if libc.syscall(get, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return None
    return int(attr.sched_runtime)


def set_slice(us: int, *, tids: list[int] | None = None) -> str:
    """Ask for a `us` µs slice on `tids` (default: every thread of this process). Returns what happened,
    for the log; never raises (a slice is a preference, not a requirement)."""
    calls = _calls()
    if calls is None:
        return f"not set: no sched_setattr here ({sys.platform}, {platform.machine()})"
    libc, set_call, get_call = calls
    want = min(max(us, MIN_US), MAX_US) * 1000
    if tids is None:
        tasks = Path("/proc/self/task")
        tids = sorted(int(t.name) for t in tasks.iterdir()) if tasks.is_dir() else [0]
    done = 0
    for tid in tids:
        attr = _SchedAttr()
        if libc.syscall(get_call, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
            continue  # the thread ended meanwhile
        if attr.sched_policy not in (SCHED_OTHER, SCHED_BATCH):
            continue  # an operator's real-time or idle policy stays
        attr.size, attr.sched_flags, attr.sched_runtime = ctypes.sizeof(attr), 0, want  # nice and policy kept
        if libc.syscall(set_call, tid, ctypes.byref(attr), 0) == 0:
            done += 1
    if not done:
        return f"not set: sched_setattr refused ({os.strerror(ctypes.get_errno())})"
    if get_slice_ns() != want:  # this thread's, one of them
        return f"not set: this kernel ({platform.release()}) keeps no custom slice (Linux 6.12+ does)"
    return f"{want / 1e6:g} ms on {done} thread(s) and the threads they start"
