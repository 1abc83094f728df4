"""Python client for the sidecar (sync `Client`, async `AsyncClient`), one gRPC channel each.

    with Client("127.0.0.1:50051", api_key=...) as c:
        r = c.embed(["oat milk", "rye"])   # r.embeddings: [2, 384] float32
        r = c.embed("oat milk")            # a str is one text: [1, 384]
        s = c.search("oat milk", k=5)      # s.hits[0][0].id, .score, .fields, .legs
        t = c.search(["oat mi"], mode="hybrid")  # FAISS + lexical prefix search, fused

A target is anything grpc dials: `host:port`, or `unix:/abs/path` (also `unix:///abs/path`) for the
sidecar's Unix socket (sidecar.uds_path) for same-host callers. Before a `unix:` target is dialled the
client checks that only the sidecar's user could have put the socket there (the key goes to whoever
listens): the socket belongs to `socket_owner` (default this process's user; root always passes) and
its folder is closed to everyone else, as the sidecar requires of it; else Unavailable. A sidecar on
another host serves TLS (sidecar/tls.py): pass `tls=ClientTls(ca_file=...)` (and a certificate and key
under mutual TLS).

`AsyncClient(target, stream=True)` sends the same calls as messages on one long-lived `Stream`
call instead of a unary call each: about half the round trip, for callers with a steady flow of
small requests (opened on first use, reopened on the next call after it fails).
Failures raise embedcar_client.errors types (Unauthenticated, Overloaded, InvalidInput, Unavailable,
DeadlineExceeded, Internal; the server's inference.errors are the same classes); Overloaded carries the
server's retry_after_s hint.

It is its own distribution, embedcar-client (client/ in the repository: `pip install ./client`): the
generated stubs, wire.py, the error types and its result types (results.py), so a search node needs
grpcio, protobuf and numpy, not the model stack (tests/test_client_standalone.py,
tests/test_client_package.py).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import pwd
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc
import numpy as np

from embedcar_client.errors import (
    DeadlineExceeded,
    EmbedcarError,
    InvalidInput,
    PayloadTooLarge,
    Unavailable,
    error_for_grpc,
)
from embedcar_client.private_paths import closed_folder_problem, user_text
from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_client.proto import embedcar_pb2_grpc  # generated, untyped: mypy treats it as Any
from embedcar_client.results import EmbedResult as EmbedResult  # re-exported: callers import the results from here
from embedcar_client.results import SearchHit as SearchHit
from embedcar_client.results import SearchResult as SearchResult
from embedcar_client.wire import API_KEY, RETRY_AFTER_KEY

# The stage and search-mode names come from the .proto rather than from the server's modules
# (sidecar.timings.STAGES, catalog.fusion.SearchMode), which the client does not import;
# tests/test_client_standalone.py holds them equal.
STAGES: tuple[str, ...] = tuple(f.name for f in pb.Timings.DESCRIPTOR.fields)
SEARCH_MODES: tuple[str, ...] = tuple(v.name.lower() for v in pb.SearchMode.DESCRIPTOR.values)
SEMANTIC = "semantic"

_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.max_send_message_length", -1)]
EMBED = "/embedcar.v1.Embedder/Embed"


def mode_label(mode: str) -> str:
    """The request's SearchMode label ("HYBRID") for a mode name in any case (a catalog.fusion.SearchMode
    is one too); InvalidInput, as the server's parse_mode, for anything else."""
    name = str(mode).strip().lower()
    if name not in SEARCH_MODES:
        raise InvalidInput(f"unknown search mode {str(mode)[:40]!r}; expected one of {', '.join(SEARCH_MODES)}")
    return name.upper()


def timings_of(t: pb.Timings) -> dict[str, int]:
    """A reply's Timings message as {stage: ns}."""
    return {k: int(getattr(t, k)) for k in STAGES}


def decode_embed(reply: pb.EmbedReply) -> EmbedResult:
    # float32 replies are a zero-copy, read-only view over the reply bytes.
    dtype = "<f2" if reply.dtype == pb.FLOAT16 else "<f4"
    emb = np.frombuffer(reply.embeddings, dtype=dtype).reshape(reply.rows, reply.dim)
    return EmbedResult(emb.astype(np.float32, copy=False), reply.model, list(reply.cache_hits),
                       list(reply.truncated), timings_of(reply.timings), reply.backend)


