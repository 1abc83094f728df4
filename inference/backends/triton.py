"""Triton backend: the ensemble of the model version it serves, over gRPC (grpc.aio + tritonclient's stubs).

It calls exactly that version's name (`embedder.<model>.<hash>`, inference/triton/names.py), at
start, in every probe and every request: a Triton serving another version (restarted with the next
model's repository, say) answers "unknown model", and that URL is then down like an unreachable one
(the next URL, or the sidecar's embedded fallback, answers) instead of returning vectors of another
model for an index built with this one.

One persistent channel per URL (keep-alive, short reconnect back-off so a restarted server is
found again within a second), requests spread round-robin over the URLs that are up; a URL that
answers UNAVAILABLE is marked down and re-probed in the background. gRPC and tritonclient errors
are mapped into inference.errors here, once.

The hot path builds Triton's `ModelInferRequest` itself, with the ids as raw little-endian bytes,
and reads the embedding straight from `raw_output_contents`: tritonclient's aio client does the
same on the wire but cost ~0.35 ms more per call on the reference machine (InferInput/InferResult
wrapping), a quarter of the Triton hop's whole budget (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inference.backends.base import Backend, Embeddings
from inference.errors import DeadlineExceeded, EmbedcarError, FailedPrecondition, Internal, InvalidInput, Unavailable
from inference.manifest import Manifest
from inference.tokenizer import TokenBatch
from inference.triton.names import DEADLINE_PARAM, ENSEMBLE_PREFIX, POOL_SKIP_PARAM, served_names
from inference.triton.tls import ClientCredentials

log = logging.getLogger(__name__)

_MAX_MSG = 256 * 1024 * 1024
# How often each URL is probed for readiness: a Triton that went down is marked so within it, one
# that came back is used again within it (tests pass a shorter one to the constructor).
PROBE_INTERVAL_S = 0.5
# The ensemble's id inputs: Triton's datatype names <-> numpy (CPU repositories take int32).
ID_TYPES = {"INT32": np.int32, "INT64": np.int64}
WIRE_TYPES = {np.int32: "INT32", np.int64: "INT64"}
_LITTLE_ENDIAN = {t: np.dtype(t).newbyteorder("<") for t in WIRE_TYPES}
OUTPUT = "embedding"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"

class VersionNotServed(Unavailable):
    """This Triton does not serve the model version the client serves (another repository, another
    version): that URL is down for this client, like one that does not answer."""


class CredentialsRefused(FailedPrecondition):
    """A hardened Triton refused this client's TLS handshake or key (or the client refused Triton's
    certificate): configuration, not an outage. A start-up error; at run time that URL is steered around."""


# What gRPC and Triton say when credentials, not the network, failed (checked against grpcio 1.85 and
# Triton 2.51 by tests/test_triton_tls.py).
# Narrow on purpose: a connection cut mid-call (SSL_ERROR_SYSCALL, "Socket closed") is an outage.
_CREDENTIAL_FAILURES = ("protocol is restricted", "handshake failed", "certificate_verify", "certificate verify",
                        "tsi_protocol_failure")


def map_error(exc: Exception, url: str) -> EmbedcarError:
    """gRPC/tritonclient error -> the project's type (the one place this mapping lives)."""
    import grpc
    from tritonclient.utils import InferenceServerException

    if isinstance(exc, EmbedcarError):
        return exc
    if isinstance(exc, asyncio.TimeoutError):
        return DeadlineExceeded(f"Triton {url}: deadline exceeded")
    if isinstance(exc, grpc.aio.AioRpcError):
        status, msg = str(exc.code()), f"Triton {url}: {exc.details()}"
    elif isinstance(exc, InferenceServerException):
        status, msg = str(exc.status() or ""), f"Triton {url}: {exc.message()}"
    else:
        return Internal(f"Triton {url}: {type(exc).__name__}: {exc}")
    if any(m in msg.lower() for m in _CREDENTIAL_FAILURES):
        return CredentialsRefused(msg)
    # Triton rejects a request whose queue timeout expired with UNAVAILABLE: that is a deadline.
    if "DEADLINE_EXCEEDED" in status or "timeout expired" in msg.lower():
        return DeadlineExceeded(msg)
    # Triton 2.51: NOT_FOUND "Request for unknown model: 'x' is not found" (older: UNAVAILABLE).
    if "NOT_FOUND" in status or "unknown model" in msg.lower():
        return VersionNotServed(msg)
    if "UNAVAILABLE" in status or "CANCELLED" in status:
        return Unavailable(msg)
    if "INVALID_ARGUMENT" in status:
        return InvalidInput(msg)
    return Internal(msg)


