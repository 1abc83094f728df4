"""A do-nothing Embedder server: the floor any Python gRPC sidecar pays on this host.

It answers every Embed call with one fixed reply of the real shape (one float32 vector of the
model's width, as a cache hit returns it) without parsing the request: no auth, cache, metrics or
timing. `embedcar bench sidecar --floor` times it with the sidecar's own client, in alternating
blocks with real cache hits, so the difference is the sidecar's own work and the rest is Python
gRPC plus the loopback hop. Run as `python -m loadtest.bench.floor --port N [--dim 384]`, or
`floor_process` from code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import numpy as np

from embedcar_client.client import Client
from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_client.wire import SERVICE
from inference.errors import EmbedcarError
from inference.lifecycle import terminate
from inference.ports import free_port


def fixed_reply(dim: int) -> bytes:
    vec = np.full((1, dim), 1.0 / np.sqrt(dim), dtype="<f4")
    return pb.EmbedReply(embeddings=vec.tobytes(), rows=1, dim=dim, dtype=pb.FLOAT32, model="floor",
                         cache_hits=[True], truncated=[False], timings=pb.Timings()).SerializeToString()


async def serve(port: int, dim: int) -> None:
    reply = fixed_reply(dim)

    async def embed(_raw: bytes, _context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return reply

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Embed": grpc.unary_unary_rpc_method_handler(embed)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")  # loopback only, like the sidecar's default
    await server.start()
    await server.wait_for_termination()


@contextlib.contextmanager
def floor_process(dim: int) -> Iterator[str]:
    """The floor server in a child process; yields its target once it answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.bench.floor", "--port", str(port), "--dim", str(dim)])
    target = f"127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        with Client(target) as c:
            while True:
                try:
                    c.embed(["ping"], timeout_s=1.0)
                    break
                except EmbedcarError:
                    if proc.poll() is not None or time.monotonic() > end:
                        raise
                    time.sleep(0.1)
        yield target
    finally:
        terminate(proc, 30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dim", type=int, default=384)
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.dim))


if __name__ == "__main__":
    main()
