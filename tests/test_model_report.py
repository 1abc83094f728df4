"""`embedcar model report`: the verdict rule, the int8 flag, the table and the JSON shape on made-up
figures; then one short real run on the bundled MiniLM (structure and sane values, no timing limits)."""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from catalog.settings import CatalogSettings
from catalog.settings import Settings as CatalogAppSettings
from embedcar_client.client import Client
from embedcar_settings import Settings as SidecarAppSettings
from inference.cli_main import build_parser
from inference.manifest import Manifest, load_manifest, verify_files
from inference.prepare import prepare_model
from loadtest.bench.model_report import (
    ReportConfig,
    index_bytes_per_item,
    run_report,
    set_defaults,
    variants_to_measure,
)
from loadtest.bench.model_verdict import Rule, check_shape, choose_default, finish, int8_flags, markdown, verdict
from sidecar.app import SidecarThread
from tests.fixtures_models import tiny_st_folder
from tests.fixtures_sidecar import sidecar_settings

ROOT = Path(__file__).resolve().parent.parent
RULE = Rule(rate=100, sla_ms=20)


def _row(variant: str, p95_32: float, tput: float, ndcg: tuple[float, float] = (0.5, 0.9)) -> dict[str, Any]:
    return {"variant": variant, "threads": 2,
            "latency_ms": {"1x16": {"p50": p95_32 / 2, "p95": p95_32 * 0.8, "samples": 300},
                           "1x32": {"p50": p95_32 * 0.7, "p95": p95_32, "samples": 300}},
            "throughput": {"texts_per_s": tput, "batch": 32, "tokens": 32, "samples": 30},
            "index_bytes_per_item": {"flat": 1536, "ivfpq": 824},
            "quality": {"aisle-name": {"ndcg_at_10": ndcg[0], "recall_at_10": 0.4, "queries": 100},
                        "known-item": {"ndcg_at_10": ndcg[1], "recall_at_10": 0.95, "queries": 500}, "items": 5000}}


def _report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"schema": 1, "date": "2026-12-02T19:00:00+00:00", "commit": "abc", "command": "x",
            "machine": {"cpu": "test cpu", "cpus_usable": 2},
            "config": {"latency_samples": 300, "throughput_samples": 30, "batch": 32, "tokens": 32,
                       "quality_items": 5000, "known_items": 500, "threads_label": "2 threads"},
            "models": [{"name": "m", "version_id": "m@1", "dim": 384, "default_variant": "int8",
                        "default_reason": "int8 within its tolerance", "refused": {"fp16": {"min_cos": 0.5}},
                        "skipped_variants": {}, "variants": rows}]}


@pytest.mark.parametrize(("p95", "tput", "level"), [
    (10.0, 200.0, "within reach"),  # both on the line: in
    (9.0, 199.0, "tight"),  # throughput short of 2x the rate
    (10.5, 500.0, "tight"),  # P95 over half the budget
    (20.0, 100.0, "tight"),
    (20.5, 500.0, "out of reach"),
    (5.0, 99.0, "out of reach"),
])
def test_verdict_levels_follow_the_stated_rule(p95: float, tput: float, level: str) -> None:
    got = verdict(_row("fp32", p95, tput), RULE)
    assert got["level"] == level
    assert f"{p95:.1f} ms" in got["why"] and f"{tput:.0f} texts/s" in got["why"]


def test_the_rule_scales_with_rate_and_budget() -> None:
    assert verdict(_row("fp32", 4.0, 300.0), Rule(rate=200, sla_ms=10))["level"] == "tight"
    assert "200 req/s at P95 <= 10 ms" in Rule(rate=200, sla_ms=10).text()


def test_int8_is_flagged_only_more_than_001_ndcg_below_fp32() -> None:
    rows = [_row("fp32", 5, 300, (0.50, 0.90)), _row("int8", 4, 400, (0.485, 0.895)),
            _row("bf16", 4, 400, (0.495, 0.899))]
    flags = int8_flags(rows)
    assert "fp32" not in flags
    assert flags["bf16"] == []
    assert len(flags["int8"]) == 1 and flags["int8"][0].startswith("aisle-name: nDCG@10 0.485 vs fp32 0.500")
    assert int8_flags([_row("int8", 4, 400)]) == {}  # nothing to compare with


