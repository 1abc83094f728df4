"""TCP ports and listening sockets: a free port for a server this process is about to start (tests,
load tests, benchmarks), a listening socket to hand to a server (uvicorn) already bound, and the
one-line error a server's bind failure becomes (named by the setting's flag, not an OSError traceback)."""

from __future__ import annotations

import errno
import socket

from inference.errors import EmbedcarError, InvalidInput, Unavailable


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now; the caller binds it soon (another process may take it first)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen_error(flag: str, host: str, port: int, reason: str, *, in_use: bool = False) -> EmbedcarError:
    """`--http-port 8080: cannot listen on 127.0.0.1:8080: ...`: what a server's failed bind says.
    In use: Unavailable (it may free up); anything else (a foreign address, a privileged port): the
    setting is wrong, InvalidInput."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if in_use:
        return Unavailable(f"{flag} {port}: cannot listen on {where}: the port is in use (another process "
                           f"listens there; pick another, or 0 for a free one)")
    return InvalidInput(f"{flag} {port}: cannot listen on {where}: {reason}")


def _bind_error(flag: str, host: str, port: int, exc: OSError | OverflowError) -> EmbedcarError:
    if isinstance(exc, OSError):
        return listen_error(flag, host, port, exc.strerror or str(exc), in_use=exc.errno == errno.EADDRINUSE)
    return listen_error(flag, host, port, "not a TCP port (0-65535)")


def listen_tcp(host: str, port: int, backlog: int = 512, *, flag: str = "port") -> socket.socket:
    """A non-blocking listening TCP socket on host:port (0 = a free port); a failure to bind raises
    `listen_error` naming `flag` (the setting's CLI flag, e.g. `--http-port`).

    The protocol must be given as IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted sockets
    whose `proto` says TCP, and a socket made with proto 0 passes 0 on to every connection. Without
    NODELAY a response written as headers then body waits for the client's delayed ACK: a ~45 ms
    mode on every HTTP call (docs/benchmarks.md, levers: "TCP_NODELAY").
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except (OSError, OverflowError) as exc:
        sock.close()
        raise _bind_error(flag, host, port, exc) from exc
    except BaseException:
        sock.close()
        raise
    return sock


def check_listenable(host: str, port: int, *, flag: str) -> None:
    """Raise `listen_error` where host:port cannot be bound now (in use, not this host's address).

    For servers that bind inside a C library (gRPC's core): they fail with a core log line on stderr and
    no reason; this bind, with the SO_REUSEADDR they set too, fails first with the operating system's
    reason. Port 0 (a free one) always binds. A race with another process is still possible: the
    server's own failure stays the fallback."""
    if port == 0:
        return
    listen_tcp(host, port, backlog=1, flag=flag).close()