def decode_search(reply: pb.SearchReply) -> SearchResult:
    hits = [[SearchHit(h.id, float(h.score), dict(h.fields), tuple(h.legs), tuple(h.matched)) for h in hl.hits]
            for hl in reply.results]
    return SearchResult(hits, reply.model, reply.index_version, list(reply.cache_hits), timings_of(reply.timings),
                        reply.backend)


Texts = str | Sequence[str]  # what embed and search take: a str is one text, not its characters


def text_list(texts: Texts) -> list[str]:
    """`texts` as the request's list: a str is one text (a str is also a Sequence[str], of its letters)."""
    return [texts] if isinstance(texts, str) else list(texts)


def embed_request(texts: Texts, float16: bool, model: str | None = None) -> pb.EmbedRequest:
    return pb.EmbedRequest(texts=text_list(texts), float16=float16, model=model or "")


def search_request(texts: Texts, k: int, department: str | None, aisle: str | None,
                   mode: str = SEMANTIC, model: str | None = None,
                   filters: Mapping[str, str] | None = None) -> pb.SearchRequest:
    """`filters`: field -> value on the index's filter fields; `department` / `aisle` are shorthands."""
    return pb.SearchRequest(texts=text_list(texts), k=k, department=department or "", aisle=aisle or "",
                            mode=mode_label(mode), model=model or "", filters=dict(filters or {}))


def from_grpc(code: grpc.StatusCode, details: str | None, retry_after_s: float | None = None) -> EmbedcarError:
    """The project error for a gRPC failure seen by a client."""
    cls = error_for_grpc(code.name)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details and "larger than max" in details:
        cls = PayloadTooLarge  # grpc's own max-message-size check: the request, not the server, is at fault
    if code == grpc.StatusCode.CANCELLED:  # see Shed: gRPC's own refusal carries no message of ours
        details = f"refused in the transport: too many calls waiting ({details or 'cancelled'})"
    return cls(details or code.name.lower(), retry_after_s=retry_after_s)


def map_rpc_error(exc: grpc.RpcError) -> EmbedcarError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    retry: float | None = None
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == RETRY_AFTER_KEY:
            try:
                retry = float(value)
            except ValueError:
                retry = None
    return from_grpc(code, details, retry)


class _RpcErrors:
    """`with RPC_ERRORS:` re-raises a failed call's grpc.RpcError as the project's error (sync and async)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, grpc.RpcError):
            raise map_rpc_error(exc) from None


RPC_ERRORS = _RpcErrors()


_STATUS_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def status_error(code: int, message: str, retry_after_s: float | None = None) -> EmbedcarError:
    """The project error for a gRPC status given by its number (a stream's error reply, a record)."""
    return from_grpc(_STATUS_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN), message, retry_after_s)


def stream_error(err: pb.StreamError) -> EmbedcarError:
    """The project error for a Stream request's error reply (as the same unary call would raise)."""
    return status_error(err.code, err.message, err.retry_after_s or None)


@dataclass(slots=True)
class _OpenStream:
    call: Any
    reader: asyncio.Task[None] | None = None
    pending: dict[int, asyncio.Future[pb.StreamReply]] = field(default_factory=dict)


