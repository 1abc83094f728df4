"""pytest fixtures for the demo tests.

`inprocess_search` is a real `SearchFn` (real ORT embeddings, exact inner product over ~330 real
grocery titles) that exercises the websocket logic without a sidecar; `sidecar_search_target`
is a real Sidecar (embedded backend) serving a small real catalog index built by the catalog job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pytest

from catalog.fusion import SearchMode
from demo_ui.limits import LIMITS, DemoLimits
from demo_ui.search import SearchFn
from demo_ui.server import build_server, create_app
from embedcar_client.results import SearchHit, SearchResult
from embedcar_settings import DemoSettings, Settings
from inference.backends.onnx import OnnxBackend
from inference.embedder import Embedder
from inference.tokenizer import QueryTokenizer

if TYPE_CHECKING:
    from catalog.sources import Product

SAMPLE_STRIDE = 160  # every 160th of the 49,688 titles: ~310 products across all aisles

# Test modules import these fixtures by name (conftest does not load this file as a plugin), so
# each importing module gets its own fixture definition: the expensive objects (embedded sample,
# started sidecar) are shared through this module-level cache instead of built once per module.
_SHARED: dict[str, Any] = {}


def grocery_sample() -> list[Product]:
    """~330 real grocery products: a stride over the catalog plus some Greek yogurts."""
    from catalog.sources import read_grocery

    rows = read_grocery().products
    picked = {p.id: p for p in rows[::SAMPLE_STRIDE]}
    wanted = len(picked) + 20
    for p in rows:
        title = p.fields.get("title", "").lower()
        if "greek" in title and "yogurt" in title:
            picked.setdefault(p.id, p)
            if len(picked) >= wanted:
                break
    return list(picked.values())


@dataclass
class InProcessSearch:
    """Real embeddings + exact search, in the calling process (no sidecar, no cache)."""

    embedder: Embedder
    products: list[dict[str, str]]  # fields of each product
    vectors: npt.NDArray[np.float32]
    calls: int = 0
    modes: list[SearchMode] = field(default_factory=list)

    async def __call__(self, text: str, *, k: int, timeout_s: float,
                       mode: SearchMode = SearchMode.SEMANTIC) -> SearchResult:
        self.calls += 1
        self.modes.append(mode)  # searched semantically whatever the mode: the page logic is under test
        emb = await self.embedder.embed([text])
        t0 = time.perf_counter_ns()
        scores = self.vectors @ emb.embeddings[0]
        top = np.argsort(-scores)[:k]
        t1 = time.perf_counter_ns()
        found = [SearchHit(str(i), float(scores[i]), self.products[i], ("semantic",)) for i in top]
        timings = {"tokenize": emb.timings_ns["tokenize"], "inference": emb.timings_ns["inference"],
                   "search": t1 - t0, "cache": 0, "queue": 0}
        return SearchResult([found], "in-process", "", [False], timings)


@dataclass
class GatedSearch:
    """Wraps a SearchFn; while `gate` is clear every call waits on it (to make keystrokes pile up)."""

    inner: SearchFn
    gate: asyncio.Event
    entered: asyncio.Event
    texts: list[str]

    async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchResult:
        self.texts.append(text)
        self.entered.set()
        await self.gate.wait()
        return await self.inner(text, k=k, timeout_s=timeout_s, mode=mode)


@pytest.fixture(scope="session")
def inprocess_search(tokenizer: QueryTokenizer, onnx_backend: OnnxBackend) -> InProcessSearch:
    if "inprocess" not in _SHARED:  # shared by the modules that import this fixture (see _SHARED)
        products = [p.fields for p in grocery_sample()]
        embedder = Embedder(tokenizer, onnx_backend)
        res = asyncio.run(embedder.embed([p["title"] for p in products], check=False, backend_batch=64))
        _SHARED["inprocess"] = InProcessSearch(embedder, products, res.embeddings)
    found: InProcessSearch = _SHARED["inprocess"]
    return found


@contextlib.asynccontextmanager
async def running_demo(search: SearchFn, demo: DemoSettings | None = None,
                       info: dict[str, str] | None = None, limits: DemoLimits = LIMITS) -> AsyncIterator[str]:
    """A real uvicorn demo server on 127.0.0.1:<free port> in the current loop; yields its base URL."""
    settings = demo or DemoSettings()
    server = build_server(create_app(settings, search, info=info, limits=limits), settings, port=0, limits=limits)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("demo server stopped before it started")
        await asyncio.sleep(0.01)
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.should_exit = True
        await task


# --- a real sidecar with a small real index ----------------------------------------------------
def _start_shared_sidecar(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> str:
    if "target" in _SHARED:
        return str(_SHARED["target"])
    from sidecar.app import SidecarThread

    root = tmp_path_factory.mktemp("demo-index")
    build_small_index(settings.with_section("catalog", index_root=root), grocery_sample())
    s = settings.with_section("sidecar", grpc_port=0, http_port=-1, index_dir=root,
                              backend="embedded", api_keys="", api_keys_file=None)
    s = s.with_section("model", intra_op_threads=2)
    thread = SidecarThread(s)
    car = thread.__enter__()
    _SHARED.update(thread=thread, target=car.grpc_target, index_root=root)
    return str(car.grpc_target)


def _stop_shared_sidecar() -> None:
    thread = _SHARED.pop("thread", None)
    for key in ("target", "index_root"):
        _SHARED.pop(key, None)
    if thread is not None:
        thread.__exit__(None, None, None)


@pytest.fixture(scope="session")
def sidecar_search_target(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """gRPC target of a real Sidecar (embedded ORT backend) serving a small real index; no API keys."""
    target = _start_shared_sidecar(settings, tmp_path_factory)
    yield target
    _stop_shared_sidecar()


def build_small_index(settings: Settings, products: list[Product]) -> Path:
    """A real catalog index (exact search) of `products` under settings.catalog.index_root."""
    from catalog.job import build
    from catalog.sources import Loaded
    from catalog.spec import BuildSpec
    from inference.aio import run_sync

    spec = BuildSpec(text_fields=settings.catalog.text_fields, index_type="flat")
    loaded = Loaded(products=list(products), source="demo test sample")
    summary = run_sync(build(settings, spec, loaded=loaded, progress=False))
    assert summary.version_dir is not None
    return summary.version_dir


def sidecar_search_fn(target: str) -> SearchFn:
    """A `SidecarSearch` whose client channel is opened lazily in the calling event loop."""
    from demo_ui.search import SidecarSearch
    from embedcar_client.client import AsyncClient

    class _Lazy:
        def __init__(self) -> None:
            self.inner: SidecarSearch | None = None

        async def __call__(self, text: str, *, k: int, timeout_s: float, mode: SearchMode) -> SearchResult:
            if self.inner is None:
                client = AsyncClient(target)
                await client.__aenter__()
                self.inner = SidecarSearch(client)
            return await self.inner(text, k=k, timeout_s=timeout_s, mode=mode)

    return _Lazy()
