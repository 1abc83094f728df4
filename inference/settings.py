"""The one settings object: built once per process from `EMBEDCAR_*` variables and CLI flags.

No other module reads the environment. Every field is documented; `describe()` prints them with
secrets redacted. Environment names are `EMBEDCAR_<SECTION>_<FIELD>`, e.g.
`EMBEDCAR_SIDECAR_GRPC_PORT=50051`; tuples are comma-separated.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from inference.errors import InvalidInput


def _f(default: Any, doc: str, *, secret: bool = False) -> Any:
    # repr=False for secrets: a settings object in a log line or a traceback must not show them.
    return field(default=default, metadata={"doc": doc, "secret": secret}, repr=not secret)


@dataclass(frozen=True, slots=True)
class ModelSettings:
    models_dir: Path = _f(Path("models"), "Folder holding prepared model directories (git-ignored).")
    name: str = _f("all-MiniLM-L6-v2", "Model directory name under models_dir.")
    variant: str = _f("fp32", "ONNX variant to serve: fp32 (fused), int8 or fp16.")
    intra_op_threads: int = _f(0, "ONNX Runtime intra-op threads; 0 = number of cores.")
    ort_spinning: bool = _f(True, "Embedded backend: let ORT threads spin between calls.")
    max_batch: int = _f(256, "Largest number of texts accepted in one embedding call.")
    max_text_chars: int = _f(20_000, "Texts longer than this are cut before tokenizing.")

    @property
    def model_dir(self) -> Path:
        return self.models_dir / self.name


@dataclass(frozen=True, slots=True)
class TritonSettings:
    host: str = _f("127.0.0.1", "Address the local tritonserver binds to (loopback by default).")
    grpc_port: int = _f(8001, "Triton gRPC port.")
    http_port: int = _f(8000, "Triton HTTP port.")
    metrics_port: int = _f(8002, "Triton Prometheus metrics port.")
    urls: tuple[str, ...] = _f(
        ("127.0.0.1:8001",), "Triton gRPC addresses the client spreads requests over."
    )
    repo_dir: Path = _f(Path("var/triton/repo"), "Generated model repository.")
    target: str = _f("cpu", "Model repository target: cpu (ORT in Python backend) or gpu.")
    max_queue_delay_us: int = _f(
        0, "Dynamic batching wait; paid in full at low traffic. 0 = batch only what is already queued."
    )
    preferred_batch_sizes: tuple[int, ...] = _f((4, 8, 16, 32), "Preferred dynamic batch sizes.")
    cpu_instances: int = _f(0, "Encoder instances on CPU; 0 = one per two cores (at least 1).")
    gpu_instances: int = _f(4, "Encoder instances per GPU (parallel CUDA streams).")
    cpu_pooling: str = _f(
        "fused", "CPU target: pool inside the encoder's stub (fused: one Python hop) or as its own step."
    )
    max_batch_size: int = _f(256, "max_batch_size of the generated models.")
    timeout_ms: int = _f(2000, "gRPC deadline and Triton server-side timeout per request.")
    engine_cache_dir: Path = _f(Path("var/trt-engines"), "Cache of TensorRT engines.")
    backend_dir: Path = _f(Path("var/triton/backends"), "Assembled backend directory (Python backend + stub).")
    ort_threads: int = _f(0, "ORT intra-op threads per CPU encoder instance; 0 = cores / instances.")
    ort_spinning: bool = _f(False, "Let ORT threads spin between ops (off: shared cores stay free).")
    shm_default_mb: int = _f(16, "Python backend shared-memory region per stub at start (MiB).")
    shm_growth_mb: int = _f(64, "Python backend shared-memory growth step (MiB).")
    startup_timeout_s: float = _f(120.0, "Longest wait for tritonserver to become ready.")
    probe_interval_s: float = _f(0.5, "Client: how often each Triton URL is probed for readiness.")


@dataclass(frozen=True, slots=True)
class SidecarSettings:
    host: str = _f("127.0.0.1", "Address the sidecar binds to; non-loopback requires API keys.")
    grpc_port: int = _f(50051, "Sidecar gRPC port (0 = pick a free one).")
    uds_path: Path | None = _f(
        None, "Also serve gRPC on this Unix socket, mode 0660 (same-host callers; access by file permissions)."
    )
    http_port: int = _f(8080, "HTTP facade port (0 = pick a free one, -1 = off).")
    backend: str = _f("embedded", "Inference backend: embedded (in-process ORT) or triton.")
    embedded_fallback: bool = _f(
        True, "Triton backend: answer with the embedded model while no Triton URL answers (only when the "
        "model's ONNX file is present in model_dir; replies and metrics name the backend that answered)."
    )
    api_keys: str = _f("", "tenant=key pairs, comma-separated.", secret=True)
    api_keys_file: Path | None = _f(None, "File of `tenant key` lines (or `tenant sha256:hex`).")
    rate_per_s: float = _f(1000.0, "Token bucket refill rate per tenant (requests/s).")
    burst: int = _f(200, "Token bucket size per tenant.")
    cache_entries: int = _f(100_000, "Hot-query cache size in entries (0 = off).")
    cache_ttl_s: float = _f(3600.0, "Cache entry lifetime.")
    max_message_bytes: int = _f(4 * 1024 * 1024, "Largest gRPC/HTTP request body.")
    batch_wait_us: int = _f(500, "Embedded micro-batcher: longest wait to fill a batch.")
    max_pending_batches: int = _f(2, "Admission: batches allowed to wait behind the running one.")
    admission_budget_ms: float = _f(
        10.0, "Admission: reject a request that would wait behind more than this much queued inference "
        "(keeps accepted latency near the 20 ms SLA under overload, the excess refused at once). 0 = deadline only."
    )
    default_deadline_ms: int = _f(1000, "Deadline for requests that carry none.")
    warm_queries_file: Path | None = _f(None, "Optional file of top queries to pre-load the cache.")
    index_dir: Path | None = _f(None, "Catalog index root to serve Search from (None = no Search).")
    grace_s: float = _f(5.0, "Graceful shutdown: time for in-flight requests to finish.")
    max_text_chars: int = _f(10_000, "Texts longer than this are rejected (INVALID_ARGUMENT).")
    batch_max_items: int = _f(32, "Embedded micro-batcher: most texts in one forward pass.")
    max_k: int = _f(100, "Largest k a Search may ask for.")
    index_poll_s: float = _f(5.0, "How often to look for a newer catalog index version.")
    health_poll_s: float = _f(0.5, "How often to probe the backend while it is down.")


@dataclass(frozen=True, slots=True)
class CatalogSettings:
    index_root: Path = _f(Path("indexes/grocery"), "Folder of versioned index directories.")
    index_type: str = _f("auto", "auto, flat (exact), ivf or hnsw.")
    ivf_nprobe: int = _f(0, "IVF lists probed per query; 0 = the value measured at build time.")
    hnsw_m: int = _f(32, "HNSW graph degree.")
    hnsw_ef_search: int = _f(64, "HNSW search breadth.")
    batch_size: int = _f(128, "Texts per backend call in the batch job.")
    in_flight: int = _f(2, "Backend calls in flight in the batch job.")
    search_threads: int = _f(1, "FAISS OpenMP threads (1 is fastest for single queries).")
    text_fields: tuple[str, ...] = _f(("title",), "Product fields joined (with ' | ') into the embedded text.")
    flat_max_items: int = _f(20_000, "auto index type: exact search up to this many items.")
    hnsw_max_items: int = _f(
        200_000, "auto index type: HNSW above flat_max_items up to this many items (its build grows fast), IVF above."
    )
    ivf_nlist: int = _f(0, "IVF lists; 0 = about sqrt(items).")
    ann_recall_target: float = _f(0.95, "Build-time nprobe choice: smallest reaching this recall@10 vs exact.")
    hnsw_ef_construction: int = _f(80, "HNSW build breadth (slow to build on CPU: see DESIGN).")
    chunk_items: int = _f(4096, "Batch job checkpoint granularity: items per chunk file.")
    use_gpu: bool = _f(True, "Move the index to the GPU when faiss has GPUs.")


@dataclass(frozen=True, slots=True)
class DemoSettings:
    host: str = _f("127.0.0.1", "Address the demo web server binds to.")
    port: int = _f(8765, "Demo web server port.")
    budget_ms: float = _f(20.0, "Per-keystroke latency budget shown on the page.")
    max_messages_per_s: float = _f(50.0, "Per-connection websocket message cap.")
    max_message_bytes: int = _f(4096, "Largest websocket message accepted; bigger closes the socket.")
    max_query_chars: int = _f(200, "Longest query text searched; longer gets an error message.")
    results: int = _f(10, "Products shown per keystroke.")
    search_timeout_s: float = _f(2.0, "Deadline of one Search call to the sidecar.")


@dataclass(frozen=True, slots=True)
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    triton: TritonSettings = field(default_factory=TritonSettings)
    sidecar: SidecarSettings = field(default_factory=SidecarSettings)
    catalog: CatalogSettings = field(default_factory=CatalogSettings)
    demo: DemoSettings = field(default_factory=DemoSettings)

    @classmethod
    def load(
        cls,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Self:
        """Defaults, then `EMBEDCAR_*` variables, then explicit overrides (CLI flags)."""
        env = os.environ if environ is None else environ
        sections: dict[str, Any] = {}
        for sec in dataclasses.fields(cls):
            sec_cls = typing.get_type_hints(cls)[sec.name]
            values: dict[str, Any] = {}
            hints = typing.get_type_hints(sec_cls)
            for f in dataclasses.fields(sec_cls):
                key = f"EMBEDCAR_{sec.name}_{f.name}".upper()
                if key in env:
                    values[f.name] = _parse(hints[f.name], env[key], key)
            for name, value in ((overrides or {}).get(sec.name) or {}).items():
                if value is not None:
                    values[name] = value
            sections[sec.name] = sec_cls(**values)
        return cls(**sections)

    def with_section(self, name: str, **changes: Any) -> Self:
        return dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **changes)})

    def describe(self) -> dict[str, dict[str, Any]]:
        """All values with secrets redacted: safe to log."""
        out: dict[str, dict[str, Any]] = {}
        for sec in dataclasses.fields(self):
            obj = getattr(self, sec.name)
            out[sec.name] = {
                f.name: ("<redacted>" if f.metadata.get("secret") and getattr(obj, f.name) else
                         str(getattr(obj, f.name)))
                for f in dataclasses.fields(obj)
            }
        return out

    @staticmethod
    def documentation() -> list[tuple[str, str, str]]:
        """(variable, default, doc) for every field, for the README and `--help`."""
        rows = []
        for sec in dataclasses.fields(Settings):
            sec_cls = typing.get_type_hints(Settings)[sec.name]
            for f in dataclasses.fields(sec_cls):
                rows.append((f"EMBEDCAR_{sec.name}_{f.name}".upper(), str(f.default),
                             f.metadata.get("doc", "")))
        return rows


def _parse(tp: Any, raw: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    try:
        if origin is tuple:
            item = args[0]
            return tuple(_parse(item, p.strip(), key) for p in raw.split(",") if p.strip())
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            inner = next(a for a in args if a is not type(None))
            return None if raw.strip() == "" else _parse(inner, raw, key)
        if tp is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if tp in (int, float, str, Path):
            return tp(raw)
    except (ValueError, StopIteration) as exc:
        raise InvalidInput(f"{key}: cannot read {raw!r} as {tp}") from exc
    raise InvalidInput(f"{key}: unsupported setting type {tp}")
