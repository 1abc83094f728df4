"""Listening sockets handed to servers: accepted connections must send small writes at once."""

from __future__ import annotations

import asyncio
import socket

from inference.ports import listen_tcp


async def test_connections_accepted_on_listen_tcp_have_nodelay() -> None:
    # asyncio sets TCP_NODELAY only where the socket's proto says TCP; without it a response written
    # as headers then body waits ~40 ms for the client's delayed ACK (docs/benchmarks.md, levers: "TCP_NODELAY").
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Record(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    sock = listen_tcp("127.0.0.1", 0)
    server = await asyncio.get_running_loop().create_server(Record, sock=sock)
    try:
        port = sock.getsockname()[1]
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(seen, 10) == 1
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_listen_tcp_picks_a_free_port_and_listens() -> None:
    sock = listen_tcp("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port > 0 and not sock.getblocking()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        sock.close()
