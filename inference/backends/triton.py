"""Triton backend: the `embedder` ensemble over gRPC (tritonclient.grpc.aio).

One persistent channel per URL (keep-alive, short reconnect back-off so a restarted server is
found again within a second), requests spread round-robin over the URLs that are up; a URL that
answers UNAVAILABLE is marked down and re-probed in the background. tritonclient's errors are
mapped into inference.errors here, once.
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

from inference.backends.base import Backend, BackendStats, Embeddings
from inference.errors import DeadlineExceeded, EmbedcarError, Internal, InvalidInput, Unavailable
from inference.manifest import Manifest
from inference.settings import Settings
from inference.tokenizer import TokenBatch

log = logging.getLogger(__name__)

_MAX_MSG = 256 * 1024 * 1024
_TYPES = {"INT32": np.int32, "INT64": np.int64}


def map_error(exc: Exception, url: str) -> EmbedcarError:
    """tritonclient/grpc error -> the project's type (the one place this mapping lives)."""
    from tritonclient.utils import InferenceServerException

    if isinstance(exc, EmbedcarError):
        return exc
    if isinstance(exc, asyncio.TimeoutError):
        return DeadlineExceeded(f"Triton {url}: deadline exceeded")
    if isinstance(exc, InferenceServerException):
        status = str(exc.status() or "")
        msg = f"Triton {url}: {exc.message()}"
        # Triton rejects a request whose queue timeout expired with UNAVAILABLE: that is a deadline.
        if "DEADLINE_EXCEEDED" in status or "timeout expired" in msg.lower():
            return DeadlineExceeded(msg)
        if "UNAVAILABLE" in status:
            return Unavailable(msg)
        if "INVALID_ARGUMENT" in status:
            return InvalidInput(msg)
        if "CANCELLED" in status:
            return Unavailable(msg)
        return Internal(msg)
    return Internal(f"Triton {url}: {type(exc).__name__}: {exc}")


@dataclass(slots=True)
class _Endpoint:
    url: str
    client: Any
    up: bool = False
    down_since: float = 0.0


