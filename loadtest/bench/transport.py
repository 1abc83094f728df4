"""`embedcar bench transport`: what one round trip costs in each way a client can reach the sidecar.

Not the sidecar: an echo server (a child process, like the sidecar) answering a 60-byte request
with 1,600 bytes (a 384-d float32 embedding and its envelope) over
  tcp      raw asyncio TCP: the kernel and Python's event loop, the least any transport costs
  unary    a grpc.aio unary call per request (what Embed and Search are)
  stream   a message each way on one open grpc.aio bidi call (what Stream is)
The client is grpc.aio / asyncio in this process. Calls go one at a time with a gap between them
(--gap-ms, as at ~100 requests/s), in alternating blocks per transport so each sees the same
machine; P50/P95 and the client's CPU per call are over all blocks. The difference between the
unary and stream rows is what `AsyncClient(stream=True)` saves a caller per request.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import resource
import time
from typing import Any

import numpy as np

TRANSPORTS = ("tcp", "unary", "stream")
REQUEST = b"q" * 60
REPLY = b"x" * 1600


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _serve(ports: Any) -> None:
    import grpc

    async def unary(req: bytes, ctx: Any) -> bytes:
        return REPLY

    async def stream(requests: Any, ctx: Any) -> Any:
        async for _ in requests:
            yield REPLY

    async def tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(len(REQUEST)):
            writer.write(REPLY)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)}),))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    raw = await asyncio.start_server(tcp, "127.0.0.1", 0)
    ports.put((grpc_port, raw.sockets[0].getsockname()[1]))
    await asyncio.Event().wait()  # until the bench terminates this process


def _server_main(ports: Any) -> None:
    asyncio.run(_serve(ports))


async def _measure(grpc_port: int, tcp_port: int, *, rounds: int, block: int, gap_s: float
                   ) -> dict[str, dict[str, float]]:
    import grpc

    lat: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    cpu: dict[str, float] = dict.fromkeys(TRANSPORTS, 0.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        unary = channel.unary_unary("/echo.Echo/Unary")
        call = channel.stream_stream("/echo.Echo/Stream")()
        reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)

        async def once(kind: str) -> None:
            if kind == "unary":
                await unary(REQUEST)
            elif kind == "stream":
                await call.write(REQUEST)
                await call.read()
            else:
                writer.write(REQUEST)
                await reader.readexactly(len(REPLY))

        for r in range(rounds + 1):  # round 0 warms every path up and is not counted
            for kind in TRANSPORTS if r % 2 else TRANSPORTS[::-1]:
                c0 = _cpu_s()
                for _ in range(block):
                    t0 = time.perf_counter()
                    await once(kind)
                    if r:
                        lat[kind].append(time.perf_counter() - t0)
                    await asyncio.sleep(gap_s)
                if r:
                    cpu[kind] += _cpu_s() - c0
        await call.done_writing()
        writer.close()
    n = rounds * block
    return {k: {"p50_ms": float(np.percentile(v, 50) * 1e3), "p95_ms": float(np.percentile(v, 95) * 1e3),
                "client_cpu_ms": cpu[k] * 1e3 / n} for k, v in lat.items()}


def run(*, rounds: int = 10, block: int = 100, gap_ms: float = 5.0) -> dict[str, dict[str, float]]:
    """transport -> P50 ms, P95 ms and the client's CPU ms per call (the server in a child process)."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_server_main, args=(ports,), daemon=True)
    server.start()
    try:
        grpc_port, tcp_port = ports.get(timeout=60)
        return asyncio.run(_measure(grpc_port, tcp_port, rounds=rounds, block=block, gap_s=gap_ms / 1e3))
    finally:
        server.terminate()
        server.join(10)


def markdown(result: dict[str, dict[str, float]], *, rounds: int, block: int, gap_ms: float) -> str:
    lines = [f"Echo round trips, {rounds} alternating blocks of {block} calls per transport, {gap_ms:g} ms apart:",
             "", "| transport | P50 ms | P95 ms | client CPU ms per call |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['p50_ms']:.3f} | {v['p95_ms']:.3f} | {v['client_cpu_ms']:.3f} |" for k, v in result.items()]
    return "\n".join(lines) + "\n"
