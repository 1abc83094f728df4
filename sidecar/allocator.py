"""The sidecar's memory allocator: mimalloc in place of the C library's malloc where it is installed.

Per query the sidecar allocates and frees hundreds of small blocks (the tokenizer's strings and
vectors, gRPC's and protobuf's buffers) on whichever gRPC thread took the call, with the caches cold
from the model's pass beside it: glibc's malloc is a third of the tokenizer's time there
(`perf`, docs/benchmarks.md). mimalloc costs 0.07 ms less CPU per Triton-backend query on the
2-vCPU reference host (same run, alternating); jemalloc 0.045. On the embedded backend, where ONNX
Runtime's pass is most of the CPU, it is neutral.

A malloc is replaced only by a library loaded before the program starts (LD_PRELOAD), so `embedcar
sidecar serve` (and `embedcar demo`, whose sidecar runs in its process) starts itself again with it,
once, as its first step (the same pid: a supervisor's signals still reach it). What it starts
afterwards (a compiler for the gRPC front, the demo's tritonserver) gets the environment it was given,
without the library.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import sys
from pathlib import Path

from inference.errors import InvalidInput

PRELOAD = "LD_PRELOAD"
# Set in the started-again process: the LD_PRELOAD it was given and the names added beside it (restored
# once it runs), and proof it was started again (never twice, even when the loader refused the library).
GIVEN = "EMBEDCAR_ALLOCATOR_GIVEN"
# mimalloc keeps the memory it has (an operator's own setting wins): by default it gives freed pages back
# and the next query faults them in again (1-1.5 page faults a query against glibc's 0.3-0.5, no gain on
# the embedded backend; with these, as many as glibc's). 2.0's name, then 2.1's and 3's.
MIMALLOC_KEEPS = {"MIMALLOC_ALLOW_DECOMMIT": "0", "MIMALLOC_PURGE_DELAY": "-1"}


def library(choice: str) -> str | None:
    """What `sidecar.allocator` asks for: a library to preload, or None for the C library's malloc."""
    if choice == "system":
        return None
    if choice == "auto":
        return ctypes.util.find_library("mimalloc") if sys.platform.startswith("linux") else None
    if not Path(choice).is_file():
        raise InvalidInput(f"sidecar.allocator: {choice} is not a file (expected auto, system or a "
                           "malloc library's path, e.g. /usr/lib/x86_64-linux-gnu/libjemalloc.so.2)")
    return str(Path(choice).resolve())


def loaded(lib: str) -> bool:
    """Whether `lib` (a path, or a name such as libmimalloc.so.2, which the loader finds as the file
    libmimalloc.so.2.0) is mapped into this process."""
    stem = Path(lib).name.partition(".so")[0] + ".so"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return any(Path(line.split(maxsplit=5)[-1]).name.startswith(stem) for line in maps.splitlines() if "/" in line)


def use(choice: str) -> str:
    """Start this program again with the allocator preloaded where it is not yet (does not return then);
    else what it runs with, for the log. Raises InvalidInput for a path that is not a file."""
    lib = library(choice)
    given = os.environ.pop(GIVEN, None)
    if given is not None:  # started again: children get the environment this process was given
        was = json.loads(given)
        for name in was["added"]:
            os.environ.pop(name, None)
        if was["preload"]:
            os.environ[PRELOAD] = was["preload"]
        else:
            os.environ.pop(PRELOAD, None)
    if lib is None:
        return "the C library's malloc" + (" (no mimalloc installed)" if choice == "auto" else "")
    if loaded(lib):
        return Path(lib).name
    if given is not None:
        return f"the C library's malloc ({lib} could not be preloaded: the loader's message is above)"
    current = os.environ.get(PRELOAD, "")
    added = {k: v for k, v in (MIMALLOC_KEEPS if choice == "auto" else {}).items() if k not in os.environ}
    env = dict(os.environ) | added | {PRELOAD: f"{lib}:{current}" if current else lib,
                                      GIVEN: json.dumps({"preload": current, "added": sorted(added)})}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("unreachable")  # execve returns only by raising
