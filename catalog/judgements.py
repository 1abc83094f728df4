"""Labelled queries: a team's own relevance judgements, to score search and gate a tuned model with.

A judgements file is JSONL, CSV/TSV or Parquet, one (query, what is relevant) row each; a query's rows
are joined. What is relevant is either one product (`product_id`, as in a query log) or a whole
category (`category`: every product whose aisle, department or other category value equals it, as
shopper queries are often labelled by aisle). It is read with the catalog reader's file checks
(`catalog.sources.read_rows`) and checked against the products it will be scored on: unknown ids and
categories, empty queries and repeated rows are counted and reported by line; a file mostly bad is
refused naming its first bad row. The grocery demo's own set ships as `grocery` (GROCERY_JUDGEMENTS):
shopper queries labelled by the Instacart aisles that answer them, written for this project.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from catalog.quality import QuerySet
from catalog.sources import BadRow, Product, _as_text, read_rows
from catalog.tuning.catalog_pairs import categories, taxonomy_fields
from catalog.tuning.query_log import ID_FIELDS, MAX_QUERY_CHARS, QUERY_FIELDS, _id_text, _pick
from inference.errors import InvalidInput

CATEGORY_FIELDS = ("category", "aisle")
GROCERY_JUDGEMENTS = Path(__file__).with_name("data") / "grocery_judgements.csv"
MAX_BAD_SHARE = 0.5


@dataclass(slots=True)
class Judgements:
    queries: QuerySet  # relevant rows index the products the file was read against
    source: str
    named: set[str] = field(default_factory=set)  # product ids named by product rows (not by category)
    rows: int = 0
    bad: list[BadRow] = field(default_factory=list)

    def summary(self, max_lines: int = 5) -> str:
        text = f"{len(self.queries.queries)} judged queries from {self.source} ({self.rows} rows, {len(self.bad)} bad)"
        if self.bad:
            text += ": " + ", ".join(f"line {b.line}: {b.reason}" for b in self.bad[:max_lines])
        return text


def judgements_path(name: str | Path) -> Path:
    """`grocery` is the demo catalog's bundled set; anything else is a path."""
    return GROCERY_JUDGEMENTS if str(name) == "grocery" else Path(name)


def read_judgements(path: str | Path, products: Sequence[Product], *, name: str = "judged") -> Judgements:
    """The file's queries with their relevant rows of `products`; InvalidInput (one line) for a file
    that is wrong as a whole, has neither column, or is mostly bad."""
    p = judgements_path(path)
    source = str(p)
    columns, rows = read_rows(p, what="judgements", id_field=ID_FIELDS)
    taxonomy = taxonomy_fields(products)
    by_id = {prod.id: i for i, prod in enumerate(products)}
    by_category: dict[str, set[int]] = defaultdict(set)
    for i, prod in enumerate(products):
        for value in categories(prod, taxonomy):
            by_category[value].add(i)
    relevant: dict[str, set[int]] = {}
    typed: dict[str, str] = {}  # casefolded query -> as first written
    out = Judgements(QuerySet(name, [], []), source)
    seen: set[tuple[str, str]] = set()
    repeats = 0  # repeated rows are reported but do not make a file "mostly bad"
    first: BadRow | None = None  # the first row that is bad for another reason
    for line, row in rows:
        out.rows += 1
        reason = row if isinstance(row, str) else _relevant(row, columns, by_id, by_category)
        if isinstance(reason, str):
            out.bad.append(BadRow(line, reason))
            first = first or out.bad[-1]
            continue
        query, key, hits = reason
        if key.startswith("product "):
            out.named.add(key.removeprefix("product "))
        if (query.casefold(), key) in seen:
            out.bad.append(BadRow(line, f"repeats an earlier row ({key})"))
            repeats += 1
            continue
        seen.add((query.casefold(), key))
        typed.setdefault(query.casefold(), query)
        relevant.setdefault(query.casefold(), set()).update(hits)
    if out.rows == 0:
        raise InvalidInput(f"{source}: no rows")
    if not relevant or (len(out.bad) - repeats) / out.rows > MAX_BAD_SHARE:
        head = f"; first: line {first.line}: {first.reason}" if first else ""
        raise InvalidInput(f"{source}: refused as judgements: {len(out.bad)} of {out.rows} rows are bad{head}")
    out.queries.queries.extend(typed.values())
    out.queries.relevant.extend(relevant[q] for q in typed)
    return out


def _relevant(row: dict[str, Any], columns: Sequence[str] | None, by_id: dict[str, int],
              by_category: dict[str, set[int]]) -> tuple[str, str, set[int]] | str:
    """(query, what it names, its rows) or the reason the row is bad."""
    names = list(columns) if columns is not None else list(row)
    q_col = _pick(names, QUERY_FIELDS)
    if q_col is None:
        return f"no query column (looked for {', '.join(QUERY_FIELDS)})"
    try:
        query = " ".join((_as_text(row.get(q_col)) or "").split())
        category = (_as_text(row.get(c)) or "" if (c := _pick(names, CATEGORY_FIELDS)) else "").strip().lower()
        pid = ((_id_text(row.get(i)) or "") if (i := _pick(names, ID_FIELDS)) else "").strip()
    except TypeError as exc:
        return f"a value is {exc}"
    if not query:
        return "empty query"
    if len(query) > MAX_QUERY_CHARS:
        return f"query longer than {MAX_QUERY_CHARS} characters"
    if pid:
        return (query, f"product {pid}", {by_id[pid]}) if pid in by_id else f"unknown product id {pid!r}"
    if category:
        hits = by_category.get(category)
        return (query, f"category {category}", hits) if hits else f"unknown category {category!r}"
    return f"neither a product id ({', '.join(ID_FIELDS)}) nor a category ({', '.join(CATEGORY_FIELDS)})"
