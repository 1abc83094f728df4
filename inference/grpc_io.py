"""Which of gRPC C core's I/O paths our processes use: the polling thread's own, not the EventEngine's.

gRPC's EventEngine experiments (on by default in the grpcio we pin, 1.85) read and write sockets on an
EventEngine thread pool that then hands each event to the completion queue, where Python's poller
thread (grpc.aio) or the sync server's thread waits: one more thread woken per event. At a search
node's pace (a call every few ms, the threads asleep in between) every wake-up is paid with cold
caches; with these experiments off the thread polling the completion queue reads the socket
itself. A do-nothing grpc.aio server paced at 100 calls/s from a compiled client spent 0.74-0.98
ms of CPU per call with them and 0.63-0.86 without (grpcio 1.85, 2 vCPUs; docs/benchmarks.md has
the sidecar's figures, `embedcar bench neighbour --configs default,event-engine`).

gRPC reads GRPC_EXPERIMENTS once, when `grpc` is first imported, so `prefer_polling_io` must run
before that: the `embedcar` command calls it first thing. An operator's own GRPC_EXPERIMENTS (even
empty: gRPC's defaults) is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

EXPERIMENTS = "GRPC_EXPERIMENTS"
POLLING_IO = ",".join(f"-{name}" for name in (
    "event_engine_listener",  # accepting connections
    "event_engine_for_all_other_endpoints",  # the server's reads and writes
    "event_engine_client",  # the Triton client's
    "event_engine_callback_cq",
))


def prefer_polling_io(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Turn the EventEngine I/O experiments off unless GRPC_EXPERIMENTS is set; False if `grpc` was
    imported already (too late to matter) or the environment says otherwise."""
    if "grpc" in sys.modules or EXPERIMENTS in environ:
        return False
    environ[EXPERIMENTS] = POLLING_IO
    return True


def for_other_grpc(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a program on another gRPC build (tritonserver, the compiled load generator): without
    our choice, whose experiment names its version may not know (it logs an error for each); an
    operator's own GRPC_EXPERIMENTS passes on."""
    out = dict(env)
    if out.get(EXPERIMENTS) == POLLING_IO:
        del out[EXPERIMENTS]
    return out
