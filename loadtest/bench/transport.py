"""`embedcar bench transport`: what one round trip costs in each way a client can reach the sidecar.

Not the sidecar: an echo server (a child process, like the sidecar) answering a 60-byte request
with 1,600 bytes (a 384-d float32 embedding and its envelope) over
  tcp      raw asyncio TCP: the kernel and Python's event loop, the least any transport costs
  unary    a grpc.aio unary call per request (what Embed and Search are)
  stream   a message each way on one open grpc.aio bidi call (what Stream is)
The client is grpc.aio / asyncio in this process; and, where it builds here (loadtest/native.py),
the load generator's compiled C++ sender for the same unary calls and stream messages
(`unary-native`, `stream-native`: one sender run per block, a call every --gap-ms on the clock).
Python calls go one at a time with a gap between them (--gap-ms, as at ~100 requests/s). Blocks
alternate per transport so each sees the same machine; P50/P95, the client's CPU per call and the
echo server's CPU per call (its process, from /proc) are over all blocks. The difference between
the unary and stream rows is what `AsyncClient(stream=True)` saves a caller per request; the native
rows show what the Python gRPC server costs when the client costs little.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np

from inference.errors import Internal
from loadtest import proc_cpu
from loadtest.native import build_loadgen, native_unavailable_reason, send

TRANSPORTS = ("tcp", "unary", "stream")
NATIVE_TRANSPORTS = ("unary-native", "stream-native")
REQUEST = b"q" * 60
REPLY = b"x" * 1600
ID_BYTES = 11  # a stream reply starts with the request's first bytes: the native sender's id (tag + varint)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _serve(ports: Any) -> None:
    import grpc

    async def unary(req: bytes, ctx: Any) -> bytes:
        return REPLY

    async def stream(requests: Any, ctx: Any) -> Any:
        async for req in requests:
            yield req[:ID_BYTES] + REPLY[ID_BYTES:]

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


def _stream_payload(i: int) -> bytes:
    """REQUEST's size, starting with a StreamRequest's id i + 1 (what the native sender matches replies by)."""
    from sidecar.proto import embedcar_pb2 as pb

    head = pb.StreamRequest(id=i + 1).SerializeToString()
    return head + REQUEST[len(head):]


async def _measure(grpc_port: int, tcp_port: int, server_pid: int, *, rounds: int, block: int, gap_s: float,
                   native_exe: Path | None) -> dict[str, dict[str, float]]:
    import grpc

    kinds = TRANSPORTS + (NATIVE_TRANSPORTS if native_exe is not None else ())
    lat: dict[str, list[float]] = {t: [] for t in kinds}
    cpu = dict.fromkeys(kinds, 0.0)
    server_cpu = dict.fromkeys(kinds, 0.0)
    address = f"127.0.0.1:{grpc_port}"
    async with grpc.aio.insecure_channel(address) as channel:
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

        async def python_block(kind: str, counted: bool) -> float:
            c0 = _cpu_s()
            for _ in range(block):
                t0 = time.perf_counter()
                await once(kind)
                if counted:
                    lat[kind].append(time.perf_counter() - t0)
                await asyncio.sleep(gap_s)
            return _cpu_s() - c0

        async def native_block(kind: str, counted: bool) -> float:
            assert native_exe is not None
            stream = kind == "stream-native"
            payloads = [_stream_payload(i) if stream else REQUEST for i in range(block)]
            run = await send(native_exe, address, "/echo.Echo/Stream" if stream else "/echo.Echo/Unary",
                             "stream" if stream else "unary", payloads, [i * gap_s for i in range(block)])
            if any(r.code for r in run.records):
                raise Internal(f"{kind}: echo calls failed: {run.records[0].body[:200]!r}")
            if counted:
                lat[kind] += [r.latency_ns / 1e9 for r in run.records]
            return run.cpu_s

        for r in range(rounds + 1):  # round 0 warms every path up and is not counted
            for kind in kinds if r % 2 else kinds[::-1]:
                s0 = proc_cpu.cpu_s(server_pid)
                spent = await (native_block if kind.endswith("-native") else python_block)(kind, r > 0)
                if r:
                    cpu[kind] += spent
                    server_cpu[kind] += proc_cpu.cpu_s(server_pid) - s0
        await call.done_writing()
        writer.close()
    n = rounds * block
    return {k: {"p50_ms": float(np.percentile(v, 50) * 1e3), "p95_ms": float(np.percentile(v, 95) * 1e3),
                "client_cpu_ms": cpu[k] * 1e3 / n, "server_cpu_ms": server_cpu[k] * 1e3 / n}
            for k, v in lat.items()}


def run(*, rounds: int = 10, block: int = 100, gap_ms: float = 5.0, native: bool = True
        ) -> dict[str, dict[str, float]]:
    """transport -> P50 ms, P95 ms, the client's and the server's CPU ms per call (the server in a
    child process); the native rows where the compiled sender builds here and `native`."""
    exe = build_loadgen() if native and native_unavailable_reason() is None else None
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_server_main, args=(ports,), daemon=True)
    server.start()
    try:
        grpc_port, tcp_port = ports.get(timeout=60)
        assert server.pid is not None
        return asyncio.run(_measure(grpc_port, tcp_port, server.pid, rounds=rounds, block=block,
                                    gap_s=gap_ms / 1e3, native_exe=exe))
    finally:
        server.terminate()
        server.join(10)


def markdown(result: dict[str, dict[str, float]], *, rounds: int, block: int, gap_ms: float) -> str:
    lines = [f"Echo round trips, {rounds} alternating blocks of {block} calls per transport, {gap_ms:g} ms apart:",
             "", "| transport | P50 ms | P95 ms | client CPU ms per call | server CPU ms per call |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['p50_ms']:.3f} | {v['p95_ms']:.3f} | {v['client_cpu_ms']:.3f} | {v['server_cpu_ms']:.3f} |"
              for k, v in result.items()]
    if not any(k.endswith("-native") for k in result):
        lines += ["", f"No native rows: {native_unavailable_reason() or 'not asked for'}."]
    return "\n".join(lines) + "\n"
