"""Catalog files as users make them (issue 51, item 4): spreadsheet exports, mislabelled and broken
files, header mistakes. Each case is a real file; a whole-file mistake is one InvalidInput line."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog.files_reference import catalog_files_page
from catalog.sources import read_path, sniff_delimiter
from inference.errors import InvalidInput


def _write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


# --- what spreadsheets write ------------------------------------------------------------------
def test_utf8_bom_header_is_read_as_id(tmp_path: Path) -> None:
    csv_path = tmp_path / "bom.csv"
    csv_path.write_bytes(b"\xef\xbb\xbfid,title\n1,Milk\n2,Bread\n")
    loaded = read_path(csv_path)
    assert [p.id for p in loaded.products] == ["1", "2"] and not loaded.bad
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"id": "1", "title": "Milk"}\n')
    assert [p.id for p in read_path(jsonl).products] == ["1"]


@pytest.mark.parametrize(("name", "sep"), [("semi.csv", ";"), ("tabs.tsv", "\t"), ("pipes.csv", "|")])
def test_delimiter_is_sniffed_from_the_header(tmp_path: Path, name: str, sep: str) -> None:
    # Values hold commas: only the header and the rows agreeing on `sep` can tell it apart.
    rows = [["id", "title", "aisle"], ["1", "Bread, Whole Wheat", "bread"], ["2", "Milk", "dairy, eggs"]]
    path = _write(tmp_path / name, "".join(sep.join(r) + "\n" for r in rows))
    loaded = read_path(path, text_fields=("title", "aisle"))
    assert [(p.id, p.fields["title"], p.fields["aisle"]) for p in loaded.products] == [
        ("1", "Bread, Whole Wheat", "bread"), ("2", "Milk", "dairy, eggs")]


def test_sniffing_a_header_whose_names_hold_commas() -> None:
    # csv.Sniffer on this header alone answers ','; the rows agree with ';'.
    head = b"id;name, short;aisle\n1;Milk;dairy\n2;Oat Milk, Barista;dairy\n"
    assert sniff_delimiter(head) == ";"
    assert sniff_delimiter(b"title\nMilk\n") == ","  # one column: nothing to split


def test_delimiter_given_overrides_and_is_checked(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.csv", "id,title;size\n1,Milk;1l\n")
    # Both split it in two: a tie goes to ','; the user who knows better says so.
    assert read_path(path, text_fields=("title;size",)).products[0].id == "1"
    loaded = read_path(path, id_field="id,title", text_fields=("size",), delimiter=";")
    assert [(p.id, p.fields) for p in loaded.products] == [("1,Milk", {"size": "1l"})]
    assert read_path(_write(tmp_path / "t.csv", "id\ttitle\n1\tTea\n"), delimiter="tab").products[0].id == "1"
    with pytest.raises(InvalidInput, match="--delimiter wants one character"):
        read_path(path, delimiter="ab")
    jsonl = _write(tmp_path / "p.jsonl", json.dumps({"id": "1", "title": "x"}) + "\n")
    with pytest.raises(InvalidInput, match="applies to CSV files"):
        read_path(jsonl, delimiter=";")


# --- broken quotes ----------------------------------------------------------------------------
@pytest.mark.parametrize(("pad", "expected"), [
    (0, r"line 2: a quote opened on this line is never closed \(the field runs to the end of the file, line 3001\)"),
    (60, r"line 2: a quoted field opened on this line runs on to line \d+ and breaks there \(field larger than "
         r"field limit.*an unclosed quote\?"),
])
def test_quote_left_open_is_refused_with_its_line_not_merged(tmp_path: Path, pad: int, expected: str) -> None:
    # Before: one product whose title held the 2,999 rows after it, or (longer rows) the traceback
    # `_csv.Error: field larger than field limit`.
    lines = ["id,title,aisle", '1,"Bread,bread'] + [f"{i},Item {i} {'x' * pad},misc" for i in range(2, 3001)]
    path = _write(tmp_path / "open.csv", "\n".join(lines) + "\n")
    with pytest.raises(InvalidInput, match=r"open\.csv " + expected) as exc:
        read_path(path)
    assert "\n" not in str(exc.value)


def test_quote_closed_rows_later_is_refused(tmp_path: Path) -> None:
    # A stray quote closes the open one three lines on: the rows between would be one title.
    path = _write(tmp_path / "p.csv", 'id,title,aisle\n1,Salt,spices\n2,"Bread,bread\n3,Milk,dairy\n'
                                      '4,pizza 12",frozen\n5,Eggs,dairy\n')
    with pytest.raises(InvalidInput, match="line 3: a quoted field opened on this line runs on to line 5"):
        read_path(path)
    # Broken in a way strict parsing sees mid-field: reported at the line the quote opened.
    path = _write(tmp_path / "q.csv", 'id,title,aisle\n1,"Bread,bread\n2,"Milk",dairy\n')
    with pytest.raises(InvalidInput, match="line 2: a quoted field opened on this line runs on to line 3"):
        read_path(path)


def test_real_multiline_fields_and_single_line_mistakes(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.csv", 'id,title,description\n'
                  '1,Bread,"Fresh bread.\nBake at 200C, 20 min, covered.\nKeep dry"\n'
                  '2,"Milk" whole,dairy\n'  # junk after a closing quote: that row only
                  '3,Bread, Whole,bread\n'  # an unquoted comma: 4 fields, not a shifted row
                  '4,Eggs,dairy\n')
    loaded = read_path(path)
    assert [(p.id, p.line) for p in loaded.products] == [("1", 2), ("4", 7)]
    assert loaded.products[0].fields["description"].count("\n") == 2
    bad = {b.line: b.reason for b in loaded.bad}
    assert "malformed quoting" in bad[5] and "4 fields where the header has 3" in bad[6]


# --- compressed files -------------------------------------------------------------------------
def _zstd(path: Path, data: bytes) -> Path:
    with pa.output_stream(str(path), compression="zstd") as out:
        out.write(data)
    return path


@pytest.mark.parametrize("name", ["p.csv.gz", "p.tsv.gz", "p.jsonl.gz", "p.csv.zst", "p.jsonl.zst", "P.CSV.GZ"])
def test_compressed_files_are_read_decompressed_with_their_line_numbers(tmp_path: Path, name: str) -> None:
    if ".jsonl" in name:
        rows = [{"id": "1", "title": "Milk"}, {"id": "2", "title": ""}, {"id": "3", "title": "Tea"}]
        text = "".join(json.dumps(r) + "\n" for r in rows)
    else:
        sep = "\t" if ".tsv" in name else ","
        text = f"id{sep}title\n1{sep}Milk\n2{sep}\n3{sep}Tea\n"
    path = tmp_path / name
    if name.lower().endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        _zstd(path, text.encode())
    loaded = read_path(path)
    assert [(p.id, p.fields["title"]) for p in loaded.products] == [("1", "Milk"), ("3", "Tea")]
    bad_line = 2 if ".jsonl" in name else 3  # the decompressed text's line (a CSV's header is line 1)
    assert [b.line for b in loaded.bad] == [bad_line]


def test_compressed_files_get_the_whole_file_checks_and_clear_errors(tmp_path: Path) -> None:
    plain = _write(tmp_path / "p.csv.gz", "id,title\n1,Milk\n")  # named .gz, not compressed
    with pytest.raises(InvalidInput, match=r"p\.csv\.gz: named \.gz but not gzip-compressed: it looks like CSV"):
        read_path(plain)
    (tmp_path / "q.jsonl.zst").write_bytes(gzip.compress(b"{}\n"))
    with pytest.raises(InvalidInput, match=r"named \.zst but not zstd-compressed: it looks like gzip"):
        read_path(tmp_path / "q.jsonl.zst")
    gz = tmp_path / "p.csv"
    gz.write_bytes(gzip.compress(b"id,title\n1,Milk\n"))
    with pytest.raises(InvalidInput, match=r"gzip-compressed data, not UTF-8 text \(name it p\.csv\.gz"):
        read_path(gz)
    utf16 = tmp_path / "u.csv.gz"
    utf16.write_bytes(gzip.compress("id,title\n1,Milk\n".encode("utf-16")))
    with pytest.raises(InvalidInput, match="UTF-16 text, not UTF-8 text"):  # checked on the decompressed head
        read_path(utf16)
    latin = tmp_path / "l.jsonl.gz"
    latin.write_bytes(gzip.compress('{"id": "1", "title": "Café"}\n'.encode("latin-1")))
    with pytest.raises(InvalidInput, match=r"not UTF-8.*Latin-1"):
        read_path(latin)
    array = tmp_path / "a.jsonl.zst"
    _zstd(array, json.dumps([{"id": "1", "title": "Milk"}], indent=2).encode())
    with pytest.raises(InvalidInput, match="one JSON document"):
        read_path(array)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["1"], "title": ["Milk"]}), parquet)
    (tmp_path / "p.parquet.gz").write_bytes(gzip.compress(parquet.read_bytes()))
    with pytest.raises(InvalidInput, match=r"a compressed Parquet file.*decompress it to p\.parquet"):
        read_path(tmp_path / "p.parquet.gz")
    with pytest.raises(InvalidInput, match=r"unknown catalog format '\.gz'"):
        read_path(_write(tmp_path / "products.gz", "x"))
    with pytest.raises(InvalidInput, match=r"unknown catalog format '\.xml\.gz'"):
        read_path(_write(tmp_path / "p.xml.gz", "x"))


def test_a_compressed_file_cut_short_is_refused_not_read_as_a_shorter_catalog(tmp_path: Path) -> None:
    # Digits that do not repeat: the compressed stream is long enough to cut in the middle.
    text = "id,title\n" + "".join(f"{i},item {i * 7919 % 100_003:06d}\n" for i in range(20_000))
    for name, data in (("p.csv.gz", gzip.compress(text.encode())),
                       ("p.csv.zst", _zstd(tmp_path / "whole.zst", text.encode()).read_bytes())):
        path = tmp_path / name
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(InvalidInput, match=r"data is damaged after line \d+"):
            read_path(path)


# --- encodings and mislabelled files ----------------------------------------------------------
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_utf16_and_utf32_are_refused_in_one_line(tmp_path: Path, encoding: str) -> None:
    path = _write(tmp_path / "p.csv", "id,title\n1,Milk\n", encoding)
    with pytest.raises(InvalidInput, match=r"p\.csv: UTF-(16|32) text, not UTF-8 text; save it as UTF-8"):
        read_path(path)


def test_latin1_file_is_refused_a_stray_byte_is_one_bad_row(tmp_path: Path) -> None:
    rows = "".join(f'{{"id": "{i}", "title": "Café {i}"}}\n' for i in range(5))
    with pytest.raises(InvalidInput, match=r"not UTF-8 \(line 1, byte \d+\).*Latin-1"):
        read_path(_write(tmp_path / "p.jsonl", rows, "latin-1"))
    with pytest.raises(InvalidInput, match="not UTF-8"):  # a CSV header that is not UTF-8
        read_path(_write(tmp_path / "h.csv", "id,désignation\n1,Lait\n", "latin-1"))
    path = tmp_path / "ok.csv"
    path.write_bytes("id,title\n1,Crème\n".encode() + b"2,Caf\xe9\n3,Tea\n")
    loaded = read_path(path)
    assert [p.id for p in loaded.products] == ["1", "3"] and loaded.bad[0].line == 3
    # One stray byte among many UTF-8 rows, all ASCII else: still one bad row.
    path.write_bytes(b"id,title\n" + b"".join(b"%d,Item %d\n" % (i, i) for i in range(200)) + b"200,Caf\xe9\n")
    assert len(read_path(path).products) == 200 and read_path(path).bad[0].line == 202


@pytest.mark.parametrize("content", [
    '{"id": "1", "title": "Café"}\n{"id": "2", "title": "Thé"}\n',  # before: two bad rows, "nothing to index"
    '{"id": "1", "title": "Crème brûlée"}\n',
    "id,title\n1,Café\n2,Tea\n",  # half the rows
])
def test_a_small_latin1_file_gets_the_encoding_hint_too(tmp_path: Path, content: str) -> None:
    path = _write(tmp_path / ("p.jsonl" if content.startswith("{") else "p.csv"), content, "latin-1")
    with pytest.raises(InvalidInput, match=r"not UTF-8 \(line \d+, byte \d+\).*Latin-1.*save it as UTF-8"):
        read_path(path)


def test_a_file_whose_every_row_is_bad_for_encoding_gets_the_hint(tmp_path: Path) -> None:
    # UTF-8 (ASCII) for the whole sampled head, Latin-1 after it: each row bad, then the hint.
    path = tmp_path / "p.jsonl"
    path.write_bytes(b" " * 70_000 + b"\n" + '{"id": "1", "title": "Café"}\n'.encode("latin-1"))
    with pytest.raises(InvalidInput, match=r"p\.jsonl: not UTF-8 \(line 2: bad encoding.*Latin-1"):
        read_path(path)


def test_mislabelled_files_say_what_they_look_like(tmp_path: Path) -> None:
    csv_named_parquet = _write(tmp_path / "p.parquet", "id,title\n1,Milk\n")
    with pytest.raises(InvalidInput, match=r"not Parquet \(no PAR1 header\).*CSV.*'id,title'.*rename it to \.csv"):
        read_path(csv_named_parquet)
    parquet = tmp_path / "real.parquet"
    pq.write_table(pa.table({"id": ["1"], "title": ["Milk"]}), parquet)
    parquet_named_csv = tmp_path / "p.csv"
    parquet_named_csv.write_bytes(parquet.read_bytes())
    with pytest.raises(InvalidInput, match=r"named \.csv but it is a Parquet file; rename it to \.parquet"):
        read_path(parquet_named_csv)
    truncated = tmp_path / "cut.parquet"
    truncated.write_bytes(parquet.read_bytes()[:40])
    with pytest.raises(InvalidInput, match="not a readable Parquet file"):
        read_path(truncated)
    xlsx = tmp_path / "x.csv"
    xlsx.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(InvalidInput, match="ZIP archive"):
        read_path(xlsx)
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(InvalidInput, match="binary data"):
        read_path(binary)
    with pytest.raises(InvalidInput, match=r"line 1 is not a JSON object.*CSV"):
        read_path(_write(tmp_path / "c.jsonl", "id,title\n1,Milk\n"))
    with pytest.raises(InvalidInput, match="one JSON document"):
        read_path(_write(tmp_path / "a.jsonl", json.dumps([{"id": "1", "title": "Milk"}], indent=2)))


# --- header mistakes, once --------------------------------------------------------------------
def test_missing_id_column_is_one_error_naming_the_columns(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.csv", "sku,name\n1,Milk\n2,Bread\n")
    with pytest.raises(InvalidInput, match=r"p\.csv: no column 'id' \(found: sku, name\); use --id-field$"):
        read_path(path)
    with pytest.raises(InvalidInput, match="did you mean 'ID'"):
        read_path(_write(tmp_path / "u.csv", "ID,title\n1,Milk\n"))
    jsonl = _write(tmp_path / "p.jsonl", "".join(json.dumps({"sku": str(i), "name": "x"}) + "\n" for i in range(3)))
    with pytest.raises(InvalidInput, match=r"no field 'id' in any row \(found: sku, name\); use --id-field"):
        read_path(jsonl)


def test_unknown_text_fields_are_refused_naming_the_columns(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.csv", "id,title,color\n1,Milk,white\n")
    with pytest.raises(InvalidInput, match=r"no column 'colour' for --text-fields \(found: id, title, color\); "
                                           r"did you mean 'color'\?"):
        read_path(path, text_fields=("title", "colour"))
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["1"], "title": ["Milk"]}), parquet)
    with pytest.raises(InvalidInput, match="no column 'brand'"):
        read_path(parquet, text_fields=("brand",))
    with pytest.raises(InvalidInput, match=r"no column 'colour' for --text-fields \(found: id, title, aisle"):
        read_path("grocery", text_fields=("title", "colour"), limit=5)
    # A JSONL field present in some rows only is a per-row matter, not a header mistake.
    jsonl = _write(tmp_path / "p.jsonl", json.dumps({"id": "1", "title": "Milk"}) + "\n"
                   + json.dumps({"id": "2", "title": "Tea", "brand": "Acme"}) + "\n")
    assert [p.id for p in read_path(jsonl, text_fields=("title", "brand")).products] == ["1", "2"]


# --- values that are not text -----------------------------------------------------------------
def test_non_scalar_values_in_text_fields_are_bad_rows_elsewhere_json(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", "".join(json.dumps(r) + "\n" for r in [
        {"id": "1", "title": ["list", "title"]},
        {"id": {"n": 2}, "title": "Dict id"},
        {"id": "3", "title": "Oat Milk", "tags": ["vegan", "dairy free"], "dims": {"l": 1}, "organic": True},
        {"id": "4", "title": None, "aisle": "tea"},
    ]))
    loaded = read_path(path, text_fields=("title", "aisle"))
    assert [p.id for p in loaded.products] == ["3", "4"]
    assert loaded.products[0].fields == {"title": "Oat Milk", "tags": '["vegan", "dairy free"]', "dims": '{"l": 1}',
                                         "organic": "true"}
    # ... and typed beside the text, for exports: the list, the object and the boolean as JSON has them.
    assert loaded.products[0].values == {"tags": ["vegan", "dairy free"], "dims": {"l": 1}, "organic": True}
    assert {b.line: b.reason for b in loaded.bad} == {1: "'title' is a list, not text",
                                                      2: "'id' is an object, not text or an integer"}
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "title": [["x", "y"], ["z"]], "aisle": ["tea", "tea"]}), parquet)
    loaded = read_path(parquet, text_fields=("aisle", "title"))
    assert not loaded.products and {b.reason for b in loaded.bad} == {"'title' is a list, not text"}


# --- through the CLI --------------------------------------------------------------------------
@pytest.mark.parametrize(("content", "args", "expected"), [
    ("sku,name\n1,Milk\n", (), "no column 'id' (found: sku, name); use --id-field"),
    ('id,title\n1,"Milk\n2,Tea\n', (), "line 2: a quote opened on this line is never closed"),
    ("id;title;aisle\n1;Milk;dairy\n", ("--delimiter", ";", "--text-fields", "colour"),
     "no column 'colour' for --text-fields (found: id, title, aisle)"),
    ("id,title\n1,Milk\n", ("--delimiter", "xy"), "--delimiter wants one character"),
])
def test_catalog_build_prints_one_line_and_fails(tmp_path: Path, content: str, args: tuple[str, ...],
                                                 expected: str) -> None:
    path = _write(tmp_path / "p.csv", content)
    run = subprocess.run([sys.executable, "-m", "inference.cli_main", "catalog", "build", str(path), *args,
                          "--index-root", str(tmp_path / "idx"), "--no-progress"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedcar: ") and expected in lines[0], run.stderr
    assert not (tmp_path / "idx").exists() or not any((tmp_path / "idx").iterdir())


def test_the_reference_pages_example_file_reads_as_it_says(tmp_path: Path) -> None:
    """docs/catalog-files.md's CSV example (written from the code) is a file the reader takes."""
    page = catalog_files_page()
    example = page.split("`products.csv`:\n\n```\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "products.csv"
    path.write_text(example, encoding="utf-8")
    loaded = read_path(path, text_fields=("title",))
    assert [p.id for p in loaded.products] == ["p-1", "p-2"] and not loaded.bad
    assert loaded.products[1].fields["title"] == "Oat Milk, Barista Edition"
