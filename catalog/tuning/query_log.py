"""Query logs for `embedcar model tune --pairs FILE`: what shoppers typed and the product it led to.

A log is JSONL, CSV/TSV or Parquet with one (query, product id) row each, optionally with clicks and
orders (or a ready-made weight). It is read with the catalog reader's file checks and row parsers
(`catalog.sources.read_rows`), so a mislabelled, non-UTF-8 or broken file is refused the same way.
Rows are then validated against the catalog: a pair whose product is not in the catalog cannot be
trained on, an empty query teaches nothing, and the same pair seen twice is one pair that counts
more. A few bad rows are skipped and reported by line; a file that is mostly bad is refused, since
it is almost always the wrong file or the wrong columns (and training on its remains would be noise).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from catalog.sources import BadRow, _as_text, _did_you_mean, read_rows
from inference.errors import InvalidInput

QUERY_FIELDS = ("query", "q", "search_query", "search_term")  # the first present is taken
ID_FIELDS = ("product_id", "id", "item_id", "sku")
WEIGHT_FIELD = "weight"
CLICKS_FIELD = "clicks"
ORDERS_FIELD = "orders"
# weight = 1 + clicks + ORDER_WEIGHT * orders: the row itself is one observation; an order is a
# stronger relevance signal than a click (the shopper paid for it), so it counts more.
ORDER_WEIGHT = 3.0
MAX_QUERY_CHARS = 512  # longer is a pasted description or a bot, not a shopper's query
SUMMARY_BAD_ROWS = 10  # bad rows named in `QueryLog.summary`


@dataclass(frozen=True, slots=True)
class LoggedPair:
    query: str
    product_id: str
    weight: float  # >= 1; how much this pair counts in training (1 + clicks + 3 * orders, or the log's weight)


@dataclass(slots=True)
class QueryLog:
    pairs: list[LoggedPair]  # valid, duplicates merged, in first-seen order
    source: str
    rows: int = 0  # rows read
    unknown_ids: int = 0  # product id not in the catalog
    empty_queries: int = 0
    duplicates: int = 0  # rows merged into an earlier (query, product_id) row
    bad: list[BadRow] = field(default_factory=list)  # every skipped row with its reason, 1-based lines

    def summary(self, max_lines: int = SUMMARY_BAD_ROWS) -> str:
        """One line: the counts, then the first bad rows by line."""
        text = (f"{len(self.pairs)} pairs from {self.source} ({self.rows} rows): {self.unknown_ids} unknown "
                f"product ids, {self.empty_queries} empty queries, {self.duplicates} duplicates merged")
        other = len(self.bad) - self.unknown_ids - self.empty_queries
        if other:
            text += f", {other} other bad rows"
        if self.bad:
            text += "; " + ", ".join(f"line {b.line}: {b.reason}" for b in self.bad[:max_lines])
            if len(self.bad) > max_lines:
                text += f" (+{len(self.bad) - max_lines} more)"
        return text


def read_query_log(path: Path, known_ids: Collection[str], *, query_field: str | None = None,
                   id_field: str | None = None, max_bad_share: float = 0.5) -> QueryLog:
    """Read and validate a query log against the catalog's product ids.

    `query_field`/`id_field` name the columns; None = the first of QUERY_FIELDS/ID_FIELDS present.
    Raises InvalidInput (one line, naming the file) for a file that is wrong as a whole, lacks the
    columns, has no rows or no valid pair, or has more than `max_bad_share` of its rows bad."""
    if not 0.0 <= max_bad_share <= 1.0:
        raise ValueError(f"max_bad_share must be within [0, 1], got {max_bad_share}")
    if query_field is not None and query_field == id_field:
        raise InvalidInput(f"the query and the product id cannot both be column {query_field!r}")
    source = str(path)
    query_names = (query_field,) if query_field else QUERY_FIELDS
    id_names = (id_field,) if id_field else ID_FIELDS
    columns, rows = read_rows(path, what="query log", id_field=id_names)
    fixed: tuple[str, str] | None = None  # (query, id) columns, from the header; JSONL picks them per row
    if columns is not None:
        q_col, id_col = _pick(columns, query_names), _pick(columns, id_names)
        if q_col is None or id_col is None:
            raise _columns_error(source, columns, query_names if q_col is None else (),
                                 id_names if id_col is None else ())
        fixed = (q_col, id_col)

    known = {str(k).strip() for k in known_ids}
    log = QueryLog(pairs=[], source=source)
    merged: dict[tuple[str, str], LoggedPair] = {}  # (casefolded query, id) -> pair; insertion = first seen
    keys: dict[str, None] = {}  # JSONL: every field seen, for the columns error
    has_query = has_id = False
    for line, row in rows:
        log.rows += 1
        if isinstance(row, str):
            log.bad.append(BadRow(line, row))
            continue
        if fixed is None:
            keys.update(dict.fromkeys(map(str, row)))
            q_col, id_col = _pick(row, query_names) or query_names[0], _pick(row, id_names) or id_names[0]
            has_query, has_id = has_query or q_col in row, has_id or id_col in row
        else:
            q_col, id_col = fixed
        pair = _pair(line, row, q_col, id_col, known, log)
        if pair is None:
            continue
        key = (pair.query.casefold(), pair.product_id)
        if (first := merged.get(key)) is not None:
            merged[key] = LoggedPair(first.query, first.product_id, first.weight + pair.weight)
            log.duplicates += 1
        else:
            merged[key] = pair
    if fixed is None and keys and not (has_query and has_id):
        raise _columns_error(source, keys, () if has_query else query_names, () if has_id else id_names,
                             what="field", where=" in any row")
    log.pairs = list(merged.values())
    _refuse_if_unusable(log, max_bad_share)
    return log


def _pick(names: Collection[str], candidates: Sequence[str]) -> str | None:
    return next((c for c in candidates if c in names), None)


def _pair(line: int, row: Mapping[str, Any], q_col: str, id_col: str, known: set[str],
          log: QueryLog) -> LoggedPair | None:
    """The row's pair, or None after counting it and recording a BadRow in `log`."""
    try:
        raw_query = _as_text(row.get(q_col))
    except TypeError as exc:
        log.bad.append(BadRow(line, f"query {q_col!r} is {exc}"))
        return None
    query = " ".join((raw_query or "").split())  # strip, and one space between words
    if not query:
        log.empty_queries += 1
        log.bad.append(BadRow(line, "empty query" if raw_query is not None else f"no query ({q_col!r})"))
        return None
    if len(query) > MAX_QUERY_CHARS:
        log.bad.append(BadRow(line, f"query longer than {MAX_QUERY_CHARS} characters ({len(query)})"))
        return None
    try:
        pid = (_id_text(row.get(id_col)) or "").strip()
    except TypeError as exc:
        log.bad.append(BadRow(line, f"product id {id_col!r} is {exc}"))
        return None
    if not pid:
        log.bad.append(BadRow(line, f"no product id ({id_col!r})"))
        return None
    if pid not in known:
        log.unknown_ids += 1
        log.bad.append(BadRow(line, f"unknown product id {pid!r}", pid))
        return None
    try:
        weight = _weight(row)
    except ValueError as exc:
        log.bad.append(BadRow(line, str(exc), pid))
        return None
    return LoggedPair(query, pid, weight)


