"""TLS and restricted-API credentials for a Triton pool reached from other machines (profile `hardened`).

Triton restricts each API group to callers that send a header key (`--grpc-restricted-protocol`,
`--http-restricted-api`; over gRPC the header is `triton-grpc-protocol-<key name>`). Two groups:

    client    health, metadata, model-config, inference      sidecars and the catalog job
    operator  shared-memory, model-repository, statistics,   the operator (load test statistics);
              trace, logging                                 off when no operator key is configured

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
from inference.settings import TritonSettings, env_name

HARDENED = "hardened"
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


def hardened(t: TritonSettings) -> bool:
    return t.profile == HARDENED


def new_key() -> str:
    """A fresh shared key (URL-safe, 256 bits)."""
    return secrets.token_urlsafe(32)


def _needs(setting_name: str, what: str) -> FailedPrecondition:
    section, _, name = setting_name.partition(".")
    return FailedPrecondition(f"the hardened Triton profile needs {setting_name} ({env_name(section, name)} or "
                              f"--{name.replace('_', '-')}: {what})")


def read_key(path: Path | None, setting_name: str) -> str:
    """The key in `path` (one line); FailedPrecondition naming the file, never showing its content."""
    if path is None:
        raise _needs(setting_name, "a file holding the key; `embedcar triton certs` writes one")
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise FailedPrecondition(f"{setting_name} {path}: cannot read it ({exc.strerror or exc})") from None
    if not _KEY_RE.fullmatch(text):
        raise FailedPrecondition(f"{setting_name} {path}: not a key: expected one line of {MIN_KEY_CHARS}-256 "
                                 "characters from A-Z a-z 0-9 _ - (`embedcar triton certs` writes one)")
    return text


def _certificate(path: Path | None, setting_name: str) -> tuple[bytes, Any]:
    return pem.certificate(path, setting_name, _needs)


def _private_key(path: Path | None, setting_name: str) -> tuple[bytes, Any]:
    return pem.private_key(path, setting_name, _needs)


def _check_issued_by(cert: Any, ca: Any, cert_name: str, cert_path: Path | None, ca_path: Path | None) -> None:
    pem.check_issued_by(cert, ca, cert_name, cert_path, "triton.tls_ca_file", ca_path)


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """What a client of a hardened Triton sends: TLS material and the header keys (never in repr)."""

    root_ca: bytes = field(repr=False)
    cert_chain: bytes | None = field(repr=False)
    private_key: bytes | None = field(repr=False)
    client_key: str = field(repr=False)
    operator_key: str | None = field(repr=False)
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
    """None in the local profile; else the checked credentials (FailedPrecondition naming what is wrong)."""
    if not hardened(t):
        return None
    ca_pem, _ca = _certificate(t.tls_ca_file, "triton.tls_ca_file")
    cert_pem = key_pem = None
    if t.tls_client_cert_file is not None or t.tls_client_key_file is not None:
        cert_pem, cert = _certificate(t.tls_client_cert_file, "triton.tls_client_cert_file")
        key_pem, key = _private_key(t.tls_client_key_file, "triton.tls_client_key_file")
        pem.check_pair(cert, key, "triton.tls_client_cert_file", t.tls_client_cert_file, "triton.tls_client_key_file")
        _check_issued_by(cert, _ca, "triton.tls_client_cert_file", t.tls_client_cert_file, t.tls_ca_file)
    operator = read_key(t.operator_key_file, "triton.operator_key_file") if t.operator_key_file else None
    return ClientCredentials(ca_pem, cert_pem, key_pem, read_key(t.client_key_file, "triton.client_key_file"),
                             operator, t.tls_server_name)


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
    """TLS (mutual where tls_mutual), restricted API groups, model control off. Checks every file first."""
    ca_pem, ca = _certificate(t.tls_ca_file, "triton.tls_ca_file")
    _pem, cert = _certificate(t.tls_server_cert_file, "triton.tls_server_cert_file")
    _key_pem, key = _private_key(t.tls_server_key_file, "triton.tls_server_key_file")
    pem.check_pair(cert, key, "triton.tls_server_cert_file", t.tls_server_cert_file, "triton.tls_server_key_file")
    _check_issued_by(cert, ca, "triton.tls_server_cert_file", t.tls_server_cert_file, t.tls_ca_file)
    del ca_pem, _pem, _key_pem
    client = read_key(t.client_key_file, "triton.client_key_file")
    # No operator key: the group is still restricted, by a key that exists only in this process's
    # arguments (Triton cannot switch single gRPC groups off).
    operator = read_key(t.operator_key_file, "triton.operator_key_file") if t.operator_key_file else new_key()
    args = [
        "--grpc-use-ssl=true",
        f"--grpc-use-ssl-mutual={'true' if t.tls_mutual else 'false'}",
        f"--grpc-server-cert={t.tls_server_cert_file}",
        f"--grpc-server-key={t.tls_server_key_file}",
        f"--grpc-root-cert={t.tls_ca_file}",
        *restricted_flags(client, operator),
        *LOCKED_FLAGS,
    ]
    return ServerFlags(args, (client, operator))


# Off in the hardened profile: loading models at run time (code execution from the repository) and
# the cloud front ends we never use.
LOCKED_FLAGS = ("--model-control-mode=none", "--allow-sagemaker=false", "--allow-vertex-ai=false")


def restricted_flags(client: str, operator: str) -> list[str]:
    """The API-group flags with these key values (docker-compose.yml writes the same with `$(cat file)`)."""
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
    out = [read_key(p, name) for p, name in ((t.client_key_file, "triton.client_key_file"),
                                             (t.operator_key_file, "triton.operator_key_file")) if p is not None]
    for path in (t.tls_server_key_file, t.tls_client_key_file):
        if path is not None and path.is_file():
            body = "".join(line for line in path.read_text().splitlines() if not line.startswith("-----"))
            out += [body[i:i + _PIECE] for i in range(0, len(body) - _PIECE + 1, _PIECE)]
    return [m for m in out if m]