class StreamSession:
    """Requests as messages on one `Stream` call: each gets an id, and a reader task hands every
    reply to the request waiting for that id. One write at a time (grpc.aio's rule for a call)."""

    def __init__(self, stub: Any, metadata: Any) -> None:
        self._stub = stub
        self._metadata = metadata
        self._open: _OpenStream | None = None
        self._ids = itertools.count(1)
        self._writing = asyncio.Lock()

    async def request(self, req: pb.StreamRequest, timeout_s: float | None) -> pb.StreamReply:
        """Send `req` (its id and timeout set here) and wait for its reply; an error reply raises."""
        req.id = rid = next(self._ids)
        if timeout_s is not None:
            req.timeout_ms = max(1, math.ceil(timeout_s * 1000))
        stream = self._stream()
        fut: asyncio.Future[pb.StreamReply] = asyncio.get_running_loop().create_future()
        stream.pending[rid] = fut
        try:
            async with asyncio.timeout(timeout_s):
                async with self._writing:
                    try:
                        with RPC_ERRORS:
                            await stream.call.write(req)
                    except asyncio.InvalidStateError:  # the call has ended, its reader may not know yet
                        raise await self._ended(stream) from None
                reply = await fut
        except TimeoutError:
            raise DeadlineExceeded(f"no reply within {timeout_s} s") from None
        finally:
            stream.pending.pop(rid, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: a write that failed with the stream leaves it unread
        if reply.WhichOneof("result") == "error":
            raise stream_error(reply.error)
        return reply

    def _stream(self) -> _OpenStream:
        if self._open is None:
            self._open = _OpenStream(self._stub.Stream(metadata=self._metadata))
            self._open.reader = asyncio.create_task(self._read(self._open))
        return self._open

    async def _read(self, stream: _OpenStream) -> None:
        try:
            while True:
                reply = await stream.call.read()
                if reply is grpc.aio.EOF:
                    raise Unavailable("the sidecar ended the stream")
                fut = stream.pending.get(reply.id)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except asyncio.CancelledError:
            self._fail(stream, Unavailable("the stream was closed"))
            raise
        except Exception as exc:
            self._fail(stream, map_rpc_error(exc) if isinstance(exc, grpc.RpcError) else
                       exc if isinstance(exc, EmbedcarError) else Unavailable(f"stream failed: {exc!r}"))

    async def _ended(self, stream: _OpenStream) -> EmbedcarError:
        code, details = await stream.call.code(), await stream.call.details()
        err = Unavailable("the sidecar ended the stream") if code == grpc.StatusCode.OK else from_grpc(code, details)
        self._fail(stream, err)
        return err

    def _fail(self, stream: _OpenStream, err: EmbedcarError) -> None:
        if self._open is stream:
            self._open = None  # the next request opens a new stream
        for fut in stream.pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def close(self) -> None:
        stream, self._open = self._open, None
        if stream is not None:
            stream.call.cancel()
            if stream.reader is not None:
                await asyncio.gather(stream.reader, return_exceptions=True)


def unix_socket_path(target: str) -> Path | None:
    """The socket file a `unix:` target names (`unix:path`, `unix:///abs/path`), or None for another target."""
    if not target.startswith("unix:"):
        return None
    rest = target.removeprefix("unix:")
    return Path(rest[2:] if rest.startswith("//") else rest)


def owner_uid(owner: int | str | None) -> int:
    """A user given by number or name as its uid; None = this process's user."""
    if owner is None:
        return os.getuid()
    if isinstance(owner, int):
        return owner
    try:
        return pwd.getpwnam(owner).pw_uid
    except KeyError:
        raise InvalidInput(f"socket_owner {owner!r}: no such user on this machine") from None


def check_unix_target(target: str, socket_owner: int | str | None = None) -> None:
    """Unavailable where someone other than `socket_owner` (or root) could be listening on a `unix:` target:
    the socket belongs to another user (one who bound the name first, in a folder anyone may write to), or
    its folder lets others put a socket there. A socket not there yet passes on its folder alone: the
    sidecar may start later. Other targets pass untouched."""
    path = unix_socket_path(target)
    if path is None:
        return
    uid = owner_uid(socket_owner)
    trusted = (uid, 0)
    expected = "this user" if uid == os.getuid() else user_text(uid)
    hint = " (a sidecar that runs as another user: pass socket_owner=<that user>)" if uid == os.getuid() else ""
    try:
        st: os.stat_result | None = path.stat()  # through a link, as gRPC connects: the socket it reaches
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise Unavailable(f"cannot check Unix socket {path}: {exc.strerror or exc}") from exc
    if st is not None and not stat.S_ISSOCK(st.st_mode):
        raise Unavailable(f"refusing to connect to {path}: it is not a socket")
    if st is not None and st.st_uid not in trusted:
        raise Unavailable(f"refusing to connect to Unix socket {path}: it belongs to {user_text(st.st_uid)}, not "
                          f"{expected} or root: another user may have bound it first and would receive this "
                          f"client's API key{hint}")
    folders = dict.fromkeys((path.absolute().parent, Path(os.path.realpath(path)).parent))
    for folder in folders:
        while not os.path.lexists(folder) and folder != folder.parent:
            folder = folder.parent  # not made yet: whoever may create it decides
        if (problem := closed_folder_problem(folder, trusted)) is not None:
            raise Unavailable(f"refusing to connect to Unix socket {path}: {problem}, so another user could put a "
                              f"socket of theirs there and receive this client's API key{hint}")


@dataclass(frozen=True, slots=True)
class ClientTls:
    """TLS to a sidecar beyond loopback: the CA that signed its certificate; a certificate and key where
    it asks for one (mutual TLS); `server_name` where the target's name is not in its certificate."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes(),
            private_key=self.key_file.read_bytes() if self.key_file else None,
            certificate_chain=self.cert_file.read_bytes() if self.cert_file else None)

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


class _Calls:
    """What both clients share: target, key metadata, and the generated stub (the method table),
    which builds the same multi-callables on a sync or an aio channel."""

    def __init__(self, target: str, api_key: str | None, channel: Any) -> None:
        self.target = target
        self._metadata = ((API_KEY, api_key),) if api_key else None
        self._channel = channel
        self._stub = embedcar_pb2_grpc.EmbedderStub(channel)


class AsyncClient(_Calls):
    def __init__(self, target: str, *, api_key: str | None = None, stream: bool = False,
                 tls: ClientTls | None = None, socket_owner: int | str | None = None) -> None:
        """`socket_owner`: for a `unix:` target, the user the sidecar runs as (uid or name; default this
        process's user): check_unix_target."""
        check_unix_target(target, socket_owner)
        channel = (grpc.aio.secure_channel(target, tls.credentials(), options=_OPTIONS + tls.options()) if tls
                   else grpc.aio.insecure_channel(target, options=_OPTIONS))
        super().__init__(target, api_key, channel)
        self._session = StreamSession(self._stub, self._metadata) if stream else None

    async def embed(self, texts: Texts, *, float16: bool = False, model: str | None = None,
                    timeout_s: float | None = None) -> EmbedResult:
        req = embed_request(texts, float16, model)
        if self._session is not None:
            reply = await self._session.request(pb.StreamRequest(embed=req), timeout_s)
            return decode_embed(reply.embed)
        with RPC_ERRORS:
            reply = await self._stub.Embed(req, timeout=timeout_s, metadata=self._metadata)
        return decode_embed(reply)

    async def search(self, texts: Texts, *, k: int = 10, department: str | None = None,
                     aisle: str | None = None, mode: str = SEMANTIC, model: str | None = None,
                     filters: Mapping[str, str] | None = None, timeout_s: float | None = None) -> SearchResult:
        req = search_request(texts, k, department, aisle, mode, model, filters)
        if self._session is not None:
            return decode_search((await self._session.request(pb.StreamRequest(search=req), timeout_s)).search)
        with RPC_ERRORS:
            reply = await self._stub.Search(req, timeout=timeout_s, metadata=self._metadata)
        return decode_search(reply)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class Client(_Calls):
    def __init__(self, target: str, *, api_key: str | None = None, tls: ClientTls | None = None,
                 socket_owner: int | str | None = None) -> None:
        """`socket_owner`: for a `unix:` target, the user the sidecar runs as (uid or name; default this
        process's user): check_unix_target."""
        check_unix_target(target, socket_owner)
        channel = (grpc.secure_channel(target, tls.credentials(), options=_OPTIONS + tls.options()) if tls
                   else grpc.insecure_channel(target, options=_OPTIONS))
        super().__init__(target, api_key, channel)

    def embed(self, texts: Texts, *, float16: bool = False, model: str | None = None,
              timeout_s: float | None = None) -> EmbedResult:
        """`texts`: a list, or one str (one row back). `model`: a served model's name or version id (None =
        the sidecar's default)."""
        with RPC_ERRORS:
            reply = self._stub.Embed(embed_request(texts, float16, model), timeout=timeout_s, metadata=self._metadata)
        return decode_embed(reply)

    def search(self, texts: Texts, *, k: int = 10, department: str | None = None,
               aisle: str | None = None, mode: str = SEMANTIC, model: str | None = None,
               filters: Mapping[str, str] | None = None, timeout_s: float | None = None) -> SearchResult:
        """`filters`: field -> value on the index's filter fields (`department` / `aisle`: shorthands)."""
        with RPC_ERRORS:
            reply = self._stub.Search(search_request(texts, k, department, aisle, mode, model, filters),
                                      timeout=timeout_s, metadata=self._metadata)
        return decode_search(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
