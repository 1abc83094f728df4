"""PEM certificates and private keys, read and checked with `cryptography` before anything listens or
connects: a wrong file is a start-up error that names the setting and the file, never its content
(the library's own messages may quote the input, so they are not passed on)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference.errors import FailedPrecondition

# Builds the error for a setting left empty: (setting name, what it should hold) -> error.
Missing = Callable[[str, str], FailedPrecondition]


def _missing(setting_name: str, what: str) -> FailedPrecondition:
    return FailedPrecondition(f"{setting_name} is not set: {what}")


def read_pem(path: Path | None, setting_name: str, missing: Missing = _missing) -> bytes:
    if path is None:
        raise missing(setting_name, "a PEM file (`embedcar triton certs` writes a CA and certificates)")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"{setting_name} {path}: cannot read it ({exc.strerror or exc})") from None


def certificate(path: Path | None, setting_name: str, missing: Missing = _missing) -> tuple[bytes, Any]:
    """(PEM bytes, parsed x509 certificate)."""
    from cryptography import x509

    pem = read_pem(path, setting_name, missing)
    try:
        return pem, x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise FailedPrecondition(f"{setting_name} {path}: not a PEM certificate") from None


def private_key(path: Path | None, setting_name: str, missing: Missing = _missing) -> tuple[bytes, Any]:
    """(PEM bytes, parsed key); unencrypted keys only (a service starts without a person to ask)."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    pem = read_pem(path, setting_name, missing)
    try:
        return pem, load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        raise FailedPrecondition(f"{setting_name} {path}: not an unencrypted PEM private key") from None


def check_pair(cert: Any, key: Any, cert_name: str, cert_path: Path | None, key_name: str) -> None:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    def spki(k: Any) -> bytes:
        return bytes(k.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo))

    if spki(cert.public_key()) != spki(key.public_key()):
        raise FailedPrecondition(f"{key_name} does not belong to {cert_name} {cert_path}")


def check_issued_by(cert: Any, ca: Any, cert_name: str, cert_path: Path | None, ca_name: str,
                    ca_path: Path | None) -> None:
    try:
        cert.verify_directly_issued_by(ca)
    except Exception as exc:  # InvalidSignature is not a ValueError
        raise FailedPrecondition(f"{cert_name} {cert_path} was not issued by the CA in {ca_name} {ca_path} "
                                 f"({type(exc).__name__})") from None
