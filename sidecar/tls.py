"""TLS on the sidecar's (and the demo's) own ports when they are reached from other machines.

Bound to loopback, the sidecar and the demo serve plaintext: nothing crosses the network, and a TLS
handshake would only cost the search node's own calls. Bound to any other address they serve TLS
on gRPC and HTTP (as they require API keys there), with the certificate and key named in settings,
and mutual TLS where a client CA is set. An explicit opt-out exists for deployments whose TLS ends in
front of the sidecar (a service mesh's proxy on the same host). The Unix socket is never TLS: access
to it is by file permissions.

The files are read and checked before anything listens (inference/pem.py): a wrong certificate is a
start-up error that names the setting and file, not a handshake that fails at the first caller.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference import pem
from inference.errors import FailedPrecondition
from inference.settings import env_name
from sidecar.auth import is_loopback


@dataclass(frozen=True, slots=True)
class ServerTls:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None
    cert_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = field(repr=False)

    def grpc_credentials(self) -> Any:
        import grpc

        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config's TLS arguments (it reads the files itself)."""
        return {"ssl_certfile": str(self.cert_file), "ssl_keyfile": str(self.key_file),
                "ssl_ca_certs": str(self.client_ca_file) if self.client_ca_file else None,
                "ssl_cert_reqs": ssl.CERT_REQUIRED if self.client_ca_file else ssl.CERT_NONE}


def server_tls(section: str, host: str, cert_file: Path | None, key_file: Path | None,
               client_ca_file: Path | None = None, *, plaintext_beyond_loopback: bool = False) -> ServerTls | None:
    """The checked TLS material for `section`'s server on `host`; None to serve plaintext (loopback, or
    the explicit opt-out). FailedPrecondition naming the setting when a non-loopback host has none."""
    if cert_file is None and key_file is None and client_ca_file is None:
        if is_loopback(host) or plaintext_beyond_loopback:
            return None
        raise FailedPrecondition(
            f"refusing to serve plaintext on {host}: set {section}.tls_cert_file and {section}.tls_key_file "
            f"({env_name(section, 'tls_cert_file')}, {env_name(section, 'tls_key_file')}; `embedcar triton certs "
            f"--hosts NAME` makes a CA and certificates), bind 127.0.0.1, or set {section}.plaintext_beyond_loopback "
            "where TLS ends in a proxy in front of it")
    cert_pem, cert = pem.certificate(cert_file, f"{section}.tls_cert_file")
    key_pem, key = pem.private_key(key_file, f"{section}.tls_key_file")
    pem.check_pair(cert, key, f"{section}.tls_cert_file", cert_file, f"{section}.tls_key_file")
    ca_pem = pem.certificate(client_ca_file, f"{section}.tls_client_ca_file")[0] if client_ca_file else None
    assert cert_file is not None and key_file is not None  # pem.* raised otherwise
    return ServerTls(cert_file, key_file, client_ca_file, cert_pem, key_pem, ca_pem)
