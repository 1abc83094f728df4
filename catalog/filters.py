"""Search filters on a catalog's own columns.

At build time `filter_fields` picks the columns Search may filter on (the `catalog.filter_fields`
setting, matched to the file's columns case-insensitively; `department` and `aisle` where the
catalog has them when none are declared) and the version's manifest records them as the file names
them. At query time `check` reads a request's filters against the version: a field it does not
have, or a value no product has, is refused naming what there is, never answered with a silent
empty list (a misspelt department would otherwise look like an empty shelf).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

from inference.errors import InvalidInput

DEFAULT_FIELDS = ("department", "aisle")  # what versions built before `filter_fields` filter on
MAX_FIELDS = 16  # each is a FAISS mask and a tantivy field; more is a schema, not a filter
Filters = tuple[tuple[str, str], ...]  # (field as the index names it, normalized value), one per field


class HasFields(Protocol):
    @property
    def fields(self) -> Mapping[str, Any]: ...


def value_key(value: object) -> str:
    """A filter value as both legs compare it: trimmed, case-insensitive."""
    return str(value).strip().lower()


def merged(filters: Mapping[str, str] | None = None, *, department: str | None = None,
           aisle: str | None = None) -> dict[str, str]:
    """A request's filters with the `department` / `aisle` shorthands folded in; empty values dropped."""
    out = {k: v for k, v in (filters or {}).items() if v}
    for name, value in (("department", department), ("aisle", aisle)):
        if value:
            if name in out and value_key(out[name]) != value_key(value):
                raise InvalidInput(f"filter {name!r} given twice with different values")
            out[name] = value
    return out


def product_columns(products: Iterable[HasFields]) -> list[str]:
    """Every field name the products carry, in first-seen order (what a JSONL file's columns are)."""
    names: dict[str, None] = {}
    for p in products:
        names.update(dict.fromkeys(p.fields))
    return list(names)


def filter_fields(declared: Sequence[str], columns: Iterable[str], source: str) -> tuple[str, ...]:
    """The columns to filter on, named as the file names them. `declared` empty: `department` and
    `aisle` where present; otherwise each declared name must match a column (case-insensitively)."""
    cols = [c for c in columns if c]
    by_key: dict[str, str] = {}
    for c in cols:
        by_key.setdefault(c.casefold(), c)
    if not declared:
        return tuple(by_key[f] for f in DEFAULT_FIELDS if f in by_key)
    if len(declared) > MAX_FIELDS:
        raise InvalidInput(f"--filter-fields: {len(declared)} fields, at most {MAX_FIELDS}")
    out: list[str] = []
    for name in declared:
        col = by_key.get(name.strip().casefold())
        if col is None:
            near = difflib.get_close_matches(name.casefold(), list(by_key), 1, 0.6)
            hint = f"; did you mean {by_key[near[0]]!r}?" if near else ""
            listing = ", ".join(cols[:20]) + (f", +{len(cols) - 20} more" if len(cols) > 20 else "")
            raise InvalidInput(f"{source}: no column {name!r} for --filter-fields (found: {listing}){hint}")
        if col not in out:
            out.append(col)
    return tuple(out)


def check(requested: Mapping[str, str], fields: Sequence[str], values: Mapping[str, Collection[str]],
          version: str) -> Filters:
    """`requested` (name -> value) as the version's fields and normalized values, in the version's
    field order. `values[field]`: every normalized value the field takes in the version."""
    by_key = {f.casefold(): f for f in fields}
    out: dict[str, str] = {}
    for name, raw in requested.items():
        if not isinstance(raw, str):
            raise InvalidInput(f"filter {name!r} must be a string")
        field = by_key.get(name.strip().casefold())
        if field is None:
            has = ", ".join(fields) if fields else "none (build it with --filter-fields)"
            raise InvalidInput(f"index version {version} has no filter field {name[:40]!r}; its filter fields: {has}")
        want = value_key(raw)
        if not want:
            continue
        known = values.get(field, ())
        if want not in known:
            # A misspelling, or part of a value ("candy" for "candy chocolate")
            near = difflib.get_close_matches(want, list(known), 3, 0.6) or sorted(v for v in known if want in v)[:3]
            hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
            raise InvalidInput(f"no product in index version {version} has {field} {raw[:80]!r}{hint}")
        out[field] = want
    return tuple((f, out[f]) for f in fields if f in out)
