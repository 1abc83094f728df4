"""`embedcar triton certs`: a private CA and, per machine of a hardened Triton pool, its `triton.tls_dir`.

    <out>/ca.pem, ca.key               the pool's CA (kept: a later run adds hosts with the same CA)
    <out>/client_key.txt               the shared key for inference/health/metadata (sidecars, job)
    <out>/operator_key.txt             the operator key (statistics, trace, logging, ...)
    <out>/<host>/                      a Triton host's tls_dir: ca.pem, server.pem + server.key (SAN = the
                                       host name or address, localhost and 127.0.0.1: the container's own
                                       healthcheck and the launcher's readiness), client_key.txt, operator_key.txt
    <out>/<client>/                    a client's tls_dir (the sidecars, the catalog job): ca.pem, client.pem +
                                       client.key, client_key.txt; never the operator key (copy it in where
                                       a client reads statistics: the load test)

Private keys and the key files are written 0600, atomically (a temporary name, then rename), so a
reader never sees half a key and nobody else can read one at any moment. The CA and the two keys are
kept; each run rewrites the named folders from them.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.errors import InvalidInput
from inference.triton.tls import (
    CA_CERT,
    CLIENT_CERT,
    CLIENT_KEY,
    CLIENT_KEY_FILE,
    OPERATOR_KEY_FILE,
    SERVER_CERT,
    SERVER_KEY,
    new_key,
)

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}")
CA_DAYS = 3650
LEAF_DAYS = 825  # the longest validity common TLS clients accept for a leaf certificate


CA_KEY = "ca.key"


@dataclass(frozen=True, slots=True)
class PoolFiles:
    ca_cert: Path
    hosts: dict[str, tuple[Path, Path]]  # host -> (certificate, key), in dirs[host]
    clients: dict[str, tuple[Path, Path]]
    client_key: Path
    operator_key: Path
    dirs: dict[str, Path]  # host or client -> its triton.tls_dir


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)  # created with its mode: never readable
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)  # the umask may have narrowed it; never widened beyond `mode`
    finally:
        os.close(fd)
    tmp.replace(path)


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "embedcar"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: Sequence[str]) -> list[Any]:
    from cryptography import x509

    out: list[Any] = []
    for n in dict.fromkeys(names):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def _load_or_make_ca(out: Path) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    cert_path, key_path = out / CA_CERT, out / CA_KEY
    if cert_path.exists() and key_path.exists():
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), \
            load_pem_private_key(key_path.read_bytes(), password=None)
    key = _new_key()
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(_name("embedcar triton pool CA")).issuer_name(_name("embedcar triton pool CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, cert.public_bytes(_pem()), 0o644)
    return cert, key


def _pem() -> Any:
    from cryptography.hazmat.primitives.serialization import Encoding

    return Encoding.PEM


def _leaf(ca_cert: Any, ca_key: Any, name: str, sans: Sequence[str], *, server: bool) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _new_key()
    now = dt.datetime.now(dt.UTC)
    # A host's certificate also serves as a client certificate (its own readiness checks under mutual TLS).
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server \
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_san(sans)), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def _check_names(names: Sequence[str], what: str) -> None:
    for n in names:
        if not _NAME_RE.fullmatch(n) or ".." in n:
            raise InvalidInput(f"{what} {n!r}: expected a host name or an IP address (letters, digits, . -)")


def make_pool_certs(out: Path, hosts: Sequence[str], clients: Sequence[str] = ("sidecar",)) -> PoolFiles:
    """The CA and the two keys (kept when `out` has them), and a tls_dir per host and per client."""
    if not hosts:
        raise InvalidInput("give at least one Triton host name (--hosts a,b)")
    _check_names(hosts, "host")
    _check_names(clients, "client")
    if set(hosts) & set(clients) or {CA_CERT, CA_KEY} & {*hosts, *clients}:
        raise InvalidInput(f"host and client names must differ from each other and from {CA_CERT} and {CA_KEY}")
    out.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _load_or_make_ca(out)
    keys = {}
    for name in (CLIENT_KEY_FILE, OPERATOR_KEY_FILE):
        path = keys[name] = out / name
        if not path.exists():
            _write(path, (new_key() + "\n").encode(), 0o600)
    made: dict[str, dict[str, tuple[Path, Path]]] = {"hosts": {}, "clients": {}}
    dirs = {}
    for kind, names in (("hosts", hosts), ("clients", clients)):
        server = kind == "hosts"
        for n in names:
            folder = dirs[n] = out / n
            folder.mkdir(exist_ok=True)
            cert, key = _leaf(ca_cert, ca_key, n, [n, "localhost", "127.0.0.1"] if server else [n], server=server)
            cert_path, key_path = folder / (SERVER_CERT if server else CLIENT_CERT), \
                folder / (SERVER_KEY if server else CLIENT_KEY)
            _write(key_path, _key_pem(key), 0o600)
            _write(cert_path, cert.public_bytes(_pem()), 0o644)
            _write(folder / CA_CERT, (out / CA_CERT).read_bytes(), 0o644)
            # Triton needs the operator key to open that group; a client gets it only by hand.
            for name in (CLIENT_KEY_FILE, OPERATOR_KEY_FILE) if server else (CLIENT_KEY_FILE,):
                _write(folder / name, keys[name].read_bytes(), 0o600)
            made[kind][n] = (cert_path, key_path)
    return PoolFiles(out / CA_CERT, made["hosts"], made["clients"], keys[CLIENT_KEY_FILE],
                     keys[OPERATOR_KEY_FILE], dirs)
