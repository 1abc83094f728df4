"""Helpers for the loadtest tests: a tiny real HTTP server with scripted behaviour.

`stub_http_server` answers POST /v1/embeddings over real sockets on 127.0.0.1:0 (HTTP/1.1,
keep-alive), so the load generator, the HTTP target and its error mapping run for real. It can
stall (block every request until a point in time, like a GC pause or a stuck model), hold requests
in a test's own hook until an event (a stall that ends when the test says, not after a timer) and
answer scripted status codes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

STATUS_TEXT = {200: "OK", 400: "Bad Request", 429: "Too Many Requests", 503: "Service Unavailable"}


@dataclass
class StubBehaviour:
    service_s: float = 0.0  # time per request
    stall_after: int | None = None  # the Nth request (1-based) stalls the server ...
    stall_s: float = 0.0  # ... for this long: it and everything arriving meanwhile wait
    status_for: Callable[[int], int] = lambda n: 200  # status of the Nth request
    on_request: Callable[[int, list[str]], Awaitable[None]] | None = None  # awaited with (N, texts) before answering


@dataclass
class StubServer:
    behaviour: StubBehaviour
    port: int = 0
    count: int = 0
    arrivals: list[float] = field(default_factory=list)  # perf_counter at each request's arrival
    statuses: Counter[int] = field(default_factory=Counter)
    blocked_until: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode("latin-1").split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                body = await reader.readexactly(length) if length else b""
                writer.write(await self.respond(body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(self, body: bytes) -> bytes:
        now = time.perf_counter()
        self.arrivals.append(now)
        self.count += 1
        n = self.count
        b = self.behaviour
        texts = json.loads(body or b"{}").get("input", [])
        if b.on_request is not None:
            await b.on_request(n, texts)
        if b.stall_after is not None and n == b.stall_after:
            self.blocked_until = now + b.stall_s
        if self.blocked_until > now:
            await asyncio.sleep(self.blocked_until - now)
        if b.service_s:
            await asyncio.sleep(b.service_s)
        status = b.status_for(n)
        self.statuses[status] += 1
        payload = ({"object": "list", "model": "stub",
                    "data": [{"object": "embedding", "index": i, "embedding": [0.0]} for i, _ in enumerate(texts)]}
                   if status == 200 else {"error": STATUS_TEXT.get(status, "error")})
        data = json.dumps(payload).encode()
        return (f"HTTP/1.1 {status} {STATUS_TEXT.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n").encode() + data


@asynccontextmanager
async def stub_http_server(behaviour: StubBehaviour | None = None) -> AsyncIterator[StubServer]:
    stub = StubServer(behaviour or StubBehaviour())
    server = await asyncio.start_server(stub.handle, "127.0.0.1", 0)
    stub.port = server.sockets[0].getsockname()[1]
    try:
        yield stub
    finally:
        server.close()
        await server.wait_closed()
