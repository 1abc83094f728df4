"""API keys per tenant: stored only as SHA-256 digests, compared in constant time, never logged.

A key is at least MIN_KEY_CHARS characters (a short one can be guessed online; the `sha256:` form is a
digest, whose key we never see). A keys file that others may read or write, or that another user owns
(at mode 0600 too: they may change it), is refused: they could take a key or add one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping
from pathlib import Path

from inference.errors import EmbedcarError, InvalidInput, Unauthenticated
from inference.private_paths import read_private_text
from sidecar.settings import SidecarSettings

ANONYMOUS = "anonymous"
_SHA_PREFIX = "sha256:"
MIN_KEY_CHARS = 16

# How a caller sends its key, in the words of its transport: what a missing key's message tells it to do.
GRPC_KEY = "send metadata x-api-key"
HTTP_KEY = "send header Authorization: Bearer <key>, or x-api-key: <key>"
WEBSOCKET_KEY = "open the page with ?api_key=<key>, or send header Authorization: Bearer <key> or x-api-key: <key>"


class MissingKey(Unauthenticated):
    """No key came (a wrong one is a plain Unauthenticated): the message says how to send one."""


def missing_key(how: str) -> MissingKey:
    return MissingKey(f"missing API key ({how})")


def for_http(exc: EmbedcarError) -> EmbedcarError:
    """`exc` as an HTTP caller should read it: a missing key names the headers, not gRPC's metadata."""
    return missing_key(HTTP_KEY) if isinstance(exc, MissingKey) else exc


def digest(key: str) -> bytes:
    # surrogatepass: a key that is not valid Unicode is a wrong key, never an encoding error.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyRing:
    """tenant -> key digest. Empty ring = auth off (every caller is `anonymous`)."""

    def __init__(self, digests: Mapping[str, bytes]) -> None:
        self._entries = tuple((tenant, d) for tenant, d in digests.items())

    def __repr__(self) -> str:  # never show digests either
        return f"KeyRing(tenants={list(self.tenants)})"

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self._entries)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def tenant_for(self, key: str | None, *, how: str = GRPC_KEY) -> str:
        """The tenant owning `key`, or Unauthenticated (MissingKey without one, its message `how` to send
        one: GRPC_KEY, HTTP_KEY, WEBSOCKET_KEY). Compares against every entry, always."""
        if not self._entries:
            return ANONYMOUS
        if not key:
            raise missing_key(how)
        d = digest(key)
        found: str | None = None
        for tenant, stored in self._entries:
            if hmac.compare_digest(d, stored) and found is None:
                found = tenant
        if found is None:
            raise Unauthenticated("wrong API key")
        return found

    @classmethod
    def from_settings(cls, s: SidecarSettings) -> KeyRing:
        digests: dict[str, bytes] = {}
        for n, pair in enumerate(p.strip() for p in s.api_keys.split(",")):
            if not pair:
                continue
            tenant, sep, key = pair.partition("=")
            if not sep or not tenant.strip() or not key.strip():
                raise InvalidInput(f"api_keys entry {n + 1} is not tenant=key")
            digests[tenant.strip()] = _parse_key(key.strip(), f"api_keys entry {n + 1} (tenant {tenant.strip()})")
        if s.api_keys_file is not None:
            digests.update(parse_keys_file(s.api_keys_file))
        return cls(digests)


def _parse_key(value: str, where: str) -> bytes:
    """The digest of a key entry; `where` names the entry in errors (never its value)."""
    if value.startswith(_SHA_PREFIX):
        try:
            raw = bytes.fromhex(value[len(_SHA_PREFIX):])
        except ValueError as exc:
            raise InvalidInput(f"{where}: a sha256: key entry is not hex") from exc
        if len(raw) != 32:
            raise InvalidInput(f"{where}: a sha256: key entry is not 64 hex digits")
        return raw
    if len(value) < MIN_KEY_CHARS:
        raise InvalidInput(f"{where}: the key is shorter than {MIN_KEY_CHARS} characters "
                           "(e.g. `openssl rand -hex 16` makes one)")
    return digest(value)


def parse_keys_file(path: Path) -> dict[str, bytes]:
    """Lines `tenant key` or `tenant sha256:<hex>`; `#` comments and blank lines ignored. Refused where
    group or others may read or write it, or it belongs to another user than this one or root (checked on
    the file as opened)."""
    lines = read_private_text(path, "API keys file", chmod_hint="chmod 600 it (a mounted secret: defaultMode 0400)",
                              owner_hint=", who could change the keys: chown it to the user the sidecar runs as"
                              ).splitlines()
    out: dict[str, bytes] = {}
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            # Say which line, never what it holds: it may be a key.
            raise InvalidInput(f"{path}:{n}: expected `tenant key`")
        out[parts[0]] = _parse_key(parts[1], f"{path}:{n} (tenant {parts[0]})")
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, keys: KeyRing) -> None:
    """Refuse to listen beyond this machine without API keys."""
    if not is_loopback(host) and not keys.enabled:
        raise InvalidInput(f"refusing to bind {host} without API keys: set EMBEDCAR_SIDECAR_API_KEYS "
                           "or EMBEDCAR_SIDECAR_API_KEYS_FILE, or bind 127.0.0.1")
