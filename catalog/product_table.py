"""`products.parquet` of a version or shard: row i is the product of vector i.

String columns only (id + every product field, "" where a product lacks one); a shard's file
also has `_row`, each product's position in the full source, so a merge restores source order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from catalog.sources import Product

ROW_COLUMN = "_row"


def write_products(path: Path, products: Sequence[Product], *, rows: Sequence[int] | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    names: dict[str, None] = {}
    for p in products:
        names.update(dict.fromkeys(p.fields))
    cols: dict[str, Any] = {"id": pa.array([p.id for p in products], pa.string())}
    for name in names:
        cols[name] = pa.array([p.fields.get(name, "") for p in products], pa.string())
    if rows is not None:
        cols[ROW_COLUMN] = pa.array(list(rows), pa.int64())
    pq.write_table(pa.table(cols), path)


def read_products(path: Path) -> tuple[list[Product], list[int] | None]:
    """The products (empty fields left out) and, for a shard's file, their source rows."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    rows = table[ROW_COLUMN].to_pylist() if ROW_COLUMN in table.column_names else None
    names = [c for c in table.column_names if c not in ("id", ROW_COLUMN)]
    data = {c: table[c].to_pylist() for c in names}
    ids = table["id"].to_pylist()
    return [Product(pid, {c: data[c][i] for c in names if data[c][i]}, 0) for i, pid in enumerate(ids)], rows
