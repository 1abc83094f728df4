"""The HTTP facade's connection protocol: httptools, except for a connection that opens with an
HTTP/2 upgrade offer (`Upgrade: h2c`), which h11 serves.

Every stock JDK HttpClient defaults to HTTP/2 and, on plain http, offers an h2c upgrade on the first
request of each connection, body included; LangChain4j's default transport (Solr's text-to-vector
module) is one. A server may ignore the offer and answer over HTTP/1.1, and h11 does, but uvicorn's
httptools protocol drops the body and answers 400 (uvicorn#2722, open). h11 costs about 0.4 ms more
CPU per request than httptools here, so only those connections get it: the first bytes of each
connection are read up to the end of its header block, and the protocol is chosen then.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Fast
except ImportError:  # httptools missing: h11 for every connection, as uvicorn itself would
    _Fast = H11Protocol  # type: ignore[misc,assignment]

MAX_HEAD = 64 * 1024  # past this without a blank line, httptools refuses the request itself
# The blank line ending a header block; httptools also takes bare LF line ends, so must this.
_HEAD_END = re.compile(rb"\r?\n\r?\n")


def offers_upgrade(head: bytes) -> bool:
    """True if a request's header block has an `Upgrade` header other than websocket."""
    for line in re.split(rb"\r?\n", head)[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"upgrade" and value.strip().lower() != b"websocket":
            return True
    return False


class UpgradeTolerantHttp(asyncio.Protocol):
    """Buffers a connection's first header block, then hands the connection to the chosen uvicorn
    protocol (built with the same arguments uvicorn passes, so it tracks, times and shuts the
    connection down as usual)."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._transport: asyncio.Transport | None = None
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        end = _HEAD_END.search(self._buffer)
        if end is None and len(self._buffer) < MAX_HEAD:
            return
        cls = H11Protocol if end is not None and offers_upgrade(self._buffer[:end.start()]) else _Fast
        protocol = cls(**self._kwargs)
        assert self._transport is not None
        protocol.connection_made(self._transport)
        self._transport.set_protocol(protocol)
        buffered, self._buffer = self._buffer, b""
        protocol.data_received(buffered)

    def connection_lost(self, exc: Exception | None) -> None:
        self._buffer = b""  # closed before a whole header block: no request to answer

    def eof_received(self) -> bool | None:
        return None  # close the transport