def all_failed(failed: Sequence[tuple[EmbedcarError, Exception]]) -> Unavailable:
    """One error when no endpoint answered: each URL with its own error (map_error names the URL)."""
    if not failed:
        return Unavailable("no Triton endpoint configured (backend closed?)")
    if len(failed) == 1:
        err, cause = failed[0]
        out = err if isinstance(err, Unavailable) else Unavailable(err.message)
    else:
        cause = failed[-1][1]
        out = Unavailable(f"all {len(failed)} Triton endpoints failed: " + "; ".join(e.message for e, _ in failed))
    out.__cause__ = cause
    return out


@dataclass(slots=True)
class _Endpoint:
    url: str
    channel: Any  # grpc.aio.Channel
    stub: Any  # tritonclient's GRPCInferenceServiceStub on that channel
    infer: Any  # ModelInfer on that channel taking the request's bytes (_request)
    up: bool = False
    down_since: float = 0.0
    answered: float = float("-inf")  # when a request last succeeded here (time.monotonic)
    error: EmbedcarError | None = None  # why the latest probe failed (start-up names it)


class TritonBackend(Backend):
    name = "triton"
    batches_itself = True  # Triton's dynamic batcher merges concurrent requests of one shape

    def __init__(self, urls: Sequence[str], manifest: Manifest, *, variant: str | None = None,
                 model_name: str | None = None, timeout_s: float = 2.0, max_batch: int = 256,
                 probe_interval_s: float | None = None, credentials: ClientCredentials | None = None) -> None:
        if not urls:
            raise InvalidInput("TritonBackend needs at least one URL")
        self.manifest = manifest
        self.urls = tuple(urls)
        self.variant_name = variant or manifest.default_variant
        self.version_id = manifest.variant_id(self.variant_name)
        self.dim = manifest.dim
        self.max_batch = max_batch
        # The served version's own ensemble; `model_name` only for a repository written by hand.
        self.names = served_names(manifest, self.variant_name)
        self.model_name = model_name or self.names.ensemble
        self.timeout_s = timeout_s
        self.probe_interval_s = PROBE_INTERVAL_S if probe_interval_s is None else probe_interval_s
        # Hardened pool: TLS channels, and the key header on every call (the operator's on statistics).
        self.credentials = credentials
        self._md = credentials.metadata if credentials else None
        self._stats_md = (credentials.metadata + credentials.operator_metadata) if credentials else None
        self._endpoints: list[_Endpoint] = []
        self._rr = itertools.count()
        self._probe_task: asyncio.Task[None] | None = None
        self._input_types: dict[str, Any] = {}
        self._prefixes: dict[tuple[int, int], bytes] = {}  # a request's fields that depend on its shape only
        self._started = False

    # --- lifecycle -------------------------------------------------------------------------
    def _channel_options(self) -> list[tuple[str, int | str]]:
        options: list[tuple[str, int | str]] = [
            ("grpc.max_send_message_length", _MAX_MSG),
            ("grpc.max_receive_message_length", _MAX_MSG),
            # Pings only while calls are in flight: Triton's default server policy answers idle pings
            # with GOAWAY (too_many_pings). Idle liveness comes from the probe loop's health calls.
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 2),
            # gRPC's default reconnect back-off grows to 120 s: a restarted Triton would sit unused.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        return options + (self.credentials.channel_options() if self.credentials else [])

    def _endpoint(self, url: str) -> _Endpoint:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        options = self._channel_options()
        if self.credentials is None:
            channel = grpc.aio.insecure_channel(url, options=options)
        else:  # never a plaintext retry: a TLS channel fails or speaks TLS
            channel = grpc.aio.secure_channel(url, self.credentials.channel_credentials(), options=options)
        from tritonclient.grpc import service_pb2 as pb

        infer = channel.unary_unary(MODEL_INFER, request_serializer=None,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        return _Endpoint(url, channel, service_pb2_grpc.GRPCInferenceServiceStub(channel), infer)

    async def start(self) -> None:
        """Connect to every URL, learn the ensemble's input types, fail if none is ready."""
        if not self._endpoints:
            self._endpoints = [self._endpoint(u) for u in self.urls]
        await asyncio.gather(*(self._probe(ep) for ep in self._endpoints))
        # A URL that refuses our credentials is misconfigured, not down: start-up fails and names it.
        refused = [ep.error for ep in self._endpoints if isinstance(ep.error, CredentialsRefused)]
        if refused:
            raise CredentialsRefused("; ".join(e.message for e in refused))
        live = [ep for ep in self._endpoints if ep.up]
        if not live and all(isinstance(ep.error, VersionNotServed) for ep in self._endpoints):
            # Every server answers, none with this version: a configuration to fix, not an outage.
            raise FailedPrecondition("; ".join(ep.error.message for ep in self._endpoints if ep.error))
        if not live:
            why = "; ".join(ep.error.message for ep in self._endpoints if ep.error is not None)
            raise Unavailable(f"no Triton server ready at {', '.join(self.urls)}" + (f" ({why})" if why else ""))
        from tritonclient.grpc import service_pb2 as pb

        try:
            meta = await live[0].stub.ModelMetadata(pb.ModelMetadataRequest(name=self.model_name),
                                                    timeout=self.timeout_s, metadata=self._md)
        except Exception as exc:
            raise map_error(exc, live[0].url) from exc
        await self._check_variant(live[0])
        self._input_types = {i.name: ID_TYPES.get(i.datatype, np.int64) for i in meta.inputs}
        self._prefixes = {}
        out = {o.name: o for o in meta.outputs}
        if OUTPUT not in out or int(out[OUTPUT].shape[-1]) != self.dim:
            raise Internal(f"Triton model {self.model_name} does not output a {self.dim}-d `{OUTPUT}`")
        self._started = True
        await self._warm_up()
        if self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="triton-probe")

    async def _not_served(self, ep: _Endpoint, detail: str) -> VersionNotServed:
        """The error naming what this client expects and, where Triton lets us list it, what it serves."""
        from tritonclient.grpc import service_pb2 as pb

        have = ""
        with contextlib.suppress(Exception):  # the index is an operator-only API on a hardened pool
            index = await ep.stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=self.timeout_s,
                                                  metadata=self._md)
            names = sorted(m.name for m in index.models if m.name.startswith(ENSEMBLE_PREFIX))
            have = f"; it serves {', '.join([await self._described(ep, n) for n in names]) or 'no embedder model'}"
        return VersionNotServed(f"Triton {ep.url} does not serve {self.model_name} (model version {self.version_id})"
                                f"{have} ({detail}): generate the pool's repository with this version "
                                "(`embedcar triton repo --models ...`), or serve the variant it has "
                                "(model.variant, EMBEDCAR_MODEL_VARIANT)")

    async def _described(self, ep: _Endpoint, model: str) -> str:
        """`model (its variant id)` where its config records one."""
        from tritonclient.grpc import service_pb2 as pb

        from inference.triton.repository import VARIANT_ID_PARAM

        with contextlib.suppress(Exception):
            reply = await ep.stub.ModelConfig(pb.ModelConfigRequest(name=model), timeout=self.timeout_s,
                                              metadata=self._md)
            param = reply.config.parameters.get(VARIANT_ID_PARAM)
            if param is not None and param.string_value:
                return f"{model} ({param.string_value})"
        return model

    async def _check_variant(self, ep: _Endpoint) -> None:
        """FailedPrecondition when Triton serves another variant than this backend's (the variant id
        a generated repository records); a repository without one is taken as it is."""
        from tritonclient.grpc import service_pb2 as pb

        from inference.triton.repository import VARIANT_ID_PARAM

        try:
            reply = await ep.stub.ModelConfig(pb.ModelConfigRequest(name=self.model_name), timeout=self.timeout_s,
                                              metadata=self._md)
        except Exception as exc:
            raise map_error(exc, ep.url) from exc
        param = reply.config.parameters.get(VARIANT_ID_PARAM)
        served = param.string_value if param is not None else ""
        if served and served != self.version_id:
            raise FailedPrecondition(
                f"Triton at {ep.url} serves {served}, this backend is configured for {self.version_id}: "
                "set model.variant (EMBEDCAR_MODEL_VARIANT) to the variant of Triton's repository")

    async def _warm_up(self) -> None:
        """One batch-1 request per bucket: opens the channel and checks every shape end to end."""
        m = self.manifest
        for n in m.buckets:
            ids = np.full((1, n), m.pad_id, dtype=np.int64)
            ids[0, 0] = m.special_ids[0] if m.special_ids else 1
            types = np.zeros_like(ids) if m.has_token_type_ids else None
            try:
                await self.embed(TokenBatch(ids, np.ones_like(ids), types), timeout_s=max(self.timeout_s, 30.0))
            except EmbedcarError:
                self._started = False
                raise

    async def _probe(self, ep: _Endpoint) -> None:
        from tritonclient.grpc import service_pb2 as pb

        try:
            reply = await ep.stub.ModelReady(pb.ModelReadyRequest(name=self.model_name), timeout=self.timeout_s,
                                             metadata=self._md)
            ok = bool(reply.ready)
            # Not ready is also what a server answers for a model it does not have: say which, once per outage.
            ep.error = None if ok else (
                ep.error if isinstance(ep.error, VersionNotServed) and not ep.up
                else await self._not_served(ep, "model not ready or not found"))
        except Exception as exc:
            ok = False
            ep.error = map_error(exc, ep.url)
            if isinstance(ep.error, VersionNotServed):
                ep.error = await self._not_served(ep, ep.error.message)
            if self.credentials is not None and "socket closed" in ep.error.message.lower():
                # What a mutual-TLS Triton's refusal of our certificate looks like from here.
                ep.error = Unavailable(f"{ep.error.message} (over TLS: Triton closes the connection when it "
                                       "requires a client certificate from its CA and this one is missing or "
                                       "from another CA, or when the port does not speak TLS)")
        self._mark(ep, ok)

    def _mark(self, ep: _Endpoint, up: bool) -> None:
        if ep.up and not up:
            log.warning("Triton %s is down; steering around it%s", ep.url,
                        f" ({ep.error.message})" if isinstance(ep.error, VersionNotServed) else "")
            ep.down_since = time.monotonic()
        elif up and not ep.up and self._started:
            log.info("Triton %s is back", ep.url)
        ep.up = up

    async def _probe_loop(self) -> None:
        # Every endpoint, not only the down ones: ready() must turn False while an idle server is gone.
        # One that answered a request since the last round needs no probe: under traffic the requests
        # are the probes (each probe is a gRPC call's CPU, ~2 per second per URL otherwise).
        while True:
            await asyncio.sleep(self.probe_interval_s)
            recent = time.monotonic() - self.probe_interval_s
            await asyncio.gather(*(self._probe(ep) for ep in self._endpoints if not (ep.up and ep.answered > recent)))

    def ready(self) -> bool:
        return self._started and any(ep.up for ep in self._endpoints)

    def down_reason(self) -> str:
        return "; ".join(ep.error.message for ep in self._endpoints if not ep.up and ep.error is not None)

    async def close(self) -> None:
        self._started = False
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None
        for ep in self._endpoints:
            with contextlib.suppress(Exception):
                await ep.channel.close()
        self._endpoints = []

    # --- inference -------------------------------------------------------------------------
    def _request(self, batch: TokenBatch, timeout_s: float) -> bytes:
        """The serialised ModelInferRequest: the fields a shape decides (model, inputs, output) made once
        per shape, then this call's (its ids, its deadline) appended: protobuf merges concatenated
        messages, and a call builds a third of the message (about half the CPU)."""
        from tritonclient.grpc import service_pb2 as pb

        inputs = wire_inputs(batch, self._input_types, self.model_name)
        prefix = self._prefixes.get(batch.shape)
        if prefix is None:
            head = pb.ModelInferRequest(model_name=self.model_name)
            for name, datatype, arr in inputs:
                head.inputs.add(name=name, datatype=datatype, shape=arr.shape)
            head.outputs.add(name=OUTPUT)
            prefix = self._prefixes[batch.shape] = bytes(head.SerializeToString())
        # One serialisation of each array into the raw contents, in the inputs' order.
        req = pb.ModelInferRequest(raw_input_contents=[arr.tobytes() for _name, _type, arr in inputs])
        # A request that waited past these is not computed: Triton's own timeout (µs) where a model
        # has a queue policy (the GPU encoder), the wall-clock deadline where the model checks it.
        req.parameters["timeout"].int64_param = int(timeout_s * 1_000_000)
        req.parameters[DEADLINE_PARAM].int64_param = time.time_ns() + int(timeout_s * 1e9)
        if batch.pool_skip:
            req.parameters[POOL_SKIP_PARAM].int64_param = batch.pool_skip
        return prefix + bytes(req.SerializeToString())

    @staticmethod
    def _embedding(reply: Any) -> Embeddings | None:
        for i, out in enumerate(reply.outputs):
            if out.name == OUTPUT and i < len(reply.raw_output_contents):
                return np.frombuffer(reply.raw_output_contents[i], dtype="<f4").reshape(tuple(out.shape))
        return None

    def _order(self) -> list[_Endpoint]:
        """Round-robin over the endpoints that are up; the others last (maybe they are back)."""
        n = len(self._endpoints)
        start = next(self._rr) % n
        rotated = self._endpoints[start:] + self._endpoints[:start]
        return [ep for ep in rotated if ep.up] + [ep for ep in rotated if not ep.up]

    def _checked(self, batch: TokenBatch, timeout_s: float | None) -> tuple[bytes, float]:
        """The request for `batch` and its timeout; InvalidInput for a batch Triton must not see."""
        if not self._started:
            raise Unavailable("Triton backend not started")
        b, n = batch.shape
        if b == 0 or n == 0:
            raise InvalidInput(f"empty batch {batch.shape}")
        if b > self.max_batch:
            raise InvalidInput(f"batch of {b} is over the backend maximum {self.max_batch}")
        for name, arr in batch.arrays().items():
            if arr.shape != (b, n):
                raise InvalidInput(f"{name} is shaped {arr.shape}, input_ids {(b, n)}: malformed batch")
        timeout = timeout_s or self.timeout_s
        return self._request(batch, timeout), timeout

    def _answered(self, ep: _Endpoint, reply: Any, rows: int) -> Embeddings:
        emb = self._embedding(reply)
        if emb is None or emb.shape != (rows, self.dim):
            raise Internal(f"Triton returned {None if emb is None else emb.shape}, expected {(rows, self.dim)}")
        self._mark(ep, True)
        ep.answered = time.monotonic()
        return emb.astype(np.float32, copy=False)

    async def embed(self, batch: TokenBatch, *, timeout_s: float | None = None) -> Embeddings:
        request, timeout = self._checked(batch, timeout_s)
        failed: list[tuple[EmbedcarError, Exception]] = []
        for ep in self._order():
            try:
                reply = await ep.infer(request, timeout=timeout, metadata=self._md)
            except Exception as exc:
                err = map_error(exc, ep.url)
                if isinstance(err, VersionNotServed):
                    err = ep.error = await self._not_served(ep, err.message)
                if not isinstance(err, Unavailable | CredentialsRefused):
                    raise err from exc
                self._mark(ep, False)
                failed.append((err, exc))
                continue  # another URL may be up; embeddings are idempotent, so retry is safe
            return self._answered(ep, reply, batch.shape[0])
        raise all_failed(failed)

    # --- statistics --------------------------------------------------------------------------
    async def statistics(self) -> dict[str, dict[str, float | int]]:
        """Per model: counts and cumulative ns from Triton's statistics API, summed over URLs up."""
        out: dict[str, dict[str, float | int]] = {}
        for ep in self._endpoints:
            if not ep.up:
                continue
            from google.protobuf.json_format import MessageToDict
            from tritonclient.grpc import service_pb2 as pb

            try:
                reply = await ep.stub.ModelStatistics(pb.ModelStatisticsRequest(), timeout=self.timeout_s,
                                                      metadata=self._stats_md)
            except Exception as exc:
                raise map_error(exc, ep.url) from exc
            raw = MessageToDict(reply, preserving_proto_field_name=True)
            for name, flat in flatten_statistics(raw).items():
                acc = out.setdefault(name, {})
                for k, v in flat.items():
                    acc[k] = acc.get(k, 0) + v
        return out


