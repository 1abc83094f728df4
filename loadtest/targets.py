"""What a load test can drive: the sidecar (gRPC Embed/Search, HTTP), Triton directly, the baseline.

Every target turns one request (a list of texts) into one call and raises only inference.errors
types, so the runner counts outcomes by their `code`. Dependencies of other packages (sidecar
client, Triton client) are imported inside the targets that need them.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference.errors import DeadlineExceeded, Internal, InvalidInput, Unavailable, error_for_http

if TYPE_CHECKING:
    from inference.settings import ModelSettings
    from inference.triton.tls import ClientCredentials

Timings = dict[str, int]

# "inprocess": the embedded ORT backend inside the generator's process (no server, no network): the
# floor any server adds to. "stub" answers after ~1 ms: a dry run of the generator itself.
# "infinity": Infinity (infinity-emb, loadtest/infinity.py) serving the same ONNX file over HTTP.
TARGETS = ("sidecar-embed", "sidecar-stream", "sidecar-search", "http", "triton", "baseline", "inprocess", "stub",
           "infinity")


class Target(ABC):
    """One system under test. `call` returns the server's per-stage timings when it reports them."""

    name: str = "target"

    async def start(self) -> None:  # noqa: B027 - optional hook, most targets need it
        """Open channels/connections (not timed)."""

    @abstractmethod
    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        """Send one request; raise an inference.errors type on failure."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release channels; idempotent."""

    async def server_stats(self) -> dict[str, dict[str, int]] | None:
        """Cumulative per-model server statistics (Triton), or None when the target has none."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"target": self.name}


class PoolTarget(Target):
    """Requests spread round-robin over several targets of one kind, each on its own connection: a
    pool of sidecars (e.g. one process per core) as a client that balances over them drives it."""

    def __init__(self, members: Sequence[Target]) -> None:
        if not members:
            raise InvalidInput("a pool needs at least one target")
        self.members = list(members)
        self.name = self.members[0].name
        self.calls = [0] * len(self.members)  # requests sent to each, warm-up included
        self._next = itertools.cycle(range(len(self.members)))

    async def start(self) -> None:
        for m in self.members:
            await m.start()

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        i = next(self._next)
        self.calls[i] += 1
        return await self.members[i].call(texts, timeout_s=timeout_s)

    async def close(self) -> None:
        for m in self.members:
            await m.close()

    async def server_stats(self) -> dict[str, dict[str, int]] | None:
        return await self.members[0].server_stats()  # members share any Triton they report on

    def describe(self) -> dict[str, Any]:
        return {**self.members[0].describe(),
                "pool": [{**m.describe(), "requests": n} for m, n in zip(self.members, self.calls, strict=True)]}


class SidecarEmbedTarget(Target):
    """The sidecar's gRPC Embed RPC through embedcar_client.client.AsyncClient."""

    name = "sidecar-embed"
    stream = False  # Embed as messages on one open Stream call instead of a unary call each

    def __init__(self, grpc_target: str, *, api_key: str | None = None, float16: bool = False,
                 triton_stats_url: str | None = None, triton_credentials: ClientCredentials | None = None) -> None:
        self.grpc_target = grpc_target
        self.api_key = api_key
        self.float16 = float16
        self._client: Any = None
        self._stats = TritonStats(triton_stats_url, triton_credentials) if triton_stats_url else None
        self.model = ""

    async def start(self) -> None:
        from embedcar_client.client import AsyncClient

        self._client = AsyncClient(self.grpc_target, api_key=self.api_key, stream=self.stream)
        await self._client.__aenter__()
        if self._stats is not None:
            await self._stats.start()

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        res = await self._client.embed(texts, float16=self.float16, timeout_s=timeout_s)
        self.model = res.model
        return dict(res.timings_ns)

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.__aexit__(None, None, None)
        if self._stats is not None:
            await self._stats.close()

    async def server_stats(self) -> dict[str, dict[str, int]] | None:
        return await self._stats.read() if self._stats is not None else None

    def observed(self, code: str, message: str, backend: str) -> None:
        """One outcome of a call sent for this target by another sender (loadtest.native): a
        target that records outcomes sees those calls too. Nothing to record here."""

    def describe(self) -> dict[str, Any]:
        return {"target": self.name, "address": self.grpc_target, "model": self.model}


class SidecarStreamTarget(SidecarEmbedTarget):
    """The same Embed requests as messages on one long-lived Stream call (AsyncClient(stream=True))."""

    name = "sidecar-stream"
    stream = True