def _id_text(value: Any) -> str | None:
    # A Parquet integer column with a null in it is read back as floats: 123.0 is product '123'.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return _as_text(value)


def _weight(row: Mapping[str, Any]) -> float:
    """The log's weight if it has one (raised to 1: a logged pair counts at least once), else
    1 + clicks + ORDER_WEIGHT * orders. ValueError (the bad row's reason) for a bad value."""
    if WEIGHT_FIELD in row:
        weight = _count(row, WEIGHT_FIELD)
        return 1.0 if weight is None else max(1.0, weight)
    clicks, orders = _count(row, CLICKS_FIELD), _count(row, ORDERS_FIELD)
    return 1.0 + (clicks or 0.0) + ORDER_WEIGHT * (orders or 0.0)


def _count(row: Mapping[str, Any], name: str) -> float | None:
    """A non-negative finite number; None when absent or empty (null, '', a pandas NaN)."""
    value = row.get(name)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{name} {value!r} is not a number") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValueError(f"{name} {value!r} is not a number")
    if not math.isfinite(number):
        raise ValueError(f"{name} {value!r} is not a finite number")
    if number < 0:
        raise ValueError(f"negative {name} ({value!r})")
    return number


def _columns_error(source: str, found: Iterable[str], query_names: Sequence[str], id_names: Sequence[str],
                   *, what: str = "column", where: str = "") -> InvalidInput:
    """One line: which columns are missing (and the names looked for), what the file has, a near miss."""
    names = [n for n in found if n]
    listing = ", ".join(names[:20]) + (f", +{len(names) - 20} more" if len(names) > 20 else "")
    missing = [f"no {label} {what}{where} (looked for {', '.join(map(repr, tried))})"
               for label, tried in (("query", query_names), ("product id", id_names)) if tried]
    hints = dict.fromkeys(h for tried in (query_names, id_names) if (h := _near(tried, names)))
    return InvalidInput(f"{source}: {' and '.join(missing)}; found: {listing or 'none'}{''.join(hints)}")


def _near(tried: Sequence[str], names: Sequence[str]) -> str:
    return next((h for t in tried if (h := _did_you_mean(t, names))), "")


def _refuse_if_unusable(log: QueryLog, max_bad_share: float) -> None:
    """A log with no rows, no valid pair, or mostly bad rows is the wrong file: refused in one line."""
    if log.rows == 0:
        raise InvalidInput(f"{log.source}: empty query log (no rows)")
    share = len(log.bad) / log.rows
    if log.pairs and share <= max_bad_share:
        return
    why = "no valid (query, product id) pair" if not log.pairs else (
        f"{len(log.bad)} of {log.rows} rows are bad (more than {max_bad_share:.0%})")
    hint = ""
    if log.unknown_ids and log.unknown_ids == len(log.bad) and not log.pairs:
        hint = "; do its product ids match the catalog's id field?"
    first = log.bad[0] if log.bad else None
    head = f"; first: line {first.line}: {first.reason}" if first else ""
    raise InvalidInput(f"{log.source}: refused as a query log: {why} ({log.rows} rows, {len(log.bad)} bad: "
                       f"{log.unknown_ids} unknown product ids, {log.empty_queries} empty queries){head}{hint}")
