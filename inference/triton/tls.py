"""TLS and restricted-API credentials for a Triton pool reached from other machines (the hardened profile:
`triton.tls_dir` set).

Triton restricts each API group to callers that send a header key (`--grpc-restricted-protocol`,
`--http-restricted-api`; over gRPC the header is `triton-grpc-protocol-<key name>`). Two groups:

    client    health, metadata, model-config, inference      sidecars and the catalog job
    operator  shared-memory, model-repository, statistics,   the operator (load test statistics);
              trace, logging                                 off when no operator key is configured

Every file lives in one folder per machine under fixed names (`embedcar triton certs` writes one per
host and per client): ca.pem; a Triton host's server.pem + server.key; a client's client.pem +
client.key (a host's own folder serves as a client's too: its certificate carries the client usage);
client_key.txt; operator_key.txt where that group is wanted. Mutual TLS is always on.

Secrets (the two keys, private keys) are read from files here, at use, and never enter the settings
object, a repr, an exception message or a log line: errors name the file and what is wrong with it.
Certificates are checked with `cryptography` before anything connects, so a wrong or missing file is
a start-up error rather than a TLS handshake that fails somewhere later.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference import pem
from inference.errors import FailedPrecondition
from inference.settings import TritonSettings

SETTING = "triton.tls_dir"
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # Triton prefixes the key name with this over gRPC
CLIENT_KEY_NAME = "embedcar-key"
OPERATOR_KEY_NAME = "embedcar-operator-key"
CLIENT_GROUPS = ("health", "metadata", "model-config", "inference")
OPERATOR_GROUPS = ("shared-memory", "model-repository", "statistics", "trace", "logging")
# HTTP (loopback only in the hardened profile) leaves health open: the container's healthcheck and
# the launcher's readiness probe ask it without holding a secret on their command lines.
HTTP_CLIENT_GROUPS = ("metadata", "model-config", "inference")
# Header values travel as gRPC metadata and inside Triton's `group:name=value` flag: no separators.
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{16,256}")
MIN_KEY_CHARS = 16

# The files of a tls_dir (inference/triton/certs.py writes them).
CA_CERT = "ca.pem"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
CLIENT_CERT, CLIENT_KEY = "client.pem", "client.key"
CLIENT_KEY_FILE = "client_key.txt"
OPERATOR_KEY_FILE = "operator_key.txt"


def hardened(t: TritonSettings) -> bool:
    return t.tls_dir is not None


def new_key() -> str:
    """A fresh shared key (URL-safe, 256 bits)."""
    return secrets.token_urlsafe(32)


def _dir(t: TritonSettings) -> Path:
    if t.tls_dir is None:
        raise FailedPrecondition(f"{SETTING} is not set")  # callers ask only in the hardened profile
    return t.tls_dir


def tls_file(t: TritonSettings, name: str) -> Path:
    """`name` in tls_dir; a missing one is a one-line start-up error naming the folder and the file."""
    folder = _dir(t)
    path = folder / name
    if not path.is_file():
        raise FailedPrecondition(f"{SETTING} {folder}: no {name} (`embedcar triton certs` writes a folder per "
                                 "Triton host and per client)")
    return path


def _optional(t: TritonSettings, name: str) -> Path | None:
    path = _dir(t) / name
    return path if path.is_file() else None


def read_key(path: Path) -> str:
    """The key in `path` (one line); FailedPrecondition naming the file, never showing its content."""
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise FailedPrecondition(f"{SETTING} {path}: cannot read it ({exc.strerror or exc})") from None
    if not _KEY_RE.fullmatch(text):
        raise FailedPrecondition(f"{SETTING} {path}: not a key: expected one line of {MIN_KEY_CHARS}-256 "
                                 "characters from A-Z a-z 0-9 _ - (`embedcar triton certs` writes one)")
    return text


def client_key(t: TritonSettings) -> str:
    return read_key(tls_file(t, CLIENT_KEY_FILE))


def operator_key(t: TritonSettings) -> str | None:
    path = _optional(t, OPERATOR_KEY_FILE)
    return None if path is None else read_key(path)


def _certificate(path: Path) -> tuple[bytes, Any]:
    return pem.certificate(path, SETTING)


def _checked_pair(ca: Any, ca_path: Path, cert_path: Path, key_path: Path) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM), checked to belong together and to be issued by the pool's CA."""
    cert_pem, cert = _certificate(cert_path)
    key_pem, key = pem.private_key(key_path, SETTING)
    pem.check_pair(cert, key, SETTING, cert_path, f"{SETTING} {key_path}")
    pem.check_issued_by(cert, ca, SETTING, cert_path, SETTING, ca_path)
    return cert_pem, key_pem


