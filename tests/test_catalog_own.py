"""A team's own catalog through the CLI from a fresh data home: each catalog builds into its own
index root, another catalog is refused from an index it does not belong to (--force or not), held
builds are listed and dropped, and the filter fields are the file's own columns.

Real model, real FAISS and tantivy, real files in tmp_path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from catalog import store
from catalog.cli import catalog_name
from catalog.fusion import SearchMode
from catalog.index import ProductIndex
from catalog.sources import Loaded
from embedcar_settings import Settings
from inference.errors import InvalidInput


@pytest.fixture(scope="module")
def titles(grocery_slice: Loaded) -> list[tuple[str, str, str]]:
    return [(p.fields["title"], p.fields["aisle"], p.fields["department"]) for p in grocery_slice.products]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh data home: nothing built, no index root configured."""
    monkeypatch.setenv("EMBEDCAR_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EMBEDCAR_CATALOG_INDEX_ROOT", raising=False)
    return tmp_path / "home"


def cli(settings: Settings, *args: str) -> int:
    from inference.cli_main import main

    model = ["--models-dir", str(settings.model.models_dir), "--variant", "fp32", "--threads", "2"]
    return main([*args, *(model if args[1] in ("build", "search") else [])])


def write_csv(path: Path, rows: list[tuple[str, str, str]], *, prefix: str, header: str = "id,title,aisle,department"
              ) -> Path:
    def q(v: str) -> str:
        return '"' + v.replace('"', '""') + '"'

    lines = [header] + [f"{prefix}{i:03d},{q(t)},{q(a)},{q(d)}" for i, (t, a, d) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_catalog_names_come_from_the_file() -> None:
    assert catalog_name("grocery") == "grocery"
    assert catalog_name("/data/My Shop.CSV.gz") == "my-shop"
    assert catalog_name("exports/products.2026-12.jsonl.zst") == "products.2026-12"
    assert catalog_name("...csv") == "catalog"


def test_a_teams_first_build_lands_in_its_own_index_never_the_demos(
        settings: Settings, home: Path, tmp_path: Path, titles: list[tuple[str, str, str]],
        capsys: pytest.CaptureFixture[str]) -> None:
    demo = write_csv(tmp_path / "demo.csv", titles[:60], prefix="")
    assert cli(settings, "catalog", "build", str(demo), "--name", "grocery", "--no-progress") == 0
    grocery = home / "indexes" / "grocery"
    served = store.newest_version(grocery)
    assert served is not None
    capsys.readouterr()

    own = write_csv(tmp_path / "my-shop.csv", titles[100:112], prefix="SKU ")
    assert cli(settings, "catalog", "build", str(own), "--no-progress") == 0
    out, err = capsys.readouterr()
    mine = store.newest_version(home / "indexes" / "my-shop")
    assert mine is not None and store.read_manifest(mine)["count"] == 12
    assert f"serve it: embedcar sidecar serve --index-dir {home / 'indexes' / 'my-shop'}" in out
    assert "filter fields: department, aisle" in out
    # Each phase after embedding says what it did and took.
    assert "FAISS index built: flat, 12 items" in err and "lexical index built: 12 documents" in err
    assert f"published: {mine}" in err
    assert store.newest_version(grocery) == served  # the demo's index untouched

    # Pointed at the demo's index on purpose, it is another catalog: refused before embedding,
    # --force or not, naming the way out; nothing written aside.
    for force in ((), ("--force",)):
        assert cli(settings, "catalog", "build", str(own), "--name", "grocery", "--no-progress", *force) == 2
        err = capsys.readouterr().err
        assert "another catalog: 0 of this build's 12 ids are among the 60" in err, err
        assert "--index-root" in err and "--name" in err
    assert store.newest_version(grocery) == served and store.refused_versions(grocery) == []


def test_held_builds_are_listed_by_info_and_dropped(
        settings: Settings, home: Path, tmp_path: Path, titles: list[tuple[str, str, str]],
        capsys: pytest.CaptureFixture[str]) -> None:
    full = write_csv(tmp_path / "shop.csv", titles[:40], prefix="p")
    assert cli(settings, "catalog", "build", str(full), "--no-progress") == 0
    cut = write_csv(tmp_path / "cut.csv", titles[:10], prefix="p")  # same ids, a truncated export
    assert cli(settings, "catalog", "build", str(cut), "--name", "shop", "--no-progress") == 2
    [(held, _why)] = store.refused_versions(home / "indexes" / "shop")
    capsys.readouterr()
    assert cli(settings, "catalog", "info", "--name", "shop") == 0
    out = capsys.readouterr().out
    assert f"held back: {held.name}: it failed its publish checks: 10 items, under min_count_share" in out
    assert "catalog drop-held" in out

    assert cli(settings, "catalog", "drop-held", "--name", "shop", "held-v-nope") == 2
    assert f"no held version 'held-v-nope' under {home / 'indexes' / 'shop'} (held: {held.name})" in \
        capsys.readouterr().err
    assert cli(settings, "catalog", "drop-held", "--name", "shop") == 0
    assert f"deleted {held}" in capsys.readouterr().out
    assert not held.exists() and store.refused_versions(home / "indexes" / "shop") == []
    assert store.newest_version(home / "indexes" / "shop") is not None  # the live version stays


def test_filter_fields_are_the_files_columns_matched_case_insensitively(
        settings: Settings, home: Path, tmp_path: Path, titles: list[tuple[str, str, str]],
        capsys: pytest.CaptureFixture[str]) -> None:
    rows = titles[:50]
    header = "id,Title,Aisle,Department"
    src = write_csv(tmp_path / "caps.csv", rows, prefix="c", header=header)
    # A declared field the file lacks: refused at once, with the column it meant.
    assert cli(settings, "catalog", "build", str(src), "--text-fields", "Title", "--filter-fields", "aisle,dept",
               "--no-progress") == 2
    assert "no column 'dept' for --filter-fields" in capsys.readouterr().err
    assert cli(settings, "catalog", "build", str(src), "--text-fields", "Title", "--filter-fields", "DEPARTMENT",
               "--no-progress") == 0
    assert "filter fields: Department" in capsys.readouterr().out

    root = home / "indexes" / "caps"
    version = store.newest_version(root)
    assert version is not None and store.read_manifest(version)["filter_fields"] == ["Department"]
    idx = ProductIndex.open(root, expected_model_id=None, use_gpu=False)
    dept = rows[0][2]
    for mode in (SearchMode.LEXICAL,):
        hits, _ = idx.query([rows[0][0][:6]], None, 5, mode=mode, department=dept.upper())
        assert hits[0] and all(h.fields["Department"] == dept for h in hits[0])
    with pytest.raises(InvalidInput, match="has no filter field 'aisle'; its filter fields: Department"):
        idx.query(["milk"], None, 5, mode=SearchMode.LEXICAL, aisle=rows[0][1])
    with pytest.raises(InvalidInput, match=f"has Department '{dept[:-1]}'; did you mean '{dept}'"):
        idx.query(["milk"], None, 5, mode=SearchMode.LEXICAL, filters={"department": dept[:-1]})

    # Undeclared: department and aisle, whatever their case, are found without a word.
    auto = write_csv(tmp_path / "auto.csv", rows, prefix="a", header=header)
    assert cli(settings, "catalog", "build", str(auto), "--text-fields", "Title", "--no-progress") == 0
    assert "filter fields: Department, Aisle" in capsys.readouterr().out
    info = store.read_manifest(store.newest_version(home / "indexes" / "auto"))  # type: ignore[arg-type]
    assert json.dumps(info["filter_fields"]) == '["Department", "Aisle"]'
