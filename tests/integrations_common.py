"""What the search-engine integration tests share: a sidecar set up as docs/integrations/ tells a
search node to run it (API key on, HTTP on, a request may carry an engine's whole batch), the
catalog-like texts they send, and the Python client's vectors the engines' answers must equal."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from embedcar_client.client import Client
from embedcar_settings import Settings
from sidecar.app import SidecarThread
from tests.fixtures_sidecar import sidecar_settings

KEY = "sk-engine-" + "5e4c" * 8
WRONG_KEY = "sk-engine-" + "0bad" * 8
# Elasticsearch's `openai` service and LangChain4j batch up to 2048 texts per request
# (OpenAiServiceFields.EMBEDDING_MAX_BATCH_SIZE, OpenAiEmbeddingModel.maxSegmentsPerBatch); the
# sidecar's default is 256, so docs/integrations/ raises it where the engine embeds at index time.
ENGINE_BATCH = 2048

# Product titles as a catalog holds them: punctuation, quotes, ampersands, accents, emoji.
TITLES = [
    "Organic Whole Milk, 1 gal",
    'Ben & Jerry\'s "Chunky Monkey" Ice Cream',
    "Café Bustelo Espresso Ground Coffee",
    "Gluten-Free Penne Pasta 12 oz",
    "Jalapeño Kettle Chips 🌶️",
    "greek yogurt",
]


@dataclass(frozen=True, slots=True)
class EngineSidecar:
    http: str  # http://127.0.0.1:PORT
    grpc: str  # 127.0.0.1:PORT
    model: str  # the served model's name: what an engine's config puts in `model`

    def reference(self, texts: list[str]) -> npt.NDArray[np.float32]:
        """The vectors the Python gRPC client gets for `texts`."""
        with Client(self.grpc, api_key=KEY) as c:
            return c.embed(texts).embeddings.copy()


@contextmanager
def engine_sidecar(settings: Settings, **sidecar: Any) -> Iterator[EngineSidecar]:
    s = sidecar_settings(settings.with_section("model", max_texts_per_call=ENGINE_BATCH), api_keys=f"search={KEY}",
                         **sidecar)
    with SidecarThread(s) as car:
        yield EngineSidecar(f"http://127.0.0.1:{car.http_port}", car.grpc_target, car.model.name)
