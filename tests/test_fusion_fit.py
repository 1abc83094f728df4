"""The hybrid fusion fitted per query shape on judgements (`catalog quality --fit`): the fit picks the
weights that win on a shape's own cases and leaves the others at the default; the fitted version is
the same files under a new name with the weights in its manifest, and Search then uses them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from catalog import fusion_fit, store
from catalog.fusion import SEMANTIC_LEG, FittedFusion, Fusion, Ranked, SearchMode
from catalog.index import Legs, ProductIndex
from catalog.lexical import LexicalHits
from catalog.publish import publish_index
from catalog.sources import Product
from embedcar_settings import Settings

MODEL = "test-model@0000/fp32"


def two_word_case(i: int) -> fusion_fit.Case:
    """The semantic leg ranks rows 0..49; the lexical leg found row 49 first, matching only some of the
    words (no complete row): the default lets the semantic leg lead, so row 49 (the relevant one)
    falls out of the top ten; the lexical leg at full weight with a sharper k puts it first."""
    sem = Ranked.single(SEMANTIC_LEG, range(50), np.linspace(1, 0.5, 50))
    lex = LexicalHits(np.array([49, 48], np.int64), np.array([9.0, 3.0], np.float32), frozenset(), terms=2)
    return fusion_fit.Case(f"q{i}", 100, Legs(sem, lex, None), frozenset({49}))


def test_a_shape_keeps_the_weights_that_win_on_its_own_cases() -> None:
    default = Fusion()
    cases = [two_word_case(i) for i in range(fusion_fit.MIN_CASES)]
    assert fusion_fit.mean_ndcg(cases, lambda _c: default) == 0.0
    fitted = fusion_fit.fit(cases, default)
    assert set(fitted) == {"two-words"}
    assert fusion_fit.mean_ndcg(cases, lambda _c: fitted["two-words"]) == 1.0
    assert fitted["two-words"].partial_weight > default.partial_weight
    assert fusion_fit.fit(cases[:-1], default) == {}  # too few cases to tell a weight from noise


def test_the_manifest_entry_is_read_back_and_anything_unknown_is_ignored() -> None:
    default = Fusion()
    entry = fusion_fit.entry({"two-words": dataclasses.replace(default, partial_weight=1.0, k=5.0)}, default,
                             "judged.csv", [], 30)
    assert entry["shapes"] == {"two-words": {"partial_weight": 1.0, "k": 5.0}}
    back = FittedFusion.from_manifest(entry, default)
    assert back is not None and back.for_shape("two-words").partial_weight == 1.0
    assert back.for_shape("one-word") == default
    odd = FittedFusion.from_manifest({"shapes": {"two-words": {"bogus": 1}, "nine-words": {}}}, default)
    assert odd is not None and odd.shapes == {}
    assert FittedFusion.from_manifest("nonsense", default) is None


def test_the_fitted_version_is_the_same_files_and_search_uses_its_weights(settings: Settings,
                                                                          tmp_path: Path) -> None:
    s = settings.with_section("catalog", index_root=tmp_path / "idx", use_gpu=False)
    titles = ["Oat Milk", "Whole Milk", "Oat Cereal", "Milk Chocolate", "Bananas"]
    x = np.random.default_rng(0).normal(size=(len(titles), 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    version, _ = publish_index(s, x, [Product(f"p{i}", {"title": t}, i + 1) for i, t in enumerate(titles)],
                               {"model_id": MODEL, "text_fields": ["title"]}, index_type="flat")
    default = Fusion()
    entry = fusion_fit.entry({"two-words": dataclasses.replace(default, complete_weight=2.0)}, default, "j.csv", [], 25)
    fitted = fusion_fit.publish_fitted(s.catalog.index_root, version, entry, keep=3)
    assert fitted.name > version.name and store.newest_version(s.catalog.index_root) == fitted
    manifest = store.read_manifest(fitted)
    assert manifest["fitted_from"] == version.name and manifest["version"] == fitted.name
    assert manifest["fusion"]["shapes"] == {"two-words": {"complete_weight": 2.0}}
    assert (fitted / store.VECTORS_FILE).stat().st_ino == (version / store.VECTORS_FILE).stat().st_ino  # linked

    idx = ProductIndex.open(s.catalog.index_root, expected_model_id=MODEL, use_gpu=False)
    assert idx.version == fitted.name and idx.fitted is not None
    two = idx.legs(["oat milk"], x[:1])[0]
    assert two.shape == "two-words" and idx.fusion_for(two.lexical).complete_weight == 2.0
    one = idx.legs(["oat"], x[:1])[0]
    assert one.shape == "one-word" and idx.fusion_for(one.lexical) == idx.fusion
    hits, _ = idx.query(["oat milk"], x[:1], 3, mode=SearchMode.HYBRID)
    assert hits[0][0].fields["title"] == "Oat Milk"


def test_fit_from_the_command_line_publishes_and_reports_the_held_out_half(
        settings: Settings, grocery_index_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a copy of the session's small real index, with the grocery judgements (real model)."""
    import shutil

    from inference.cli_main import main

    root = tmp_path / "idx"
    shutil.copytree(grocery_index_root, root)
    before = store.newest_version(root)
    assert main(["catalog", "quality", "--prefixes", "--judgements", "grocery", "--fit", "--cuts", "50,100",
                 "--known-items", "20", "--index-root", str(root), "--models-dir", str(settings.model.models_dir),
                 "--variant", "fp32", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    after = store.newest_version(root)
    assert after is not None and before is not None and after != before
    assert store.read_manifest(after)["fitted_from"] == before.name
    assert f"published {after.name} (from {before.name})" in out
    assert "| cut | held-out queries | nDCG@10 default fusion |" in out and "| 50 % |" in out
