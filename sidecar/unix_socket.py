"""The sidecar's Unix-socket endpoint: callers on the same host skip the TCP stack.

gRPC listens on the socket file itself; this module prepares the path (folder, stale file from a
crashed run), restricts who may connect (file mode), and removes the file at shutdown.

Callers hand their API keys to whatever listens on the path, so nobody else may be able to put a
socket there: the socket's folder belongs to this user or root and nobody else may write to it, sticky
or not (in /tmp another user can bind the name first, so the sidecar could not start and callers would
reach theirs), and the folders above follow folder_problem. A bare file name (`grpc.sock`) is a socket
in this user's private folder: $XDG_RUNTIME_DIR/embedcar, else var/run in the data home, created 0700.
Modes are set on the socket itself, never through a link.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from embedcar_client.private_paths import closed_folder_problem
from inference.errors import InvalidInput, Unavailable
from inference.private_paths import private_dir_problem
from inference.settings import data_home

log = logging.getLogger(__name__)

_SUN_PATH_MAX = 107  # bytes of sockaddr_un.sun_path (Linux), less the terminating NUL
UDS_MODE = 0o660  # owner and group may connect; nobody else
FOLDER_MODE = 0o755  # a folder we create: the group may reach the socket, nobody else may write
EXAMPLE_NAME = "grpc.sock"


@dataclass(frozen=True, slots=True)
class UnixSocket:
    """A Unix socket the server listens on. `remove()` deletes the file only while it is still ours."""

    path: Path  # absolute
    ident: tuple[int, int]  # (st_dev, st_ino) right after bind

    @property
    def target(self) -> str:
        return f"unix:{self.path}"

    def remove(self) -> None:
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            return  # grpc may already have removed it at shutdown
        if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self.ident:
            self.path.unlink(missing_ok=True)


def private_socket_dir(environ: Mapping[str, str] | None = None) -> Path:
    """This user's folder for sockets named by a bare file name: $XDG_RUNTIME_DIR/embedcar (the login's
    runtime folder, 0700 by the XDG specification; a relative value is ignored, as it says), else var/run
    in the data home. Read here, like tempfile reads TMPDIR: it is where a file goes, not a setting."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and Path(runtime).is_absolute():
        return Path(runtime) / "embedcar"
    return data_home(env) / "var" / "run"


def _bare_name(path: Path) -> bool:
    return str(path) == path.name and path.name not in ("", ".", "..") and not path.name.startswith("~")


def prepare_unix_socket(path: Path) -> Path:
    """The absolute socket path, its folder created, a stale socket left by a crashed run removed. A bare
    file name is in private_socket_dir(), created 0700.

    Refuses a folder others could add a file to (module docstring), a path that exists and is not a
    socket, and a socket another process still serves on.
    """
    if _bare_name(path):
        folder = private_socket_dir()
        if (problem := private_dir_problem(folder)) is not None:
            raise InvalidInput(f"cannot serve on Unix socket {path.name} in this user's socket folder: {problem}")
        path = folder / path.name
    else:
        path = path.expanduser().absolute()
    if len(bytes(path)) > _SUN_PATH_MAX:
        raise InvalidInput(f"Unix socket path {path} is longer than {_SUN_PATH_MAX} bytes: choose a shorter one")
    try:
        for level in reversed((path.parent, *path.parent.parents)):
            if not level.is_dir():
                with contextlib.suppress(FileExistsError):
                    level.mkdir(FOLDER_MODE)  # the umask may take bits off, never add write for others
    except OSError as exc:
        raise InvalidInput(f"cannot create the folder of Unix socket {path}: {exc.strerror}") from exc
    if (problem := closed_folder_problem(path.parent)) is not None:
        raise InvalidInput(
            f"refusing to serve on Unix socket {path}: {problem}, so another user could bind the path first and "
            "receive the API keys callers send. Use a folder only you can write to, or a bare file name "
            f"(uds_path={EXAMPLE_NAME} serves in {private_socket_dir()}, created 0700)")
    try:
        st = path.lstat()
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidInput(f"refusing to serve on Unix socket {path}: the path exists and is not a socket "
                           "(remove it or choose another path)")
    if _serving(path):
        raise Unavailable(f"another process is serving on Unix socket {path}")
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        raise InvalidInput(f"cannot remove stale Unix socket {path}: {exc.strerror}") from exc
    log.info("removed stale Unix socket %s (left by an earlier run)", path)
    return path


def _serving(path: Path) -> bool:
    """Whether a process accepts connections on the socket file `path` (refused = stale file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except TimeoutError:
            return True  # a live listener with a full backlog
        except OSError as exc:
            raise InvalidInput(f"cannot check Unix socket {path}: {exc.strerror}") from exc
    return True


def bind_unix_socket(server: grpc.aio.Server, path: Path) -> UnixSocket:
    """Listen on the prepared socket `path` too, and restrict it to owner and group (UDS_MODE)."""
    try:
        server.add_insecure_port(f"unix:{path}")
    except RuntimeError as exc:
        raise Unavailable(f"cannot listen on Unix socket {path}: {exc}") from exc
    # Right after bind, before the server starts (the file was created with the process umask's mode).
    return restrict_unix_socket(path)


def restrict_unix_socket(path: Path) -> UnixSocket:
    """The socket file a server has bound at `path`, restricted to owner and group (UDS_MODE). The mode is
    set on the file opened without following a link (Linux has no lchmod): a link put in its place is
    refused, never followed to whatever it names."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW)
    except OSError as exc:
        raise Unavailable(f"cannot open Unix socket {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode):
            raise Unavailable(f"refusing to set the mode of {path}: it is no longer a socket (replaced meanwhile)")
        os.chmod(f"/proc/self/fd/{fd}", UDS_MODE)  # noqa: PTH101  # the opened file itself, not a path lookup
    finally:
        os.close(fd)
    return UnixSocket(path, (st.st_dev, st.st_ino))


