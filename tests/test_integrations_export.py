"""`embedcar catalog export`: the catalog job's vectors as each engine's bulk feed, read back as the
engine's bulk loader reads it (NDJSON action/document pairs, a JSON array, JSON Lines of puts), and
each document checked against the mapping that engine's page in docs/integrations/ declares: every
mapped field holds the JSON type the engine's field type takes (a `float` price a number, not "4.5")."""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from catalog import store
from catalog.product_table import read_products
from inference.cli_main import main as cli_main
from tests.conftest import ROOT

INTEGRATIONS = ROOT / "docs" / "integrations"
# Each engine's field types (as its page declares them) -> the JSON type its bulk loader takes there.
_NUMBER, _INTEGER, _TEXT, _BOOL, _VECTOR, _TENSOR = "number", "integer", "text", "boolean", "vector", "tensor"
ENGINE_TYPES = {
    "elasticsearch": {"text": _TEXT, "keyword": _TEXT, "float": _NUMBER, "double": _NUMBER, "scaled_float": _NUMBER,
                      "long": _INTEGER, "integer": _INTEGER, "boolean": _BOOL, "dense_vector": _VECTOR},
    "opensearch": {"text": _TEXT, "keyword": _TEXT, "float": _NUMBER, "double": _NUMBER, "long": _INTEGER,
                   "integer": _INTEGER, "boolean": _BOOL, "knn_vector": _VECTOR},
    "solr": {"string": _TEXT, "text_general": _TEXT, "pfloat": _NUMBER, "pdouble": _NUMBER, "plong": _INTEGER,
             "pint": _INTEGER, "boolean": _BOOL, "vector384": _VECTOR},
    "vespa": {"string": _TEXT, "float": _NUMBER, "double": _NUMBER, "long": _INTEGER, "int": _INTEGER,
              "bool": _BOOL, "tensor<float>(x[384])": _TENSOR},
}


def documented_mapping(engine: str) -> dict[str, str]:
    """Field name -> JSON type, from the index mapping / schema on docs/integrations/<engine>.md."""
    page = (INTEGRATIONS / f"{engine}.md").read_text(encoding="utf-8")
    if engine in ("elasticsearch", "opensearch"):
        body = page.split("PUT products\n", 1)[1].split("```", 1)[0]
        declared = {k: v["type"] for k, v in json.loads(body)["mappings"]["properties"].items()}
    elif engine == "solr":
        declared = dict(re.findall(r'<field name="(\w+)" type="(\w+)"', page))
    else:
        declared = dict(re.findall(r"^\s*field (\w+) type (\S+) \{", page, flags=re.MULTILINE))
    assert declared, f"no mapping found on {engine}.md"
    unknown = {f: t for f, t in declared.items() if t not in ENGINE_TYPES[engine]}
    assert not unknown, f"{engine}.md declares types this test does not know: {unknown}"
    return {f: ENGINE_TYPES[engine][t] for f, t in declared.items()}


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _INTEGER
    if isinstance(value, float):
        return _NUMBER
    if isinstance(value, str):
        return _TEXT
    if isinstance(value, dict) and list(value) == ["values"]:
        return _TENSOR
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return _VECTOR
    return type(value).__name__


def check_documented_types(engine: str, docs: list[dict[str, Any]], *, text_only: Collection[str] = ()) -> None:
    """Every field a document shares with the page's mapping holds that mapping's JSON type (an integer
    is a number too); `text_only`: fields from a CSV, text whatever the mapping (the engine converts)."""
    mapping = documented_mapping(engine)
    for doc in docs:
        for name, want in mapping.items():
            if name not in doc:
                continue
            got = json_type(doc[name])
            ok = got == want or (want == _NUMBER and got == _INTEGER) or (name in text_only and got == _TEXT)
            assert ok, f"{engine}: {name}={doc[name]!r} is {got}, the mapping on {engine}.md wants {want}"


