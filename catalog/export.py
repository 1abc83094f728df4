"""`embedcar catalog export`: an index version's vectors as a search engine's bulk feed.

The engine then indexes the very vectors the catalog job computed (one document per product id,
its fields beside its vector), and compares them at query time with the vectors the sidecar
computes for queries: the same model version and variant, so the version exported is the newest
one built by the model the sidecar serves (its `model_id`), as the sidecar's own Search picks.

Formats (docs/integrations/ shows each engine's mapping and the command that loads the file):
- `elasticsearch`, `opensearch`: NDJSON for `_bulk` (an `index` action line, then the document);
- `solr`: a JSON array of documents for `/update`;
- `vespa`: JSON Lines of `put` operations for `vespa feed` (the tensor as `{"values": [...]}`).
Vectors are written as float32 values in shortest decimal form: the engine reads back exactly the
float32 the catalog job stored. Fields are written typed where the catalog had types (JSON Lines,
Parquet: numbers as JSON numbers, booleans, lists), so an engine's dynamic mapping stores a price as
a number; a CSV's fields are text. The product id is its exact text everywhere (Elasticsearch's `_id`,
Solr's `id` and Vespa's document id are strings; `product_id` too, so one Vespa schema fits any catalog):
what the catalog's rows join back on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from catalog import store
from catalog.product_table import read_products
from inference.errors import InvalidInput, NotFound

FORMATS = ("elasticsearch", "opensearch", "solr", "vespa")


@dataclass(frozen=True, slots=True)
class ExportSpec:
    fmt: str
    index: str = "products"  # Elasticsearch/OpenSearch index name
    field: str = "embedding"  # the vector field's name in the engine's schema
    namespace: str = "shop"  # Vespa document id: id:<namespace>:<doc_type>::<product id>
    doc_type: str = "product"


def version_for(index_root: Path, model_id: str) -> Path:
    """The newest complete version built by `model_id` (what a sidecar serving it searches)."""
    version = store.newest_version(index_root, model_id=model_id)
    if version is None:
        raise NotFound(f"no index version of model {model_id} under {index_root}: run `embedcar catalog build`")
    return version


def documents(version_dir: Path, spec: ExportSpec) -> Iterator[str]:
    """One line per product (two for Elasticsearch/OpenSearch: the action, then the document)."""
    if spec.fmt not in FORMATS:
        raise InvalidInput(f"unknown export format {spec.fmt!r} (one of {', '.join(FORMATS)})")
    products, _ = read_products(version_dir / store.PRODUCTS_FILE)
    vectors = np.load(version_dir / store.VECTORS_FILE, mmap_mode="r")
    if len(products) != vectors.shape[0]:
        raise InvalidInput(f"{version_dir}: {len(products)} products but {vectors.shape[0]} vectors")
    for product, row in zip(products, vectors, strict=True):
        # float32 -> Python float keeps the float32 value; repr is its shortest exact decimal.
        values = np.asarray(row, dtype=np.float32).tolist()
        fields: dict[str, Any] = {name: value for name, value in product.typed().items() if name != spec.field}
        if spec.fmt in ("elasticsearch", "opensearch"):
            yield _json({"index": {"_index": spec.index, "_id": product.id}})
            yield _json(fields | {spec.field: values})
        elif spec.fmt == "solr":  # a field named "id" (the id was another column) must not replace the key
            yield _json({"id": product.id} | {k: v for k, v in fields.items() if k != "id"} | {spec.field: values})
        else:
            yield _json({"put": f"id:{spec.namespace}:{spec.doc_type}::{product.id}",
                         "fields": fields | {"product_id": product.id, spec.field: {"values": values}}})


def write_export(version_dir: Path, spec: ExportSpec, out: IO[str]) -> int:
    """Writes the feed; returns the number of products."""
    n = 0
    lines = documents(version_dir, spec)
    if spec.fmt == "solr":  # one JSON array, streamed
        out.write("[\n")
        for n, line in enumerate(lines, 1):
            out.write(("" if n == 1 else ",\n") + line)
        out.write("\n]\n")
        return n
    per_product = 2 if spec.fmt in ("elasticsearch", "opensearch") else 1
    for i, line in enumerate(lines, 1):
        out.write(line + "\n")
        n = i // per_product
    return n


def _json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