class TritonBackend(Backend):
    name = "triton"

    def __init__(self, urls: Sequence[str], manifest: Manifest, *, variant: str | None = None,
                 model_name: str = "embedder", timeout_s: float = 2.0, max_batch: int = 256,
                 probe_interval_s: float = 0.5) -> None:
        if not urls:
            raise InvalidInput("TritonBackend needs at least one URL")
        self.manifest = manifest
        self.urls = tuple(urls)
        self.variant_name = variant or manifest.default_variant
        self.version_id = manifest.variant_id(self.variant_name)
        self.dim = manifest.dim
        self.max_batch = max_batch
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.probe_interval_s = probe_interval_s
        self.stats = BackendStats()
        self._endpoints: list[_Endpoint] = []
        self._rr = itertools.count()
        self._probe_task: asyncio.Task[None] | None = None
        self._input_types: dict[str, Any] = {}
        self._started = False

    @classmethod
    def from_settings(cls, settings: Settings, manifest: Manifest) -> TritonBackend:
        t = settings.triton
        return cls(t.urls, manifest, variant=settings.model.variant, timeout_s=t.timeout_ms / 1000,
                   max_batch=min(settings.model.max_batch, t.max_batch_size), probe_interval_s=t.probe_interval_s)

    # --- lifecycle -------------------------------------------------------------------------
    def _client(self, url: str) -> Any:
        import tritonclient.grpc.aio as grpcclient

        return grpcclient.InferenceServerClient(url, channel_args=[
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
        ])

    async def start(self) -> None:
        """Connect to every URL, learn the ensemble's input types, fail if none is ready."""
        if not self._endpoints:
            self._endpoints = [_Endpoint(u, self._client(u)) for u in self.urls]
        await asyncio.gather(*(self._probe(ep) for ep in self._endpoints))
        live = [ep for ep in self._endpoints if ep.up]
        if not live:
            raise Unavailable(f"no Triton server ready at {', '.join(self.urls)}")
        try:
            meta = await live[0].client.get_model_metadata(self.model_name, as_json=True,
                                                           client_timeout=self.timeout_s)
        except Exception as exc:
            raise map_error(exc, live[0].url) from exc
        self._input_types = {i["name"]: _TYPES.get(i["datatype"], np.int64) for i in meta["inputs"]}
        out = {o["name"]: o for o in meta["outputs"]}
        if "embedding" not in out or int(out["embedding"]["shape"][-1]) != self.dim:
            raise Internal(f"Triton model {self.model_name} does not output a {self.dim}-d `embedding`")
        self._started = True
        await self._warm_up()
        if self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="triton-probe")

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
        try:
            ok = bool(await ep.client.is_model_ready(self.model_name, client_timeout=self.timeout_s))
        except Exception:
            ok = False
        self._mark(ep, ok)

    def _mark(self, ep: _Endpoint, up: bool) -> None:
        if ep.up and not up:
            log.warning("Triton %s is down; steering around it", ep.url)
            ep.down_since = time.monotonic()
        elif up and not ep.up and self._started:
            log.info("Triton %s is back", ep.url)
        ep.up = up

    async def _probe_loop(self) -> None:
        # Every endpoint, not only the down ones: ready() must turn False while an idle server is gone.
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await asyncio.gather(*(self._probe(ep) for ep in self._endpoints))

    def ready(self) -> bool:
        return self._started and any(ep.up for ep in self._endpoints)

    async def close(self) -> None:
        self._started = False
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None
        for ep in self._endpoints:
            with contextlib.suppress(Exception):
                await ep.client.close()
        self._endpoints = []

    # --- inference -------------------------------------------------------------------------
    def _inputs(self, batch: TokenBatch) -> list[Any]:
        import tritonclient.grpc.aio as grpcclient

        arrays = batch.arrays()
        if batch.token_type_ids is None and "token_type_ids" in self._input_types:
            arrays["token_type_ids"] = np.zeros_like(batch.input_ids)
        out = []
        for name, dtype in self._input_types.items():
            if name not in arrays:
                raise InvalidInput(f"Triton model {self.model_name} needs input {name!r}")
            # One cast (int64 -> int32 halves the bytes); set_data_from_numpy then serialises once.
            arr = np.ascontiguousarray(arrays[name], dtype=dtype)
            inp = grpcclient.InferInput(name, list(arr.shape), "INT32" if dtype is np.int32 else "INT64")
            inp.set_data_from_numpy(arr)
            out.append(inp)
        return out

    def _order(self) -> list[_Endpoint]:
        """Round-robin over the endpoints that are up; the others last (maybe they are back)."""
        n = len(self._endpoints)
        start = next(self._rr) % n
        rotated = self._endpoints[start:] + self._endpoints[:start]
        return [ep for ep in rotated if ep.up] + [ep for ep in rotated if not ep.up]

    async def embed(self, batch: TokenBatch, *, timeout_s: float | None = None) -> Embeddings:
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
        inputs = self._inputs(batch)
        timeout = timeout_s or self.timeout_s
        t0 = time.perf_counter()
        last: EmbedcarError = Unavailable("no Triton endpoint")
        for ep in self._order():
            try:
                result = await ep.client.infer(
                    self.model_name, inputs, client_timeout=timeout,
                    timeout=int(timeout * 1_000_000))  # Triton's server-side timeout, microseconds
                emb = result.as_numpy("embedding")
            except Exception as exc:
                err = map_error(exc, ep.url)
                self.stats.errors[err.code] = self.stats.errors.get(err.code, 0) + 1
                if isinstance(err, Unavailable):
                    self._mark(ep, False)
                    last = err
                    continue  # another URL may be up; embeddings are idempotent, so retry is safe
                raise err from exc
            if emb is None or emb.shape != (b, self.dim):
                raise Internal(f"Triton returned {None if emb is None else emb.shape}, expected {(b, self.dim)}")
            self._mark(ep, True)
            self.stats.calls += 1
            self.stats.items += b
            self.stats.busy_s += time.perf_counter() - t0
            return np.asarray(emb, dtype=np.float32)
        raise last

    # --- statistics --------------------------------------------------------------------------
    async def statistics(self) -> dict[str, dict[str, float | int]]:
        """Per model: counts and cumulative ns from Triton's statistics API, summed over URLs up."""
        out: dict[str, dict[str, float | int]] = {}
        for ep in self._endpoints:
            if not ep.up:
                continue
            try:
                raw = await ep.client.get_inference_statistics(as_json=True, client_timeout=self.timeout_s)
            except Exception as exc:
                raise map_error(exc, ep.url) from exc
            for name, flat in flatten_statistics(raw).items():
                acc = out.setdefault(name, {})
                for k, v in flat.items():
                    acc[k] = acc.get(k, 0) + v
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
