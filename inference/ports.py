"""TCP ports and listening sockets: a free port for a server this process is about to start (tests,
load tests, benchmarks), and a listening socket to hand to a server (uvicorn) already bound."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now; the caller binds it soon (another process may take it first)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen_tcp(host: str, port: int, backlog: int = 512) -> socket.socket:
    """A non-blocking listening TCP socket on host:port (0 = a free port).

    The protocol must be given as IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted sockets
    whose `proto` says TCP, and a socket made with proto 0 passes 0 on to every connection. Without
    NODELAY a response written as headers then body waits for the client's delayed ACK: a ~45 ms
    mode on every HTTP call (docs/benchmarks.md, "TCP_NODELAY").
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