def wire_inputs(batch: TokenBatch, input_types: dict[str, Any], model: str) -> list[tuple[str, str, np.ndarray]]:
    """(name, Triton datatype, little-endian array) per input `model` declares, in its order: one
    cast each (int64 -> int32 halves the bytes); token_type_ids zeros where the batch has none."""
    arrays = batch.arrays()
    if batch.token_type_ids is None and "token_type_ids" in input_types:
        arrays["token_type_ids"] = np.zeros_like(batch.input_ids)
    out = []
    for name, dtype in input_types.items():
        if name not in arrays:
            raise InvalidInput(f"Triton model {model} needs input {name!r}")
        arr = np.ascontiguousarray(arrays[name], dtype=_LITTLE_ENDIAN[dtype])
        out.append((name, WIRE_TYPES[dtype], arr))
    return out


def flatten_statistics(raw: dict[str, Any]) -> dict[str, dict[str, float | int]]:
    """Triton's JSON statistics -> {model: {inference_count, execution_count, queue_ns, ...}}."""
    out: dict[str, dict[str, float | int]] = {}
    for m in raw.get("model_stats", []):
        s = m.get("inference_stats", {})
        row: dict[str, float | int] = {
            "inference_count": int(m.get("inference_count", 0)),
            "execution_count": int(m.get("execution_count", 0)),
        }
        for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
            row[f"{key}_count"] = int(s.get(key, {}).get("count", 0))
            row[f"{key}_ns"] = int(s.get(key, {}).get("ns", 0))
        for bs in m.get("batch_stats", []):
            row[f"batch_{bs['batch_size']}_count"] = int(bs.get("compute_infer", {}).get("count", 0))
        out[m["name"]] = row
    return out