def client_files(t: TritonSettings) -> tuple[Path, Path, Path]:
    """(CA, certificate, key) a client presents: client.pem/.key, else a Triton host's own server.pem/.key."""
    ca = tls_file(t, CA_CERT)
    if _optional(t, CLIENT_CERT) is not None or _optional(t, SERVER_CERT) is None:
        return ca, tls_file(t, CLIENT_CERT), tls_file(t, CLIENT_KEY)
    return ca, tls_file(t, SERVER_CERT), tls_file(t, SERVER_KEY)


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """What a client of a hardened Triton sends: TLS material and the header keys (never in repr)."""

    root_ca: bytes = field(repr=False)
    cert_chain: bytes | None = field(repr=False)
    private_key: bytes | None = field(repr=False)
    client_key: str = field(repr=False)
    operator_key: str | None = field(repr=False)
    # The name to check Triton's certificate against instead of the URL's host. The settings set none:
    # `triton certs --hosts` names what clients dial; a caller dialling something else passes one.
    server_name: str = ""

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The header for the client group (inference, health, metadata, model config)."""
        return ((GRPC_HEADER_PREFIX + CLIENT_KEY_NAME, self.client_key),)

    @property
    def operator_metadata(self) -> tuple[tuple[str, str], ...]:
        """The operator group's header where this client holds the key (statistics), else none."""
        return () if self.operator_key is None else ((GRPC_HEADER_PREFIX + OPERATOR_KEY_NAME, self.operator_key),)

    def channel_credentials(self) -> Any:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.root_ca, private_key=self.private_key,
                                            certificate_chain=self.cert_chain)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def client_credentials(t: TritonSettings) -> ClientCredentials | None:
    """None without tls_dir (the local profile); else the checked credentials (FailedPrecondition naming
    what is wrong)."""
    if not hardened(t):
        return None
    ca_path, cert_path, key_path = client_files(t)
    ca_pem, ca = _certificate(ca_path)
    cert_pem, key_pem = _checked_pair(ca, ca_path, cert_path, key_path)
    return ClientCredentials(ca_pem, cert_pem, key_pem, client_key(t), operator_key(t))


@dataclass(frozen=True, slots=True)
class ServerFlags:
    """tritonserver flags of the hardened profile. `args` holds the keys: pass it to the process only,
    never to a log line (`redacted()` is the loggable form)."""

    args: list[str] = field(repr=False)
    secrets: tuple[str, ...] = field(repr=False)

    def redacted(self) -> list[str]:
        out = []
        for a in self.args:
            for s in self.secrets:
                a = a.replace(s, "<redacted>")
            out.append(a)
        return out


def server_flags(t: TritonSettings) -> ServerFlags:
    """Mutual TLS, restricted API groups, model control off. Checks every file first."""
    ca_path, cert_path, key_path = tls_file(t, CA_CERT), tls_file(t, SERVER_CERT), tls_file(t, SERVER_KEY)
    _ca_pem, ca = _certificate(ca_path)
    _checked_pair(ca, ca_path, cert_path, key_path)
    client = client_key(t)
    # No operator key: the group is still restricted, by a key that exists only in this process's
    # arguments (Triton cannot switch single gRPC groups off).
    operator = operator_key(t) or new_key()
    args = [
        "--grpc-use-ssl=true",
        "--grpc-use-ssl-mutual=true",
        f"--grpc-server-cert={cert_path}",
        f"--grpc-server-key={key_path}",
        f"--grpc-root-cert={ca_path}",
        *restricted_flags(client, operator),
        *LOCKED_FLAGS,
    ]
    return ServerFlags(args, (client, operator))


# Off in the hardened profile: loading models at run time (code execution from the repository) and
# the cloud front ends we never use.
LOCKED_FLAGS = ("--model-control-mode=none", "--allow-sagemaker=false", "--allow-vertex-ai=false")


def restricted_flags(client: str, operator: str) -> list[str]:
    """The API-group flags with these key values (docker-compose.yml writes the same with argv_secrets'
    placeholders, filled from the key files by its launcher)."""
    return [
        f"--grpc-restricted-protocol={','.join(CLIENT_GROUPS)}:{CLIENT_KEY_NAME}={client}",
        f"--grpc-restricted-protocol={','.join(OPERATOR_GROUPS)}:{OPERATOR_KEY_NAME}={operator}",
        f"--http-restricted-api={','.join(HTTP_CLIENT_GROUPS)}:{CLIENT_KEY_NAME}={client}",
        f"--http-restricted-api={','.join(OPERATOR_GROUPS)}:{OPERATOR_KEY_NAME}={operator}",
    ]


_PIECE = 24


def secret_markers(t: TritonSettings) -> list[str]:
    """What must never appear in a log line: the keys, and each private key's PEM body cut into 24-character
    pieces (random base64: any leaked run of 47 characters or more holds a whole piece). Empty in the
    local profile."""
    if not hardened(t):
        return []
    out = [read_key(p) for p in (_optional(t, CLIENT_KEY_FILE), _optional(t, OPERATOR_KEY_FILE)) if p is not None]
    for path in (_optional(t, SERVER_KEY), _optional(t, CLIENT_KEY)):
        if path is not None:
            body = "".join(line for line in path.read_text().splitlines() if not line.startswith("-----"))
            out += [body[i:i + _PIECE] for i in range(0, len(body) - _PIECE + 1, _PIECE)]
    return [m for m in out if m]