def export(fmt: str, root: Path, model_dir: Path, out: Path, *extra: str) -> str:
    rc = cli_main(["catalog", "export", fmt, "--out", str(out), "--index-root", str(root),
                   "--models-dir", str(model_dir.parent), "--variant", "fp32", *extra])
    assert rc == 0
    return out.read_text(encoding="utf-8")


def exported_documents(fmt: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    """(the id the engine stores the document under, the document's fields), as its loader reads them."""
    if fmt in ("elasticsearch", "opensearch"):
        lines = [json.loads(line) for line in text.splitlines()]
        return [(a["index"]["_id"], d) for a, d in zip(lines[::2], lines[1::2], strict=True)]
    if fmt == "solr":
        return [(d["id"], d) for d in json.loads(text)]
    puts = [json.loads(line) for line in text.splitlines()]
    return [(p["put"].split("::", 1)[1], p["fields"]) for p in puts]


def catalog_vectors(root: Path) -> tuple[list[str], np.ndarray]:
    version = store.newest_version(root)
    assert version is not None
    products, _ = read_products(version / store.PRODUCTS_FILE)
    return [p.id for p in products], np.load(version / store.VECTORS_FILE)


@pytest.mark.parametrize("fmt", ["elasticsearch", "opensearch"])
def test_bulk_ndjson_pairs_carry_each_products_exact_vector(fmt: str, grocery_index_root: Path, model_dir: Path,
                                                            tmp_path: Path) -> None:
    text = export(fmt, grocery_index_root, model_dir, tmp_path / "bulk.ndjson", "--index", "shop-products")
    ids, vectors = catalog_vectors(grocery_index_root)
    lines = text.splitlines()
    assert text.endswith("\n") and len(lines) == 2 * len(ids)  # _bulk needs the final newline
    for i in (0, 1, len(ids) - 1):
        action, doc = json.loads(lines[2 * i]), json.loads(lines[2 * i + 1])
        assert action == {"index": {"_index": "shop-products", "_id": ids[i]}}
        assert doc["title"] and np.array_equal(np.asarray(doc["embedding"], dtype=np.float32), vectors[i])
        # dense_vector with dot_product accepts only unit-length float32 vectors (|m^2 - 1| <= 1e-4)
        v = np.asarray(doc["embedding"], dtype=np.float32)
        assert abs(float(np.sum(v * v, dtype=np.float32)) - 1) <= 1e-4
    docs = [d for _id, d in exported_documents(fmt, text)]
    assert all(isinstance(d["price"], float) for d in docs)  # the grocery catalog's prices are numbers
    check_documented_types(fmt, docs)


def test_solr_update_array_and_vespa_feed(grocery_index_root: Path, model_dir: Path, tmp_path: Path) -> None:
    ids, vectors = catalog_vectors(grocery_index_root)
    solr: list[dict[str, Any]] = json.loads(export("solr", grocery_index_root, model_dir, tmp_path / "solr.json",
                                                   "--field", "vector"))
    assert [d["id"] for d in solr] == ids
    assert np.array_equal(np.asarray([d["vector"] for d in solr], dtype=np.float32), vectors)
    check_documented_types("solr", solr)
    text = export("vespa", grocery_index_root, model_dir, tmp_path / "feed.jsonl", "--namespace", "grocery")
    puts = [json.loads(line) for line in text.splitlines()]
    assert [p["put"] for p in puts] == [f"id:grocery:product::{i}" for i in ids]
    assert puts[0]["fields"]["product_id"] == ids[0]
    assert np.array_equal(np.asarray(puts[-1]["fields"]["embedding"]["values"], dtype=np.float32), vectors[-1])
    check_documented_types("vespa", [p["fields"] for p in puts])


def test_export_refuses_an_index_of_another_model(grocery_index_root: Path, model_dir: Path, tmp_path: Path) -> None:
    """The grocery slice was built with fp32: an int8 sidecar's query vectors must not meet it."""
    rc = cli_main(["catalog", "export", "solr", "--out", str(tmp_path / "x.json"), "--index-root",
                   str(grocery_index_root), "--models-dir", str(model_dir.parent), "--variant", "int8"])
    assert rc != 0 and not (tmp_path / "x.json").exists()