def test_finished_report_has_the_documented_shape_and_table() -> None:
    report = finish(_report([_row("fp32", 12, 150, (0.50, 0.90)), _row("int8", 8, 250, (0.47, 0.90))]), RULE)
    assert check_shape(report) == []
    assert [r["verdict"]["level"] for r in report["models"][0]["variants"]] == ["tight", "within reach"]
    json.dumps(report)  # serialisable as is
    md = markdown(report)
    table = [line for line in md.splitlines() if line.startswith("| m |")]
    assert len(table) == 2
    assert "int8 (default)" in table[1] and "⚠" in table[1] and "⚠" not in table[0]
    assert "1536 / 824" in table[0]
    assert "serves **int8** by default: int8 within its tolerance" in md
    assert "refused at prepare: fp16 (min cos 0.5000)" in md
    assert RULE.text() in md and "shared with other work" in md


def test_check_shape_names_what_is_missing() -> None:
    report = finish(_report([_row("fp32", 12, 150)]), RULE)
    broken = copy.deepcopy(report)
    del broken["models"][0]["variants"][0]["quality"]
    del broken["models"][0]["default_reason"]
    assert check_shape(broken) == ["model m: no default_reason", "m/fp32: no quality"]


def test_index_bytes_per_item_flat_and_ivfpq() -> None:
    cs = CatalogSettings()
    # ivfpq: dim/4 4-bit codes (dim/8 bytes) + fp16 re-rank copy (2 x dim) + int64 id
    assert index_bytes_per_item(384, cs) == {"flat": 1536, "ivfpq": 48 + 768 + 8}
    assert index_bytes_per_item(768, cs) == {"flat": 3072, "ivfpq": 96 + 1536 + 8}
    assert index_bytes_per_item(768, CatalogSettings(ivfpq_refine="sq8")) == {"flat": 3072, "ivfpq": 96 + 768 + 8}
    assert index_bytes_per_item(30, cs) == {"flat": 120}  # no PQ layout for this dimension


def test_variants_left_out_say_why(manifest: Manifest) -> None:
    chosen, skipped = variants_to_measure(manifest, ())
    assert chosen == [v for v in manifest.variants if v != "fp16"]
    assert "fp16" not in manifest.variants or "GPU" in skipped["fp16"]
    chosen, skipped = variants_to_measure(manifest, ("fp32", "nope"))
    assert chosen == ["fp32"] and skipped["nope"] == "not prepared"


def test_model_report_is_a_model_subcommand() -> None:
    args = build_parser().parse_args(["model", "report", "a", "b", "--limit", "0"])
    assert args.names == ["a", "b"] and args.limit == 0 and callable(args.func)


@pytest.mark.slow
def test_a_short_real_report_on_the_bundled_model(tmp_path: Path, model_dir: Path) -> None:
    settings = CatalogAppSettings.load(environ={}, overrides={"model": {"models_dir": ROOT / "models"}})
    cfg = ReportConfig(variants=("fp32", "int8"), latency_samples=8, throughput_samples=2, batch=4,
                       quality_items=300, known_items=20, rule=RULE)
    report, paths = run_report(settings, [model_dir.name], cfg, out_dir=tmp_path, say=lambda _m: None)
    assert check_shape(report) == []
    on_disk = json.loads(paths["json"].read_text())
    assert on_disk["models"][0]["name"] == model_dir.name and on_disk["config"]["quality_items"] == 300
    m = on_disk["models"][0]
    assert m["dim"] == 384 and m["default_variant"] in ("fp32", "int8") and m["default_reason"]
    assert [r["variant"] for r in m["variants"]] == ["fp32", "int8"]
    for r in m["variants"]:
        for shape in ("1x16", "1x32"):
            lat = r["latency_ms"][shape]
            assert 0 < lat["p50"] <= lat["p95"] and lat["samples"] == 8
        assert r["throughput"]["texts_per_s"] > 0 and r["throughput"]["batch"] == 4
        assert r["index_bytes_per_item"] == {"flat": 1536, "ivfpq": 824}
        for s in ("aisle-name", "known-item"):
            assert 0 <= r["quality"][s]["ndcg_at_10"] <= 1 and r["quality"][s]["queries"] > 0
        assert r["quality"]["items"] == 300
        assert r["verdict"]["level"] in ("within reach", "tight", "out of reach")
    # The same weights at two precisions rank nearly alike: a broken int8 row would not.
    fp32, int8 = (r["quality"]["known-item"]["ndcg_at_10"] for r in m["variants"])
    assert abs(fp32 - int8) < 0.1
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"| {model_dir.name} | 384 | fp32" in paths["md"].read_text()


