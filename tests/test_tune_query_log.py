"""Query logs for `embedcar model tune --pairs`: formats, columns, weights, bad rows, refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog.tuning.query_log import LoggedPair, read_query_log
from inference.errors import InvalidInput

KNOWN = {"1", "2", "3", "42"}


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_pairs_in_first_seen_order(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "log.jsonl", [{"query": "  oat   milk ", "product_id": "2"},
                                           {"query": "tea", "product_id": 1}])
    log = read_query_log(path, KNOWN)
    assert log.pairs == [LoggedPair("oat milk", "2", 1.0), LoggedPair("tea", "1", 1.0)]
    assert (log.rows, log.bad, log.source) == (2, [], str(path))
    assert log.summary() == (f"2 pairs from {path} (2 rows): 0 unknown product ids, 0 empty queries, "
                             "0 duplicates merged")


def test_csv_and_tsv_with_alias_columns(tmp_path: Path) -> None:
    csv_log = read_query_log(_text(tmp_path / "log.csv", "search_term,sku\nmilk,1\n\"bread, white\",3\n"), KNOWN)
    assert [(p.query, p.product_id) for p in csv_log.pairs] == [("milk", "1"), ("bread, white", "3")]
    tsv_log = read_query_log(_text(tmp_path / "log.tsv", "q\titem_id\nmilk\t 42 \n"), {" 42"})
    assert tsv_log.pairs == [LoggedPair("milk", "42", 1.0)]  # ids compared stripped, on both sides


def test_parquet_with_integer_ids_and_a_null(tmp_path: Path) -> None:
    path = tmp_path / "log.parquet"
    # A null in an integer column makes pandas write floats: 2.0 must still be product '2'.
    pq.write_table(pa.table({"query": ["milk", "tea", None, "jam"], "id": [2.0, None, 3.0, 42.0],
                             "clicks": [4, 0, 1, None]}), path)
    log = read_query_log(path, KNOWN)
    assert log.pairs == [LoggedPair("milk", "2", 5.0), LoggedPair("jam", "42", 1.0)]
    assert [(b.line, b.reason) for b in log.bad] == [(2, "no product id ('id')"), (3, "no query ('query')")]
    assert log.empty_queries == 1


def test_weights_from_clicks_orders_and_weight(tmp_path: Path) -> None:
    path = _text(tmp_path / "c.csv", "query,product_id,clicks,orders\nmilk,1,2,1\ntea,2,,\ncoffee,3,0,2\n")
    assert [p.weight for p in read_query_log(path, KNOWN).pairs] == [6.0, 1.0, 7.0]  # 1 + clicks + 3 * orders
    path = _jsonl(tmp_path / "w.jsonl", [{"query": "milk", "product_id": "1", "weight": 2.5, "clicks": 9},
                                         {"query": "tea", "product_id": "2", "weight": 0},
                                         {"query": "jam", "product_id": "3", "orders": 1}])
    assert [p.weight for p in read_query_log(path, KNOWN).pairs] == [2.5, 1.0, 4.0]  # weight wins; at least 1


def test_bad_weights_make_bad_rows(tmp_path: Path) -> None:
    path = _text(tmp_path / "c.csv", "query,product_id,clicks,orders\n"
                 "a,1,1,0\nb,1,-2,0\nc,1,x,0\nd,1,0,inf\ne,1,1,1\nf,1,1,1\ng,1,1,1\n")
    log = read_query_log(path, KNOWN)
    assert [p.query for p in log.pairs] == ["a", "e", "f", "g"]
    assert [(b.line, b.reason, b.id) for b in log.bad] == [
        (3, "negative clicks ('-2')", "1"), (4, "clicks 'x' is not a number", "1"),
        (5, "orders 'inf' is not a finite number", "1")]
    bool_log = _jsonl(tmp_path / "b.jsonl", [{"query": "a", "product_id": "1", "weight": True},
                                             {"query": "b", "product_id": "1"}, {"query": "c", "product_id": "2"}])
    assert [b.reason for b in read_query_log(bool_log, KNOWN).bad] == ["weight True is not a number"]


def test_unknown_ids_counted_with_line_numbers(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "log.jsonl", [{"query": "milk", "product_id": "1"}, {"query": "tea", "product_id": "x"},
                                           {"query": "jam", "product_id": "2"}, {"query": "oat", "product_id": "3"},
                                           {"query": "gum", "product_id": "9"}])
    log = read_query_log(path, KNOWN)
    assert log.unknown_ids == 2
    assert [(b.line, b.reason, b.id) for b in log.bad] == [(2, "unknown product id 'x'", "x"),
                                                           (5, "unknown product id '9'", "9")]
    assert log.summary().endswith("2 unknown product ids, 0 empty queries, 0 duplicates merged; "
                                  "line 2: unknown product id 'x', line 5: unknown product id '9'")


def test_empty_and_overlong_queries(tmp_path: Path) -> None:
    path = _text(tmp_path / "log.csv", f"query,product_id\nmilk,1\n   ,2\n{'a' * 513},3\ntea,2\n\t\t,3\njam,3\ngum,3\n")
    log = read_query_log(path, KNOWN)
    assert [p.query for p in log.pairs] == ["milk", "tea", "jam", "gum"]
    assert log.empty_queries == 2
    assert [(b.line, b.reason) for b in log.bad] == [(3, "empty query"), (4, "query longer than 512 characters (513)"),
                                                     (6, "empty query")]
    assert "2 empty queries" in log.summary() and "1 other bad rows" in log.summary()


def test_duplicates_merged_and_weights_summed(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "log.jsonl", [{"query": "Oat Milk", "product_id": "2", "clicks": 1},
                                           {"query": "tea", "product_id": "1"},
                                           {"query": "oat  milk", "product_id": "2", "orders": 1},
                                           {"query": "oat milk", "product_id": "3"}])
    log = read_query_log(path, KNOWN)
    # The same query up to case and spacing, for the same product: one pair, the first spelling kept.
    assert log.pairs == [LoggedPair("Oat Milk", "2", 2.0 + 4.0), LoggedPair("tea", "1", 1.0),
                         LoggedPair("oat milk", "3", 1.0)]
    assert (log.duplicates, log.bad) == (1, [])
    assert "1 duplicates merged" in log.summary()


def test_explicit_fields(tmp_path: Path) -> None:
    path = _text(tmp_path / "log.csv", "query,text,product_id,pid\nignored,milk,9,1\n")
    log = read_query_log(path, KNOWN, query_field="text", id_field="pid")
    assert log.pairs == [LoggedPair("milk", "1", 1.0)]


def test_wrong_columns_one_line_naming_what_was_found(tmp_path: Path) -> None:
    path = _text(tmp_path / "log.csv", "Query,product,clicks\nmilk,1,2\n")
    with pytest.raises(InvalidInput) as exc:
        read_query_log(path, KNOWN)
    msg = exc.value.message
    assert "\n" not in msg and msg.startswith(f"{path}: no query column")
    assert "no product id column" in msg and "found: Query, product, clicks" in msg
    assert "did you mean 'Query'?" in msg and "did you mean 'product'?" in msg
    with pytest.raises(InvalidInput, match=r"no product id column .*found: query, product, clicks"):
        read_query_log(_text(tmp_path / "p.csv", "query,product,clicks\nmilk,1,2\n"), KNOWN)
    with pytest.raises(InvalidInput, match=r"no query field in any row \(looked for 'text'\); found: search, "
                                           r"product_id$"):
        read_query_log(_jsonl(tmp_path / "j.jsonl", [{"search": "milk", "product_id": "1"}]), KNOWN,
                       query_field="text")


def test_mostly_bad_file_refused_naming_first_bad_row(tmp_path: Path) -> None:
    rows = [{"query": "milk", "product_id": "1"}, {"query": "", "product_id": "2"},
            {"query": "tea", "product_id": "77"}, {"query": "jam", "product_id": "78"}]
    path = _jsonl(tmp_path / "log.jsonl", rows)
    with pytest.raises(InvalidInput) as exc:
        read_query_log(path, KNOWN)
    msg = exc.value.message
    assert msg.startswith(f"{path}: refused as a query log: 3 of 4 rows are bad (more than 50%)")
    assert "2 unknown product ids, 1 empty queries" in msg and msg.endswith("first: line 2: empty query")
    assert len(read_query_log(path, KNOWN, max_bad_share=0.75).pairs) == 1  # the share is the caller's


def test_no_valid_pair_refused(tmp_path: Path) -> None:
    path = _text(tmp_path / "log.csv", "query,sku\nmilk,A-1\n")
    with pytest.raises(InvalidInput, match=r"no valid \(query, product id\) pair .*first: line 2: unknown product id "
                                           r"'A-1'; do its product ids match the catalog's id field\?"):
        read_query_log(path, KNOWN, max_bad_share=1.0)


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("empty.jsonl", "", "empty query log (no rows)"),
    ("blank.jsonl", "\n\n", "empty query log (no rows)"),
    ("header.csv", "query,product_id\n", "empty query log (no rows)"),
    ("empty.csv", "", "empty file (no header line)"),
    ("empty.parquet", "", "not Parquet"),
])
def test_empty_file_refused(tmp_path: Path, name: str, text: str, expected: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(expected)):
        read_query_log(_text(tmp_path / name, text), KNOWN)


def test_empty_parquet_table_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.parquet"
    pq.write_table(pa.table({"query": pa.array([], pa.string()), "product_id": pa.array([], pa.string())}), path)
    with pytest.raises(InvalidInput, match="empty query log"):
        read_query_log(path, KNOWN)


def test_file_checks_of_the_catalog_reader_apply(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=r"named \.parquet but not Parquet .*rename it to \.csv"):
        read_query_log(_text(tmp_path / "log.parquet", "query,product_id\nmilk,1\n"), KNOWN)
    with pytest.raises(InvalidInput, match=r"unknown query log format '\.xlsx'"):
        read_query_log(_text(tmp_path / "log.xlsx", "x"), KNOWN)
    with pytest.raises(InvalidInput, match="not UTF-8"):
        (tmp_path / "u.csv").write_bytes("query,product_id\nlait,1\n".encode("utf-16"))
        read_query_log(tmp_path / "u.csv", KNOWN)


def test_broken_jsonl_lines_are_bad_rows(tmp_path: Path) -> None:
    path = _text(tmp_path / "log.jsonl", '{"query": "milk", "product_id": "1"}\n{"query": \n'
                 '{"query": "tea", "product_id": "2"}\n[1]\n{"query": ["a"], "product_id": "3"}\n'
                 '{"query": "jam", "product_id": "3"}\n')
    log = read_query_log(path, KNOWN)
    assert [p.query for p in log.pairs] == ["milk", "tea", "jam"]
    assert [b.line for b in log.bad] == [2, 4, 5]
    assert log.bad[2].reason == "query 'query' is a list, not text"