class SidecarSearchTarget(SidecarEmbedTarget):
    """The sidecar's gRPC Search RPC (embedding + FAISS search)."""

    name = "sidecar-search"

    def __init__(self, grpc_target: str, *, api_key: str | None = None, k: int = 10,
                 triton_stats_url: str | None = None, triton_credentials: ClientCredentials | None = None) -> None:
        super().__init__(grpc_target, api_key=api_key, triton_stats_url=triton_stats_url,
                         triton_credentials=triton_credentials)
        self.k = k
        self.index_version = ""

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        res = await self._client.search(texts, k=self.k, timeout_s=timeout_s)
        self.model, self.index_version = res.model, res.index_version
        return dict(res.timings_ns)

    def describe(self) -> dict[str, Any]:
        return super().describe() | {"k": self.k, "index_version": self.index_version}


class HttpEmbedTarget(Target):
    """An OpenAI-compatible POST /v1/embeddings (the sidecar's HTTP facade or the baseline).

    `path` and `model` drive other servers of that API: Infinity answers POST /embeddings and wants
    the served model's name as the body's "model".
    """

    name = "http"

    def __init__(self, base_url: str, *, api_key: str | None = None, name: str | None = None,
                 triton_stats_url: str | None = None, path: str = "/v1/embeddings",
                 model: str | None = None, triton_credentials: ClientCredentials | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.path = path
        self._body_model = model
        self._headers = {"x-api-key": api_key} if api_key else {}
        self._client: Any = None
        self._stats = TritonStats(triton_stats_url, triton_credentials) if triton_stats_url else None
        self.model = ""
        if name:
            self.name = name

    async def start(self) -> None:
        import aiohttp

        # aiohttp rather than httpx: on this project's 2 shared cores the generator's own CPU is part
        # of every latency it reports, and per call (cache hits on the facade, same run) aiohttp cost
        # 0.37 ms of client CPU and httpx 1.42 (P50 0.81 vs 1.91 ms): docs/benchmarks.md, levers.
        # One keep-alive pool sized for the concurrency cap: connection set-up is not what we measure.
        self._client = aiohttp.ClientSession(base_url=self.base_url, headers=self._headers, trust_env=False,
                                             connector=aiohttp.TCPConnector(limit=256))
        if self._stats is not None:
            await self._stats.start()

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        import aiohttp

        body: dict[str, Any] = {"input": texts}
        if self._body_model:
            body["model"] = self._body_model
        try:
            async with self._client.post(self.path, json=body,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    raise error_for_http(r.status)(f"HTTP {r.status}: {(await r.text())[:200]}")
                answer = await r.json(content_type=None)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"no HTTP answer within {timeout_s:.3f} s") from exc
        except aiohttp.ClientError as exc:
            raise Unavailable(f"{self.base_url}: {exc}") from exc
        self.model = str(answer.get("model", ""))
        if len(answer.get("data", ())) != len(texts):
            raise Internal(f"asked for {len(texts)} embeddings, got {len(answer.get('data', ()))}")
        return None

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
        if self._stats is not None:
            await self._stats.close()

    async def server_stats(self) -> dict[str, dict[str, int]] | None:
        return await self._stats.read() if self._stats is not None else None

    def describe(self) -> dict[str, Any]:
        out = {"target": self.name, "address": self.base_url, "model": self.model}
        return out if self.path == "/v1/embeddings" else out | {"path": self.path}


class TritonTarget(Target):
    """Triton's ensemble directly (inference only): tokenize here, then TritonBackend.embed."""

    name = "triton"

    def __init__(self, urls: Sequence[str], model_dir: Path, *, variant: str | None = None,
                 model_name: str | None = None, credentials: ClientCredentials | None = None) -> None:
        self.urls = list(urls)
        self.credentials = credentials  # a hardened pool: TLS, the client key (and the operator's for statistics)
        self.model_dir = model_dir
        self.variant = variant
        self.model_name = model_name
        self._backend: Any = None
        self._tokenizer: Any = None

    async def start(self) -> None:
        from inference.backends.triton import TritonBackend
        from inference.embedder import load_tokenizer
        from inference.manifest import load_manifest

        manifest = load_manifest(self.model_dir)
        self._tokenizer = load_tokenizer(self.model_dir, manifest)
        self._backend = TritonBackend(self.urls, manifest, variant=self.variant, model_name=self.model_name,
                                      credentials=self.credentials)
        await self._backend.start()

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        import time

        t0 = time.perf_counter_ns()
        enc = self._tokenizer.encode(texts)
        calls = self._tokenizer.bucketed(enc)
        t1 = time.perf_counter_ns()
        await asyncio.gather(*(self._backend.embed(b, timeout_s=timeout_s) for _, b in calls))
        t2 = time.perf_counter_ns()
        return {"tokenize": t1 - t0, "inference": t2 - t1, "total": t2 - t0}

    async def close(self) -> None:
        if self._backend is not None:
            backend, self._backend = self._backend, None
            await backend.close()

    async def server_stats(self) -> dict[str, dict[str, int]] | None:
        if self._backend is None:
            return None
        raw = await self._backend.statistics()
        return {m: {k: int(v) for k, v in s.items()} for m, s in raw.items()}

    def describe(self) -> dict[str, Any]:
        version = getattr(self._backend, "version_id", "")
        return {"target": self.name, "address": ",".join(self.urls), "model": version}


class InProcessTarget(Target):
    """inference.embedder.Embedder over the embedded ONNX backend, in this process."""

    name = "inprocess"

    def __init__(self, model_dir: Path, *, variant: str | None = None, threads: int = 0) -> None:
        self.model_dir = model_dir
        self.variant = variant
        self.threads = threads
        self._embedder: Any = None

    @classmethod
    def for_model(cls, m: ModelSettings, variant: str | None = None) -> InProcessTarget:
        """Set up as the sidecar's embedded backend is from the same model settings."""
        return cls(m.model_dir, variant=variant or m.variant, threads=m.intra_op_threads)

    async def start(self) -> None:
        from inference.backends.onnx import OnnxBackend
        from inference.embedder import Embedder, load_tokenizer
        from inference.manifest import load_manifest

        manifest = load_manifest(self.model_dir)
        backend = OnnxBackend(self.model_dir, manifest, variant=self.variant, threads=self.threads)
        await backend.start()
        self._embedder = Embedder(load_tokenizer(self.model_dir, manifest), backend)

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        try:
            res = await asyncio.wait_for(self._embedder.embed(texts), timeout_s)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"no embedding within {timeout_s:.3f} s") from exc
        return dict(res.timings_ns)

    async def close(self) -> None:
        if self._embedder is not None:
            embedder, self._embedder = self._embedder, None
            await embedder.backend.close()

    def describe(self) -> dict[str, Any]:
        version = self._embedder.backend.version_id if self._embedder is not None else ""
        return {"target": self.name, "model": version}