def test_the_default_is_the_fastest_variant_within_the_quality_tolerance() -> None:
    def model(*rows: dict[str, Any]) -> dict[str, Any]:
        m: dict[str, Any] = _report(list(rows))["models"][0]
        return m

    fast_int8 = choose_default(model(_row("fp32", 12, 150, (0.50, 0.90)), _row("int8", 8, 250, (0.495, 0.90))))
    assert fast_int8 is not None and fast_int8[0] == "int8" and "int8 8.00 ms, fp32 12.00 ms" in fast_int8[1]
    worse = choose_default(model(_row("fp32", 12, 150, (0.50, 0.90)), _row("int8", 8, 250, (0.47, 0.90))))
    assert worse is not None and worse[0] == "fp32" and "left out for quality: int8 (aisle-name" in worse[1]
    slower = choose_default(model(_row("fp32", 7, 150, (0.50, 0.90)), _row("int8", 8, 250, (0.50, 0.90))))
    assert slower is not None and slower[0] == "fp32"
    no_quality = _row("fp32", 7, 150)
    no_quality["quality"] = {}
    assert choose_default(model(no_quality, _row("int8", 5, 250))) is None  # nothing to judge int8 against


def test_set_default_writes_the_manifest_and_a_sidecar_serving_the_default_rolls_over(
        settings: SidecarAppSettings, tmp_path: Path) -> None:
    models = tmp_path / "models"
    prepare_model(models, "shop-tiny", from_dir=tiny_st_folder(tmp_path / "st"), say=lambda _m: None)
    before = load_manifest(models / "shop-tiny")
    assert {"fp32", "int8"} <= set(before.variants)
    other = "fp32" if before.default_variant == "int8" else "int8"
    s = sidecar_settings(settings, poll_s=0.2, grace_s=0.2)
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, models_dir=models, name="shop-tiny", variant=""))
    # Measured rows (made up here: the measuring has its own test) in which `other` wins.
    rows = [_row(other, 5, 300, (0.50, 0.90)), _row(before.default_variant, 9, 200, (0.50, 0.90))]
    report = _report(rows)
    report["models"][0].update(name="shop-tiny", version_id=before.version_id)
    with SidecarThread(s) as sc, Client(sc.grpc_target) as c:
        assert c.embed(["oat milk"]).model == before.variant_id(before.default_variant)
        assert set_defaults(s, report, say=lambda _m: None) == {"shop-tiny": other}
        after = load_manifest(models / "shop-tiny")
        assert after.default_variant == other and "fastest at batch 1" in after.default_reason
        assert after.version_id == before.version_id and verify_files(models / "shop-tiny", after) == []
        deadline = time.monotonic() + 60
        while c.embed(["oat milk"]).model != after.variant_id(other):  # no index: it switches once warm
            assert time.monotonic() < deadline, "the sidecar did not roll over to the new default"
            time.sleep(0.1)
    assert set_defaults(s, report, say=lambda _m: None) == {}  # already so: nothing written
