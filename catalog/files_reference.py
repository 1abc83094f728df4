"""docs/catalog-files.md, written from the code: the product files `embedcar catalog build` reads
(catalog/sources.py's formats and delimiters, the catalog settings' defaults)."""

from __future__ import annotations

import dataclasses

from catalog.settings import CatalogSettings
from catalog.sources import COMPRESSIONS, DELIMITER_NAMES, DELIMITERS, FORMATS, GROCERY_COLUMNS, GROCERY_SOURCE
from catalog.spec import BuildSpec

_SHOWN = {"\t": "tab", ",": "`,`", ";": "`;`", "|": "`|`"}


def _default(cls: type, name: str) -> object:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def catalog_files_page() -> str:
    text_fields = ",".join(_default(CatalogSettings, "text_fields"))  # type: ignore[arg-type]
    id_field = _default(BuildSpec, "id_field")
    by_format: dict[str, list[str]] = {}
    for suffix, fmt in FORMATS.items():
        by_format.setdefault(fmt, []).append(f"`{suffix}`")
    names = ", ".join(f"`{n}`" for n in DELIMITER_NAMES)
    compressed = ", ".join(f"`{c}` ({kind})" for c, kind in COMPRESSIONS.items())
    lines = [
        "# Catalog files",
        "",
        "<!-- Written by `embedcar docs reference` from catalog/sources.py and the catalog settings; "
        "do not edit by hand. -->",
        "",
        "What `embedcar catalog build FILE` (and `catalog merge`) reads: one product per row or line, UTF-8 "
        "(a byte-order mark is fine).",
        "",
        "| format | file names | rows |",
        "|---|---|---|",
        f"| CSV / TSV | {', '.join(by_format['csv'])} | a header line naming the columns, then one product per line; "
        "a quoted field may hold the delimiter, newlines, and `\"\"` for a quote |",
        f"| JSON Lines | {', '.join(by_format['jsonl'])} | one JSON object per line |",
        f"| Parquet | {', '.join(by_format['parquet'])} | one product per row |",
        "",
        "Columns:",
        "",
        f"- **id** (`--id-field`, default `{id_field}`): the product's id, text or an integer, kept exactly as "
        "the source has it: the id an export writes and a search engine joins on. A CSV's ids are text as "
        "written (`007` stays `007`). A whole-number float is that integer (`2001.0`, what pandas makes of an "
        "integer column with a gap, is `2001`; past 2^53, where floats skip integers, a bad row); a row whose "
        "id is another float (`3.5`), a boolean, a list or an object is a bad row naming it, and so is a row "
        "without one (null, empty, NaN). The build records whether every id was an integer (`int`) or not "
        "(`string`).",
        f"- **text fields** (`--text-fields`, default `{text_fields}`): joined with ` | ` into the text that is "
        "embedded; a row whose text fields are all empty is a bad row, a list or an object there too.",
        "- every other column is kept with the product and returned by Search (`fields`, as text); a list or an "
        "object there is kept as JSON text.",
        "- **filter fields** (`--filter-fields`, setting `catalog.filter_fields`): the columns Search may filter on "
        "(gRPC `filters`, HTTP `filters`, `catalog search --filter FIELD=VALUE`), matched to the file's columns "
        "case-insensitively (`department` finds `Department`; a name no column has is refused at build with the "
        "nearest one); none declared: `department` and `aisle` where the file has them. The build prints them "
        "and the manifest records them; a filter on another field, or with a value no product has, is a 400 / "
        "INVALID_ARGUMENT naming the fields or the nearest values, never an empty list.",
        "",
        "Where it lands: `catalog build FILE` builds into `indexes/<name>` under the data home, the name from "
        "`--name` or the file's (`products.csv.gz` → `indexes/products`), unless `--index-root` says otherwise; "
        "a file whose ids share under `catalog.min_id_overlap` (10 %) with that index's current version is "
        "another catalog, refused before embedding (`--force` or not).",
        "",
        "Types: Search returns every field as text, but `embedcar catalog export` writes a JSON Lines or "
        "Parquet field as its type when the column agrees on one: numbers as JSON numbers (integers and "
        "floats together as floats), booleans, lists and objects; a column of mixed types as text. A CSV has "
        "no types: its fields are exported as text, and the engine's mapping (a `float` field for `price`) "
        "converts them.",
        "",
        f"Compressed files are read as they are: a CSV, TSV or JSON Lines file named with {compressed} after its "
        "format's suffix (`products.csv.gz`, `products.jsonl.zst`). The checks below see the decompressed "
        "text and bad rows are numbered by its lines. A `.gz` that is not gzip data is refused saying what it "
        "looks like; a compressed `.parquet` too (Parquet compresses its own columns: decompress it).",
        "",
        f"A CSV's delimiter is sniffed from its first lines among {', '.join(_SHOWN[d] for d in DELIMITERS)} "
        f"(a tie goes to the first), or given: `--delimiter` takes one character or {names}.",
        "",
        "Refused as a whole, in one line naming the file (and the line or the columns found): a file that is not "
        "what its name says (a CSV named `.parquet`, a spreadsheet), text that is not UTF-8 (UTF-16 from a "
        "spreadsheet, or Latin-1 of any length), a quote left open, a header without the id column or a "
        "`--text-fields` column, a compressed stream cut short. A few bad "
        "rows are reported and skipped; more than `catalog.max_bad_rows` and `catalog.max_bad_share` allow, "
        "or far fewer products than the current version, and the new version is held back, not served "
        "(`--force` publishes it; [commands.md](commands.md#embedcar-catalog-build)).",
        "",
        "Example, `products.csv`:",
        "",
        "```",
        ",".join(GROCERY_COLUMNS),
        "p-1,Greek Yogurt Plain 32 oz,yogurt,dairy eggs,5.49",
        "p-2,\"Oat Milk, Barista Edition\",milk,dairy eggs,4.99",
        "```",
        "",
        "The same as JSON Lines, `products.jsonl`:",
        "",
        "```",
        '{"id": "p-1", "title": "Greek Yogurt Plain 32 oz", "aisle": "yogurt", "department": "dairy eggs", '
        '"price": 5.49}',
        "```",
        "",
        f"`{GROCERY_SOURCE}` in place of a file is the bundled synthetic grocery catalog "
        f"({', '.join(GROCERY_COLUMNS)}).",
        "",
    ]
    return "\n".join(lines)