class TritonStats:
    """Per-model cumulative statistics straight from a Triton gRPC endpoint (tritonclient aio).

    Used when the sidecar (not us) talks to Triton: the report diffs two snapshots to get the
    server-side queue/compute split over the run window.
    """

    def __init__(self, url: str, credentials: ClientCredentials | None = None) -> None:
        self.url = url
        self.credentials = credentials  # a hardened Triton: TLS, and statistics need the operator key
        self._client: Any = None

    async def start(self) -> None:
        import tritonclient.grpc.aio as grpcclient

        c = self.credentials
        self._client = grpcclient.InferenceServerClient(self.url) if c is None else grpcclient.InferenceServerClient(
            self.url, creds=c.channel_credentials(), channel_args=c.channel_options() or None)

    async def read(self) -> dict[str, dict[str, int]] | None:
        if self._client is None:
            return None
        c = self.credentials
        headers = dict(c.metadata + c.operator_metadata) if c is not None else None
        try:
            raw = await self._client.get_inference_statistics(as_json=True, headers=headers, client_timeout=5.0)
        except Exception:  # statistics are a report extra: a failed read must not fail the run
            return None
        from inference.backends.triton import flatten_statistics

        return {m: {k: int(v) for k, v in row.items()} for m, row in flatten_statistics(raw).items()}

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


class StubTarget(Target):
    """An in-process target for dry runs of the machinery: sleeps `service_ms` with jitter.

    Not a stand-in for a server in measurements; `embedcar loadtest --target stub` checks that the
    generator itself can keep a schedule on this machine.
    """

    name = "stub"

    def __init__(self, service_ms: float = 1.0, *, seed: int = 0) -> None:
        self.service_ms = service_ms
        self._rng = random.Random(seed)

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        await asyncio.sleep(self.service_ms / 1e3 * self._rng.uniform(0.5, 1.5))
        return None
