"""`embedcar bench refusal`: what refusing one gRPC call costs the server, by where it is refused.

Not the sidecar: a grpc.aio server in a child process (as the sidecar runs), configured per way:
  answer    an empty handler that answers: the least a call the event loop takes costs
  answer-sync  the same on gRPC's sync server (`grpc.server`, 4 worker threads): the other Python
            server, for comparison (no refusal)
  handler   a handler that refuses at once with RESOURCE_EXHAUSTED and a retry hint in the trailer
            (what sidecar.shedding.Gate does before a request is parsed)
  limiter   grpc.aio's `maximum_concurrent_rpcs` with its one slot held: refused in Cython after the
            loop took the call (RESOURCE_EXHAUSTED, no retry hint)
  backlog   the event loop held, gRPC's C core refusing what waits past `grpc.server.max_pending_requests`
            (CANCELLED; sidecar.grpc_server.backlog_options): no Python runs
The client (grpc.aio, this process) sends --calls calls, 64 at a time, per block; blocks alternate
per way; the server's CPU (its process, /proc) per call is reported as the median over blocks.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time
from collections import Counter
from typing import Any

from loadtest import proc_cpu

WAYS = ("answer", "answer-sync", "handler", "limiter", "backlog")
HOLD = b"hold"  # the request that takes the limiter's slot or the event loop


def _serve(way: str, ports: Any) -> None:
    import grpc

    if way == "answer-sync":
        from concurrent import futures

        sync = grpc.server(futures.ThreadPoolExecutor(4))
        sync.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Refusal", {
            "Call": grpc.unary_unary_rpc_method_handler(lambda raw, ctx: b"")}),))
        ports.put(sync.add_insecure_port("127.0.0.1:0"))
        sync.start()
        sync.wait_for_termination()
        return

    async def main() -> None:
        async def answer(raw: bytes, ctx: Any) -> bytes:
            return b""

        async def handler(raw: bytes, ctx: Any) -> bytes:
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded",
                            trailing_metadata=(("x-retry-after-s", "0.0100"),))
            return b""

        async def limiter(raw: bytes, ctx: Any) -> bytes:
            if raw == HOLD:
                await asyncio.sleep(3600)
            return b""

        async def backlog(raw: bytes, ctx: Any) -> bytes:
            if raw == HOLD:
                time.sleep(3600)  # noqa: ASYNC251 - the event loop itself is held: only C core answers
            return b""

        fn = {"answer": answer, "handler": handler, "limiter": limiter, "backlog": backlog}[way]
        options = [("grpc.server.max_pending_requests", 2), ("grpc.server.max_pending_requests_hard_limit", 4)]
        server = grpc.aio.server(options=options if way == "backlog" else [],
                                 maximum_concurrent_rpcs=1 if way == "limiter" else None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Refusal", {
            "Call": grpc.unary_unary_rpc_method_handler(fn)}),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _block(port: int, pid: int, calls: int, hold: bool) -> tuple[float, Counter[str]]:
    import grpc

    codes: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_unary("/bench.Refusal/Call")
        held = asyncio.ensure_future(call(HOLD, timeout=600)) if hold else None
        await asyncio.sleep(0.3)  # the hold has reached the server
        gate = asyncio.Semaphore(64)

        async def one() -> None:
            async with gate:
                try:
                    await call(b"q", timeout=10)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1

        c0 = proc_cpu.cpu_s(pid)
        await asyncio.gather(*(one() for _ in range(calls)))
        cpu = proc_cpu.cpu_s(pid) - c0
        if held is not None:
            held.cancel()
    return cpu / calls, codes


def run(*, rounds: int, calls: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    per_call: dict[str, list[float]] = {w: [] for w in WAYS}
    codes: dict[str, Counter[str]] = {w: Counter() for w in WAYS}
    for _ in range(rounds):
        for way in WAYS:  # a fresh server per block: a held loop cannot be released
            ports: Any = ctx.Queue()
            proc = ctx.Process(target=_serve, args=(way, ports), daemon=True)
            proc.start()
            try:
                port = ports.get(timeout=60)
                assert proc.pid is not None
                cpu, seen = asyncio.run(_block(port, proc.pid, calls, hold=way in ("limiter", "backlog")))
            finally:
                proc.kill()
                proc.join(10)
            per_call[way].append(cpu)
            codes[way] += seen
    return {way: {"server_cpu_us_per_call": statistics.median(v) * 1e6, "codes": dict(codes[way])}
            for way, v in per_call.items()}


def markdown(result: dict[str, Any], *, rounds: int, calls: int) -> str:
    base = result["answer"]["server_cpu_us_per_call"]
    lines = [f"`embedcar bench refusal --rounds {rounds} --calls {calls}` · server CPU per call, median of "
             f"{rounds} blocks", "", "| refused where | server CPU per call (µs) | vs answering | client saw |",
             "|---|---:|---:|---|"]
    for way in WAYS:
        r = result[way]
        us = r["server_cpu_us_per_call"]
        lines.append(f"| {way} | {us:.0f} | {us / base:.2f}× | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(r['codes'].items()))} |")
    return "\n".join(lines)
