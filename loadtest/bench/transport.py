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

Where gRPC's C++ library builds here, three more servers answer the compiled sender's unary calls
(`loadtest/native/echo_server.cc`, `echo_module.cc`): what a compiled front in front of Python would cost
  unary-native-cxx      a C++ server answering by itself (no Python at all)
  unary-native-inproc   a C++ server inside a Python process (which holds grpcio too, as the sidecar
                        does), each call's handler a Python function run on the gRPC thread that took it
  unary-native-forward  a C++ server forwarding each request over a Unix socket to a Python asyncio
                        server (a compiled proxy in front of a Python process); CPU of both processes
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import resource
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.errors import Internal, Unavailable
from inference.grpc_io import EXPERIMENTS, POLLING_IO, for_other_grpc
from loadtest import proc_cpu
from loadtest.native import build_loadgen, native_unavailable_reason, send
from loadtest.native_build import build_native

ECHO_SERVER = Path(__file__).resolve().parent.parent / "native" / "echo_server.cc"
ECHO_MODULE = Path(__file__).resolve().parent.parent / "native" / "echo_module.cc"

TRANSPORTS = ("tcp", "unary", "stream")
NATIVE_TRANSPORTS = ("unary-native", "stream-native")
COMPILED_SERVERS = ("unary-native-cxx", "unary-native-inproc", "unary-native-forward")
_FRAME = struct.Struct("<QI")  # the forwarding server's frames: id, length
REQUEST = b"q" * 60
REPLY = b"x" * 1600
ID_BYTES = 11  # a stream reply starts with the request's first bytes: the native sender's id (tag + varint)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _Forwarded(asyncio.Protocol):
    """The Python end of `unary-native-forward`: each framed request is answered with REPLY."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= _FRAME.size:
            rid, n = _FRAME.unpack_from(buf)
            if len(buf) < _FRAME.size + n:
                break
            del buf[:_FRAME.size + n]
            self.transport.write(_FRAME.pack(rid, len(REPLY)) + REPLY)


async def _serve(ports: Any, uds_path: str) -> None:
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
    await asyncio.get_running_loop().create_unix_server(_Forwarded, uds_path)
    ports.put((grpc_port, raw.sockets[0].getsockname()[1]))
    await asyncio.Event().wait()  # until the bench terminates this process


def _server_main(ports: Any, uds_path: str) -> None:
    asyncio.run(_serve(ports, uds_path))


def _inproc_main(module_dir: str, ports: Any) -> None:
    """`unary-native-inproc`'s process: grpcio imported as in the sidecar, the C++ server beside it."""
    if os.environ.get(EXPERIMENTS) == POLLING_IO:  # names only grpcio knows: the other library would warn
        del os.environ[EXPERIMENTS]
    import grpc  # noqa: F401  # two gRPC libraries in one process, as a compiled front in the sidecar would be

    sys.path.insert(0, module_dir)
    import embedcar_echo  # type: ignore[import-not-found]  # built by build_native

    ports.put(embedcar_echo.serve(0, lambda _request: REPLY))
    while True:
        time.sleep(3600)


@dataclass
class _Compiled:
    """Where a compiled-server row sends, and whose CPU it counts."""

    address: str
    pids: list[int]


def compiled_unavailable_reason() -> str | None:
    """None when the compiled servers build here (and the compiled sender), else why not."""
    try:
        build_loadgen()
        build_native(ECHO_SERVER, "embedcar-echo-server")
        build_native(ECHO_MODULE, "embedcar_echo", module=True)
    except Unavailable as exc:
        return exc.message
    return None


def _stream_payload(i: int) -> bytes:
    """REQUEST's size, starting with a StreamRequest's id i + 1 (what the native sender matches replies by)."""
    from embedcar_client.proto import embedcar_pb2 as pb

    head = pb.StreamRequest(id=i + 1).SerializeToString()
    return head + REQUEST[len(head):]


