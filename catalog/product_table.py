"""`products.parquet` of a version or shard: row i is the product of vector i.

String columns only (id + every product field as its text, "" where a product lacks one): the sidecar
(Search's fields, filters, completion) and older versions read the table as text. A column whose
values share one type (JSON Lines or Parquet numbers, booleans, lists) says so in its field metadata
(`embedcar.type`: int, float, bool or json) and `read_products` gives the typed values back
(`Product.values`), which exports write. A mixed column, and a CSV's, stays text. A shard's file also
has `_row`, each product's position in the full source, so a merge restores source order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from catalog.sources import Product

ROW_COLUMN = "_row"
TYPE_KEY = b"embedcar.type"
# The text of a typed value (catalog/sources.py: str(), "true"/"false", JSON) back to the value.
_DECODE: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "bool": lambda t: t == "true",
                                            "json": json.loads}


def write_products(path: Path, products: Sequence[Product], *, rows: Sequence[int] | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    names: dict[str, None] = {}
    for p in products:
        names.update(dict.fromkeys(p.fields))
    fields = [pa.field("id", pa.string())]
    arrays = [pa.array([p.id for p in products], pa.string())]
    for name in names:
        kind = column_type(p.values.get(name, p.fields[name]) for p in products if p.fields.get(name, ""))
        fields.append(pa.field(name, pa.string(), metadata=None if kind is None else {TYPE_KEY: kind.encode()}))
        arrays.append(pa.array([p.fields.get(name, "") for p in products], pa.string()))
    if rows is not None:
        fields.append(pa.field(ROW_COLUMN, pa.int64()))
        arrays.append(pa.array(list(rows), pa.int64()))
    pq.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(fields)), path)


def column_type(values: Iterable[Any]) -> str | None:
    """The one type of a column's (non-empty) values, or None: text, or types that disagree. Ints and
    floats together are float (JSON writes a price 5 beside 4.99; an engine mapping it as an integer
    from the first would truncate the rest)."""
    kinds = {_kind(v) for v in values}
    if kinds == {"int", "float"}:
        return "float"
    return next(iter(kinds)) if len(kinds) == 1 and "text" not in kinds else None


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    return "json" if isinstance(v, list | dict) else "text"


def read_products(path: Path) -> tuple[list[Product], list[int] | None]:
    """The products (empty fields left out, typed values where a column is typed) and, for a shard's
    file, their source rows. A file without type metadata (older versions') reads as text only."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    rows = table[ROW_COLUMN].to_pylist() if ROW_COLUMN in table.column_names else None
    names = [c for c in table.column_names if c not in ("id", ROW_COLUMN)]
    data = {c: table[c].to_pylist() for c in names}
    kinds = {c: (table.schema.field(c).metadata or {}).get(TYPE_KEY, b"").decode() for c in names}
    typed = [c for c in names if kinds[c] in _DECODE]
    ids = table["id"].to_pylist()
    products = []
    for i, pid in enumerate(ids):
        fields = {c: data[c][i] for c in names if data[c][i]}
        values = {c: _DECODE[kinds[c]](fields[c]) for c in typed if c in fields}
        products.append(Product(pid, fields, 0, values))
    return products, rows
