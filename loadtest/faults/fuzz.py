"""Property-based fuzzing of every surface a client can reach: no INTERNAL/UNKNOWN/5xx, no crash.

Hypothesis strategies drive four surfaces of a real sidecar (with an API key and a real index) and
the demo server in front of it:
  grpc-raw   Embed and Search with raw bytes: random, and real messages cut, extended or bit-flipped
  grpc-msg   well-formed EmbedRequest / SearchRequest with hostile field values and metadata
  http       POST /v1/embeddings as raw bytes: JSON of any shape, surrogate escapes, deep nesting,
             huge numbers, UTF-8 BOM / UTF-16 / UTF-32 / Latin-1 / invalid UTF-8 bodies, and lying or
             odd content-type, content-length, transfer-encoding and authorization headers
  demo-ws    frames on one websocket (reconnecting when the server closes it): keystrokes with
             hostile fields, any text, binary, invalid UTF-8 in text frames, nesting, oversize
Every case's answer is counted per surface (gRPC code, HTTP status, websocket reply or close code);
a case breaks the rule if it gets INTERNAL/UNKNOWN/UNAVAILABLE/DATA_LOSS, a 5xx, no answer in 30 s,
an `internal`/`unavailable` error or a 1006/1011 close. After each surface a normal call must still
work. The property functions (`fuzz_*`) take the target and an example count, so tests/test_fuzz.py
runs the same ones with a small count against the test fixtures.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from hypothesis import HealthCheck, Phase, example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from embedcar_client.proto import embedcar_pb2 as pb
from embedcar_client.wire import API_KEY, SERVICE
from embedcar_settings import Settings
from loadtest.faults.result import ScenarioResult

NAME = "fuzz"
TITLE = ("Property-based fuzzing (hypothesis) of gRPC Embed/Search, POST /v1/embeddings and the demo "
         "websocket: no INTERNAL/UNKNOWN/5xx, no crash")

# Cases per surface: the full run totals 10,500 (the issue asks >= 10,000), quick a few hundred.
FULL = {"grpc-raw": 2500, "grpc-msg": 3000, "http": 3000, "demo-ws": 2000}
QUICK = {"grpc-raw": 60, "grpc-msg": 60, "http": 80, "demo-ws": 60}
TIMEOUT_S = 30.0  # per case: far beyond any honest answer, so only a hang trips it

BAD_GRPC = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNAVAILABLE", "UNIMPLEMENTED", "DEADLINE_EXCEEDED"})
BAD_WS_ERRORS = frozenset({"internal", "unknown", "unavailable", "deadline_exceeded"})
OK_WS_CLOSES = frozenset({1000, 1007, 1008, 1009})  # normal, invalid UTF-8, policy (cap/auth), too big


# --- bookkeeping ----------------------------------------------------------------------------------
@dataclass
class Tally:
    """Answers per surface, and the cases that broke the rule (shortened, for the report)."""

    counts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    bad: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def add(self, surface: str, outcome: str, ok: bool, case: object) -> None:
        self.counts[surface][outcome] += 1
        if not ok and len(self.bad[surface]) < 20:
            self.bad[surface].append(f"{outcome}: {ascii(case)[:300]}")

    def cases(self, surface: str | None = None) -> int:
        if surface is not None:
            return sum(self.counts[surface].values())
        return sum(sum(c.values()) for c in self.counts.values())

    def n_bad(self) -> int:
        return sum(len(v) for v in self.bad.values())


def _hyp(n: int) -> Callable[[Any], Any]:
    # derandomize: a fixed, reproducible stream of cases. No shrinking: a bad case is recorded
    # (with its input) rather than raised, so one bug cannot hide the rest of the histogram.
    return hsettings(max_examples=n, database=None, deadline=None, derandomize=True,
                     phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck),
                     print_blob=False)


# --- shared strategies --------------------------------------------------------------------------
def _weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of `choices`, picked in proportion to its weight."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


SPECIAL_TEXTS = [
    "", " ", "\t\n\r", "\x00", "\x00milk", "\u200b", "\ufeff", "\u202emilk", "milk", "oat milk 2%",
    "🥛" * 50, "\ufdfa" * 600,  # NFKC turns each of these into 18 characters
    "\u0301" * 300, "𝔪𝔦𝔩𝔨", "a " * 3000, "x" * 10_000, "x" * 10_001, "é" * 10_001,
    "<script>alert(1)</script>", "' OR 1=1 --", "%s%n%x", "{{7*7}}", "\\ud800",
]
DEPARTMENTS = ["", "dairy eggs", "produce", "frozen", "snacks", "bakery", "no such department"]

texts = st.one_of(
    st.text(max_size=40),
    st.text(min_size=1, max_size=300),  # any Unicode except lone surrogates (protobuf refuses those)
    st.sampled_from(SPECIAL_TEXTS),
)
# Lone surrogates: only JSON escapes and the websocket can carry these (and must be refused).
surrogate_texts = st.lists(st.one_of(st.characters(categories=["Cs"]), st.characters()), min_size=1,
                           max_size=12).map("".join)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30), surrogate_texts)
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                              max_size=4),
                           max_leaves=10)

embed_requests = st.builds(pb.EmbedRequest, texts=st.lists(texts, max_size=8), float16=st.booleans())
search_requests = st.builds(
    pb.SearchRequest, texts=st.lists(texts, max_size=4),
    k=st.one_of(st.integers(0, 120), st.integers(0, 2**32 - 1)),
    department=st.one_of(st.sampled_from(DEPARTMENTS), st.text(max_size=20)),
    aisle=st.one_of(st.sampled_from(["", "yogurt", "fresh fruits"]), st.text(max_size=20)),
    filters=st.dictionaries(st.one_of(st.sampled_from(["department", "AISLE", "brand"]), st.text(max_size=12)),
                            st.one_of(st.sampled_from(DEPARTMENTS), st.text(max_size=20)), max_size=3))


@st.composite
def _mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    data = bytearray(draw(base))
    how = draw(st.sampled_from(["flip", "cut", "append", "splice"]))
    if how == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    elif how == "cut":
        del data[draw(st.integers(0, len(data))):]
    elif how == "append":
        data += draw(st.binary(min_size=1, max_size=64))
    else:
        i = draw(st.integers(0, len(data)))
        data[i:i] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


_messages = st.one_of(embed_requests, search_requests).map(lambda m: m.SerializeToString())
raw_payloads = st.one_of(st.binary(max_size=2048), _messages, _mutated(_messages))


def _metadata(api_key: str | None) -> st.SearchStrategy[tuple[tuple[str, str], ...] | None]:
    # gRPC refuses non-printable metadata values on the client, so hostile keys stay printable ASCII.
    wrong = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=80)
    if api_key is None:
        return st.one_of(st.none(), wrong.map(lambda k: ((API_KEY, k),)))
    good = ((API_KEY, api_key),)
    return st.one_of(st.just(good), st.just(good), st.just(good), st.none(), wrong.map(lambda k: ((API_KEY, k),)))


# --- gRPC -------------------------------------------------------------------------------------------
def _grpc_outcome(call: Any, payload: bytes, metadata: Any) -> str:
    try:
        call(payload, timeout=TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        return code.name if code is not None else "UNKNOWN"
    return "OK"


@contextlib.contextmanager
def _raw_calls(target: str) -> Iterator[dict[str, Any]]:
    """Embed and Search multi-callables that send and return bytes as they are."""
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(target, options=options) as channel:
        yield {m: channel.unary_unary(f"/{SERVICE}/{m}") for m in ("Embed", "Search")}


def fuzz_grpc_raw(target: str, n: int, tally: Tally, *, api_key: str | None = None) -> None:
    """Embed and Search with raw bytes; with `api_key`, the valid key (the bytes are what is fuzzed)."""
    metadata = ((API_KEY, api_key),) if api_key else None
    with _raw_calls(target) as calls:

        @_hyp(n)
        @given(method=st.sampled_from(sorted(calls)), payload=raw_payloads)
        @example(method="Embed", payload=b"")
        @example(method="Search", payload=b"\xff" * 11)
        @example(method="Embed", payload=b"\x0a\x03\xed\xa0\x80")  # a UTF-8-encoded lone surrogate
        @example(method="Search", payload=b"\x10\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")  # 10-byte varint k
        def prop(method: str, payload: bytes) -> None:
            outcome = _grpc_outcome(calls[method], payload, metadata)
            tally.add("grpc-raw", f"{method} {outcome}", outcome not in BAD_GRPC, (method, payload[:80]))

        prop()


def fuzz_grpc_messages(target: str, n: int, tally: Tally, *, api_key: str | None = None) -> None:
    """Well-formed EmbedRequest / SearchRequest with hostile field values, and hostile metadata."""
    with _raw_calls(target) as calls:

        @_hyp(n)
        @given(msg=st.one_of(embed_requests, search_requests), metadata=_metadata(api_key))
        def prop(msg: Any, metadata: Any) -> None:
            method = "Embed" if isinstance(msg, pb.EmbedRequest) else "Search"
            outcome = _grpc_outcome(calls[method], msg.SerializeToString(), metadata)
            tally.add("grpc-msg", f"{method} {outcome}", outcome not in BAD_GRPC, (method, str(msg)[:200]))

        prop()


def grpc_still_serves(target: str, api_key: str | None) -> bool:
    metadata = ((API_KEY, api_key),) if api_key else None
    with _raw_calls(target) as calls:
        ok = _grpc_outcome(calls["Embed"], pb.EmbedRequest(texts=["still serving"]).SerializeToString(), metadata)
    return ok == "OK"


# --- HTTP -------------------------------------------------------------------------------------------
ENCODINGS = ["utf-8", "utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1"]
CONTENT_TYPES = [b"application/json", b"application/json; charset=utf-8", b"application/json; charset=utf-16",
                 b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x", b"*/*",
                 b""]
ALLOWED = ["input", "model", "encoding_format", "user"]
SPECIAL_BODIES = [
    b'{"input": "\\ud800"}', b'{"input": ["ok", "\\udfff"]}', b'{"input": "\\ud83e\\udd5b"}',
    b'{"\\ud800": 1, "input": "x"}', b'{"input": "x", "model": "\\udc00"}', b'{"input": "x"}{"input": "y"}',
    b"", b"null", b"[]", b'"input"', b'{"input": "a"} trailing', b'\xef\xbb\xbf{"input": "a"}',
    b'\xff\xfe{\x00}\x00', b'{"input": NaN}', b'{"input": "a", "encoding_format": ["float"]}',
    b'{"input": "a", "encoding_format": {"x": 1}}', b'{"input": "' + b"\\u0000" * 100 + b'"}',
]

_docs = st.one_of(
    st.fixed_dictionaries(
        {"input": st.one_of(texts, st.lists(texts, max_size=8), surrogate_texts, st.lists(surrogate_texts, max_size=3),
                            json_values, st.lists(st.integers(), max_size=8))},
        optional={"model": st.one_of(st.text(max_size=20), json_values),
                  "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), json_values),
                  "user": st.one_of(st.text(max_size=20), json_values)}),
    st.dictionaries(st.one_of(st.sampled_from(ALLOWED), st.text(max_size=12), surrogate_texts), json_values,
                    max_size=6),
    json_values,
)


@st.composite
def _json_bodies(draw: st.DrawFn) -> bytes:
    text = json.dumps(draw(_docs), ensure_ascii=draw(st.booleans()))
    codec = draw(st.sampled_from(ENCODINGS))
    return text.encode(codec, "replace" if codec == "latin-1" else "surrogatepass")


# Plausible requests, so a good share gets past parsing into auth, validation and the model.
_plausible = st.fixed_dictionaries(
    {"input": st.one_of(texts, st.lists(texts, min_size=1, max_size=4))},
    optional={"model": st.text(max_size=20), "encoding_format": st.sampled_from(["float", "base64"])},
).map(lambda d: json.dumps(d).encode())

http_bodies = _weighted(
    (8, _plausible),
    (4, _json_bodies()),
    (1, _mutated(_json_bodies())),
    (1, st.binary(max_size=1024)),
    (1, st.sampled_from(SPECIAL_BODIES)),
    (1, st.one_of(
        st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(1, 100_000).map(lambda n: b'{"input": ' + b"[" * n + b'"x"' + b"]" * n + b"}"),
        st.integers(1, 50_000).map(lambda n: b'{"input": "a", "user": ' + b'{"a":' * n + b"1" + b"}" * n + b"}"),
        st.integers(4000, 20_000).map(lambda n: b'{"input": "a", "model": ' + b"9" * n + b"}"),  # over int's cap
    )),
)

# Raw header bytes: no CR/LF (that would be a different request), except on purpose below.
# Mostly what a parser accepts (visible ASCII, spaces, obs-text), so requests get past it to the app.
_header_values = _weighted(
    (4, st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                max_size=64).map(lambda t: t.encode("latin-1"))),
    (1, st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))))
_header_names = st.one_of(
    st.sampled_from([b"Accept", b"Accept-Encoding", b"Content-Encoding", b"Expect", b"User-Agent", b"X-Api-Key",
                     b"Authorization", b"Content-Type", b"X-Forwarded-For", b"Cookie"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_0123456789", min_size=1, max_size=20).map(str.encode),
)
FRAMINGS = ["exact"] * 12 + ["absent", "smaller", "larger", "over-limit", "garbage", "duplicate", "chunked",
                            "bad-chunked", "bare-lf"]
_HALF_CLOSE = frozenset({"larger", "garbage", "duplicate", "bad-chunked"})  # the server may wait for more


def _auth_headers(api_key: str | None) -> st.SearchStrategy[list[bytes]]:
    key = (api_key or "no-key-configured").encode()
    good = [[b"Authorization: Bearer " + key], [b"x-api-key: " + key], [b"authorization: bEaReR   " + key + b"  "]]
    return _weighted((8, st.sampled_from(good)), (2, st.one_of(
        st.just([]),
        _header_values.map(lambda v: [b"Authorization: Bearer " + v]),
        _header_values.map(lambda v: [b"Authorization: Basic " + v]),
        _header_values.map(lambda v: [b"Authorization: " + v]),
        _header_values.map(lambda v: [b"x-api-key: " + v]),
        st.just([b"Authorization: Bearer", b"x-api-key:"]),
        st.just([b"x-api-key: wrong", b"Authorization: Bearer " + key]),
    )))


@dataclass(frozen=True, slots=True)
class HttpCase:
    request: bytes
    framing: str

    @property
    def half_close(self) -> bool:
        return self.framing in _HALF_CLOSE


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, i = b"", 0
    for size in sizes:
        if i >= len(body):
            break
        part = body[i:i + size]
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
        i += size
    if i < len(body):
        out += f"{len(body) - i:x}\r\n".encode() + body[i:] + b"\r\n"
    return out + b"0\r\n\r\n"


@st.composite
def http_cases(draw: st.DrawFn, api_key: str | None) -> HttpCase:
    body = draw(http_bodies)
    framing = draw(st.sampled_from(FRAMINGS))
    lines = [b"POST /v1/embeddings HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    ctype = draw(st.one_of(st.sampled_from(CONTENT_TYPES), st.none(), _header_values))
    if ctype is not None:
        lines.append(b"Content-Type: " + ctype)
    lines += draw(_auth_headers(api_key))
    lines += [name + b": " + value for name, value in draw(st.lists(st.tuples(_header_names, _header_values),
                                                                     max_size=3))]
    n = len(body)
    if framing in ("exact", "bare-lf"):
        lines.append(b"Content-Length: %d" % n)
    elif framing == "smaller":
        lines.append(b"Content-Length: %d" % draw(st.integers(0, max(0, n - 1))))
    elif framing == "larger":
        lines.append(b"Content-Length: %d" % (n + draw(st.integers(1, 4096))))
    elif framing == "over-limit":
        lines.append(b"Content-Length: %d" % draw(st.integers(64 << 20, 10**18)))
    elif framing == "garbage":
        lines.append(b"Content-Length: " + draw(st.one_of(
            st.sampled_from([b"-1", b"abc", b"1e3", b" 12", b"\xb2", b"0x10", b"99999999999999999999999999", b""]),
            _header_values)))
    elif framing == "duplicate":
        lines += [b"Content-Length: %d" % n, b"Content-Length: %d" % draw(st.integers(0, n + 10))]
    elif framing == "chunked":
        lines.append(b"Transfer-Encoding: chunked")
        body = _chunked(body, draw(st.lists(st.integers(1, 512), min_size=1, max_size=8)))
    elif framing == "bad-chunked":
        lines.append(b"Transfer-Encoding: " + draw(st.sampled_from([b"chunked", b"gzip, chunked", b"chunked, x"])))
    sep = b"\n" if framing == "bare-lf" else b"\r\n"
    return HttpCase(sep.join(lines) + sep + sep + body, framing)


def _honest(body: bytes) -> HttpCase:
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    return HttpCase(head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body, "exact")


def fuzz_http(port: int, n: int, tally: Tally, *, api_key: str | None = None) -> None:
    """POST /v1/embeddings as raw bytes: hostile bodies, encodings and headers."""
    from loadtest.faults.surfaces import raw_http

    @_hyp(n)
    @given(case=http_cases(api_key))
    @example(case=_honest(b'{"input": "\\ud800"}'))  # two bodies once answered 500
    @example(case=_honest(b"[" * 100_000 + b"]" * 100_000))
    def prop(case: HttpCase) -> None:
        reply = raw_http(port, case.request, timeout_s=TIMEOUT_S, half_close=case.half_close)
        if reply.timed_out:
            outcome, ok = "timeout", False
        elif reply.status is None:
            # Closed without an answer: right only where we promised bytes we never sent.
            outcome, ok = "closed", case.half_close
        else:
            outcome, ok = str(reply.status), reply.status < 500
        tally.add("http", outcome, ok, (case.framing, case.request[:240], reply.body[:200]))

    prop()


def http_still_serves(port: int, api_key: str | None) -> bool:
    from loadtest.faults.surfaces import http_post

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return http_post(port, "/v1/embeddings", b'{"input": "still serving"}', headers).status == 200


# --- demo websocket ---------------------------------------------------------------------------------
NEXT = "<next seq>"  # a keystroke's seq placeholder: one above the highest sent on this connection


@dataclass(frozen=True, slots=True)
class Frame:
    form: str
    doc: Any = None  # a keystroke-ish object, serialised at send time (seq placeholders filled in)
    ensure_ascii: bool = True
    raw: str | bytes = ""
    as_text: bool = True


_keystrokes = st.fixed_dictionaries(
    {"seq": st.one_of(st.just(NEXT), st.just(NEXT), st.just(NEXT), st.integers(), st.floats(), st.booleans(),
                      st.none(), st.text(max_size=5), json_values),
     "text": st.one_of(texts, texts, surrogate_texts, st.text(min_size=190, max_size=210), json_values)},
    optional={"k": st.one_of(st.integers(-5, 60), st.integers(), st.floats(), st.booleans(), json_values),
              "extra": json_values})

_plausible_keystrokes = st.fixed_dictionaries({"seq": st.just(NEXT), "text": texts},
                                               optional={"k": st.integers(1, 50)})

ws_frames = st.one_of(
    st.builds(Frame, form=st.just("keystroke"), doc=_plausible_keystrokes),
    st.builds(Frame, form=st.just("keystroke"), doc=_plausible_keystrokes),
    st.builds(Frame, form=st.just("keystroke"), doc=_plausible_keystrokes),
    st.builds(Frame, form=st.just("keystroke"), doc=_keystrokes, ensure_ascii=st.booleans()),
    st.builds(Frame, form=st.just("keystroke"), doc=_keystrokes, ensure_ascii=st.booleans()),
    st.builds(Frame, form=st.just("keystroke"), doc=_keystrokes, ensure_ascii=st.booleans()),
    st.builds(Frame, form=st.just("json"), doc=json_values, ensure_ascii=st.booleans()),
    st.builds(Frame, form=st.just("text"), raw=st.text(max_size=300)),
    st.builds(Frame, form=st.just("binary"), raw=st.one_of(st.binary(max_size=300), _json_bodies()),
              as_text=st.just(False)),
    st.builds(Frame, form=st.just("invalid-utf8"), raw=st.binary(min_size=1, max_size=64).map(lambda b: b"\xff" + b),
              as_text=st.just(True)),
    st.builds(Frame, form=st.just("nested"), raw=st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)),
    st.builds(Frame, form=st.just("long-number"),
              raw=st.integers(1, 5000).map(lambda n: '{"seq": ' + "7" * n + ', "text": "milk"}')),
    st.builds(Frame, form=st.just("oversized"), raw=st.integers(4097, 70_000).map(lambda n: "x" * n)),
)


class _Socket:
    """One websocket, reopened when the server closes it; tracks the seq the server last accepted."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url
        self.headers = {"x-api-key": api_key} if api_key else None
        self.ws: Any = None
        self._open = contextlib.ExitStack()  # websockets wants its connections entered as contexts
        self.last_seq = 0
        self.reconnects = 0

    def get(self) -> Any:
        from websockets.sync.client import connect

        if self.ws is None:
            self.ws = self._open.enter_context(connect(
                self.url, additional_headers=self.headers, proxy=None, open_timeout=TIMEOUT_S, max_size=None,
                compression=None))
            self.last_seq = 0
            self.reconnects += 1
        return self.ws

    def drop(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                self._open.close()
            self.ws = None

    def payload(self, frame: Frame) -> tuple[str | bytes, bool]:
        if frame.form not in ("json", "keystroke"):
            return frame.raw, frame.as_text
        doc = frame.doc
        if frame.form == "keystroke":
            doc = dict(doc)
            if doc.get("seq") == NEXT:
                doc["seq"] = self.last_seq + 1
            seq = doc["seq"]
            if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0:
                self.last_seq = max(self.last_seq, seq)
        text = json.dumps(doc, ensure_ascii=frame.ensure_ascii)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # raw lone surrogates: only a binary frame can carry those bytes
            return text.encode("utf-8", "surrogatepass"), False
        return text, True


def _ws_outcome(sock: _Socket, frame: Frame) -> tuple[str, bool]:
    from websockets.exceptions import ConnectionClosed

    payload, as_text = sock.payload(frame)
    if isinstance(payload, str) and not as_text:
        payload = payload.encode("utf-8", "surrogatepass")
    ws = sock.get()
    try:
        ws.send(payload, text=as_text)
        reply = json.loads(ws.recv(timeout=TIMEOUT_S))
    except ConnectionClosed as exc:
        sock.drop()
        close = exc.rcvd.code if exc.rcvd is not None else 1006
        return f"close {close}", close in OK_WS_CLOSES
    except TimeoutError:
        sock.drop()
        return "timeout", False
    if "error" in reply:
        code = str(reply["error"].get("code"))
        if code == "closed":  # the server said why, and closes next
            sock.drop()
        return f"error {code}", code not in BAD_WS_ERRORS
    if "dropped" in reply:
        return f"dropped {reply['dropped']}", True
    return ("results" if reply.get("results") else "no results"), "results" in reply


def fuzz_demo(ws_url: str, n: int, tally: Tally, *, api_key: str | None = None) -> None:
    """Frames on one demo websocket (reopened after the server closes it)."""
    sock = _Socket(ws_url, api_key)

    @_hyp(n)
    @given(frame=ws_frames)
    @example(frame=Frame("text", raw='{"seq": 1, "text": "\\ud800"}'))
    @example(frame=Frame("nested", raw="[" * 2000 + "]" * 2000))
    def prop(frame: Frame) -> None:
        outcome, ok = _ws_outcome(sock, frame)
        tally.add("demo-ws", outcome, ok, (frame.form, frame.doc, frame.raw[:120]))

    try:
        prop()
    finally:
        tally.counts["demo-ws reconnects"]["reconnects"] = sock.reconnects
        sock.drop()


def demo_still_serves(ws_url: str, api_key: str | None) -> bool:
    sock = _Socket(ws_url, api_key)
    try:
        outcome, _ok = _ws_outcome(sock, Frame("keystroke", doc={"seq": NEXT, "text": "greek yogurt"}))
    except Exception:
        return False
    finally:
        sock.drop()
    return outcome == "results"


# --- the scenario -----------------------------------------------------------------------------------
OWN_LOGGERS = ("sidecar", "demo_ui", "inference", "catalog", "loadtest")


@contextlib.contextmanager
def _muted(name: str) -> Iterator[None]:
    """Thousands of uvicorn's "Invalid HTTP request received" on stderr say only that the fuzzer
    works: take its handlers off while fuzzing (a LogCapture still counts the lines)."""
    logger = logging.getLogger(name)
    saved = logger.handlers[:]
    logger.handlers = []
    try:
        yield
    finally:
        logger.handlers = saved


SURFACES: dict[str, Callable[..., None]] = {
    "grpc-raw": fuzz_grpc_raw, "grpc-msg": fuzz_grpc_messages, "http": fuzz_http, "demo-ws": fuzz_demo}


def run(settings: Settings, work: Path, *, quick: bool) -> ScenarioResult:
    from loadtest.faults.surfaces import LogCapture, running_stack

    result = ScenarioResult(NAME, TITLE)
    t0 = time.monotonic()
    plan = QUICK if quick else FULL
    tally = Tally()
    alive: dict[str, bool] = {}
    seconds: dict[str, float] = {}
    key = "fuzz-key-" + "0123456789abcdef" * 2
    work.mkdir(parents=True, exist_ok=True)
    try:
        with running_stack(settings, work, api_key=key) as stack, _muted("uvicorn"), \
                LogCapture(logging.WARNING) as logs:
            targets: dict[str, Any] = {"grpc-raw": stack.grpc_target, "grpc-msg": stack.grpc_target,
                                       "http": stack.http_port, "demo-ws": stack.ws_url}
            for surface, fn in SURFACES.items():
                t = time.monotonic()
                fn(targets[surface], plan[surface], tally, api_key=key)
                seconds[surface] = round(time.monotonic() - t, 1)
                # A crash shows as the next honest call failing, on this surface and on the others.
                alive[surface] = (grpc_still_serves(stack.grpc_target, key) and http_still_serves(stack.http_port, key)
                                  and demo_still_serves(stack.ws_url, key))
    finally:
        result.seconds = round(time.monotonic() - t0, 1)
    total = sum(tally.cases(s) for s in SURFACES)
    want = sum(plan.values())
    result.check("cases", f">= {want}", f"{total}", total >= want)
    bad = tally.n_bad()
    result.check("INTERNAL/UNKNOWN/5xx/hung answers", "0", f"{bad} of {total}", bad == 0)
    down = [s for s, ok in alive.items() if not ok]
    result.check("crashes (a normal call fails after a surface)", "0",
                 f"{len(down)} of {len(SURFACES)}" + (f" ({', '.join(down)})" if down else ""),
                 not down and len(alive) == len(SURFACES))
    # An error our own code logged means a request hit an unexpected path (e.g. "search failed").
    own_errors = [line for lvl, name, line in logs.records
                  if lvl >= logging.ERROR and name.split(".")[0] in OWN_LOGGERS]
    result.check("errors logged by embedcar code", "0", f"{len(own_errors)}", not own_errors)
    server_lines = Counter(f"{logging.getLevelName(lvl)} {name}: {line.splitlines()[0].split(' ', 2)[-1][:80]}"
                           for lvl, name, line in logs.records)
    result.figures = {
        "cases": {s: tally.cases(s) for s in SURFACES},
        "outcomes": {s: dict(sorted(tally.counts[s].items())) for s in SURFACES},
        "demo_ws_reconnects": tally.counts["demo-ws reconnects"]["reconnects"],
        "seconds": seconds,
        "log_lines": dict(server_lines.most_common(12)),  # what the servers said about it all
    }
    result.notes += [f"logged: {line[:300]}" for line in own_errors[:5]]
    for surface, cases in tally.bad.items():
        result.notes += [f"{surface}: {c}" for c in cases[:5]]
    return result