async def _measure(grpc_port: int, tcp_port: int, server_pid: int, *, rounds: int, block: int, gap_s: float,
                   native_exe: Path | None, compiled: dict[str, _Compiled]) -> dict[str, dict[str, float]]:
    import grpc

    kinds = TRANSPORTS + (NATIVE_TRANSPORTS if native_exe is not None else ()) + tuple(compiled)
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
            to = compiled[kind].address if kind in compiled else address
            run = await send(native_exe, to, "/echo.Echo/Stream" if stream else "/echo.Echo/Unary",
                             "stream" if stream else "unary", payloads, [i * gap_s for i in range(block)])
            if any(r.code for r in run.records) or any(len(r.body) != len(REPLY) for r in run.records):
                raise Internal(f"{kind}: echo calls failed: {run.records[0].body[:200]!r}")
            if counted:
                lat[kind] += [r.latency_ns / 1e9 for r in run.records]
            return run.cpu_s

        for r in range(rounds + 1):  # round 0 warms every path up and is not counted
            for kind in kinds if r % 2 else kinds[::-1]:
                pids = compiled[kind].pids if kind in compiled else [server_pid]
                s0 = sum(proc_cpu.cpu_s(p) for p in pids)
                spent = await (python_block if kind in TRANSPORTS else native_block)(kind, r > 0)
                if r:
                    cpu[kind] += spent
                    server_cpu[kind] += sum(proc_cpu.cpu_s(p) for p in pids) - s0
        await call.done_writing()
        writer.close()
    n = rounds * block
    return {k: {"p50_ms": float(np.percentile(v, 50) * 1e3), "p95_ms": float(np.percentile(v, 95) * 1e3),
                "client_cpu_ms": cpu[k] * 1e3 / n, "server_cpu_ms": server_cpu[k] * 1e3 / n}
            for k, v in lat.items()}


def _port_from(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        raise Internal(f"compiled echo server did not start (exit {proc.poll()})")
    return int(line)


def run(*, rounds: int = 10, block: int = 100, gap_ms: float = 5.0, native: bool = True
        ) -> dict[str, dict[str, float]]:
    """transport -> P50 ms, P95 ms, the client's and the server's CPU ms per call (the server in a
    child process); the native rows where the compiled sender builds here and `native`, the compiled
    servers' rows where those build too."""
    exe = build_loadgen() if native and native_unavailable_reason() is None else None
    with_compiled = exe is not None and compiled_unavailable_reason() is None
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    children: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="embedcar-transport-") as tmp:
        uds_path = str(Path(tmp) / "forward.sock")
        server = ctx.Process(target=_server_main, args=(ports, uds_path), daemon=True)
        server.start()
        children.append(server)
        try:
            grpc_port, tcp_port = ports.get(timeout=60)
            assert server.pid is not None
            compiled: dict[str, _Compiled] = {}
            if with_compiled:
                compiled = _start_compiled(ctx, uds_path, server.pid, children)
            return asyncio.run(_measure(grpc_port, tcp_port, server.pid, rounds=rounds, block=block,
                                        gap_s=gap_ms / 1e3, native_exe=exe, compiled=compiled))
        finally:
            for child in children:
                if isinstance(child, subprocess.Popen):
                    child.kill()
                    child.wait(10)
                else:
                    child.terminate()
                    child.join(10)


def _start_compiled(ctx: Any, uds_path: str, python_pid: int, children: list[Any]) -> dict[str, _Compiled]:
    echo_exe = build_native(ECHO_SERVER, "embedcar-echo-server")
    module = build_native(ECHO_MODULE, "embedcar_echo", module=True)
    env = for_other_grpc(os.environ)
    cxx = subprocess.Popen([str(echo_exe), "echo", "0", str(len(REPLY))], stdout=subprocess.PIPE, text=True, env=env)
    children.append(cxx)
    forward = subprocess.Popen([str(echo_exe), "forward", "0", uds_path], stdout=subprocess.PIPE, text=True, env=env)
    children.append(forward)
    ports = ctx.Queue()
    inproc = ctx.Process(target=_inproc_main, args=(str(module.parent), ports), daemon=True)
    inproc.start()
    children.append(inproc)
    inproc_port = ports.get(timeout=60)
    assert inproc.pid is not None
    return {"unary-native-cxx": _Compiled(f"127.0.0.1:{_port_from(cxx)}", [cxx.pid]),
            "unary-native-inproc": _Compiled(f"127.0.0.1:{inproc_port}", [inproc.pid]),
            "unary-native-forward": _Compiled(f"127.0.0.1:{_port_from(forward)}", [forward.pid, python_pid])}


def markdown(result: dict[str, dict[str, float]], *, rounds: int, block: int, gap_ms: float) -> str:
    lines = [f"Echo round trips, {rounds} alternating blocks of {block} calls per transport, {gap_ms:g} ms apart:",
             "", "| transport | P50 ms | P95 ms | client CPU ms per call | server CPU ms per call |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['p50_ms']:.3f} | {v['p95_ms']:.3f} | {v['client_cpu_ms']:.3f} | {v['server_cpu_ms']:.3f} |"
              for k, v in result.items()]
    if not any(k.endswith("-native") for k in result):
        lines += ["", f"No native rows: {native_unavailable_reason() or 'not asked for'}."]
    elif not any(k in result for k in COMPILED_SERVERS):
        lines += ["", f"No compiled-server rows: {compiled_unavailable_reason()}."]
    return "\n".join(lines) + "\n"
