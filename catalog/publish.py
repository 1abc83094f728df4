"""The job's last step: build the FAISS index over the vectors and the lexical (tantivy) index over
the same texts, write both into one version folder, publish it atomically (`catalog.store.publish`),
then prune old versions and stale temp folders. Shard merges publish through here too, so a merged
version gets its lexical index as well."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog import store
from catalog.index import build_faiss, faiss_module
from catalog.lexical import LEXICAL_DIR, build_lexical
from catalog.product_table import write_products
from catalog.settings import Settings
from catalog.sources import Product, compose_text

F32 = npt.NDArray[np.float32]
KEEP_VERSIONS = 3


def publish_index(settings: Settings, vectors: F32, products: Sequence[Product], meta: dict[str, Any],
                  *, index_type: str | None = None, calibration: F32 | None = None) -> tuple[Path, dict[str, Any]]:
    """Publish a new version of `products` (row i = vectors[i]); returns it and the index parameters."""
    faiss = faiss_module()
    root = settings.catalog.index_root
    t0 = time.perf_counter()
    index, params = build_faiss(vectors, settings.catalog, index_type=index_type, queries=calibration)
    params["build_seconds"] = round(time.perf_counter() - t0, 3)
    name = store.new_version_name()
    manifest = {"format": store.FORMAT, "version": name, "count": len(products), "dim": int(vectors.shape[1]),
                "index": params, "generated_items": sum(1 for p in products if p.fields.get("generated") == "true"),
                **meta}

    # The lexical index searches the very text that was embedded (the manifest's text fields).
    text_fields = tuple(meta.get("text_fields") or settings.catalog.text_fields)

    def write(tmp: Path) -> None:
        faiss.write_index(index, str(tmp / store.INDEX_FILE))
        np.save(tmp / store.VECTORS_FILE, np.ascontiguousarray(vectors, dtype=np.float32))
        write_products(tmp / store.PRODUCTS_FILE, products)
        manifest["lexical"] = build_lexical(tmp / LEXICAL_DIR, [compose_text(p.fields, text_fields) for p in products],
                                            products)
        (tmp / store.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))

    version = store.publish(root, write, name=name)
    store.prune(root, keep=KEEP_VERSIONS)
    store.remove_stale_temps(root)
    return version, params
