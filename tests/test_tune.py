"""`embedcar model tune` on a tiny random model and a synthetic catalog it cannot know before tuning
(tests/fixtures_tuning.py): it beats its base on held-out products, the gate refuses a worse model and
leaves nothing behind, a killed run resumes to the same weights, query logs are validated, mistakes
are one line, and the tuned model rolls out with its index under load without one mixed reply."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from catalog.settings import Settings as CatalogSettings
from catalog.tuning.recipe import Recipe, parse_mix
from catalog.tuning.tune import GateRefused, Request, Result, tune
from embedcar_settings import Settings
from inference.errors import InvalidInput
from inference.manifest import load_manifest
from sidecar.app import SidecarThread
from tests.conftest import ROOT
from tests.fixtures_models import tiny_st_folder
from tests.fixtures_tuning import catalog_words, synthetic_catalog
from tests.test_rollout import Load, _assert_never_mixed, _candidate_warm, _wait, rolling_settings

BASE = "shop"
# A tiny model learns fast or not at all; 12 aisle queries cut to 25 % (two or three characters) move by a
# few hundredths between equally good models: the gate's tolerance is widened to that noise here (the
# refusal test below wrecks a model far beyond it).
RECIPE = Recipe(mix=parse_mix("title=2"), learning_rate=1e-3, batch_size=16, held_share=0.2, tolerance=0.05)


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_catalog(tmp_path_factory.mktemp("catalog") / "shop.jsonl")


@pytest.fixture(scope="module")
def base_src(catalog: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_st_folder(tmp_path_factory.mktemp("base") / "src", corpus=catalog_words(catalog), seed=3)


@pytest.fixture
def models(base_src: Path, tmp_path: Path) -> Path:
    from inference.prepare import prepare_model

    out = tmp_path / "models"
    prepare_model(out, BASE, from_dir=base_src, say=lambda _m: None)
    return out


def _settings(models: Path) -> CatalogSettings:
    s = CatalogSettings.load()
    return dataclasses.replace(s, model=dataclasses.replace(s.model, models_dir=models, name=BASE))


def _tune(models: Path, catalog: Path, name: str, **kw: object) -> Result:
    req = Request(**{"base": BASE, "catalog": str(catalog), "name": name, "recipe": RECIPE, "steps": 40,
                     "progress": False, **kw})  # type: ignore[arg-type]
    return tune(_settings(models), req, say=lambda _m: None)


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inference.cli_main", *args], cwd=ROOT, capture_output=True,
                          text=True, check=False, timeout=timeout)


def _left(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir())


def test_tuning_beats_its_base_on_held_out_products(models: Path, catalog: Path) -> None:
    r = _tune(models, catalog, "tuned")
    assert r.misses == [] and r.steps == 40
    base, tuned = r.base["aisle"], r.tuned["aisle"]
    # aisle names never appear in titles: only training can link them to the products' nouns
    assert tuned["100"]["ndcg_at_10"] >= base["100"]["ndcg_at_10"] + 0.1, (base, tuned)
    assert tuned["50"]["ndcg_at_10"] > base["50"]["ndcg_at_10"], (base, tuned)
    assert {s for s in r.tuned} == {"aisle", "attribute", "noun", "known-item"}
    assert set(r.tuned["known-item"]) == {"25", "50", "75", "100"}
    m = load_manifest(models / "tuned")
    assert m.lineage["base"] == load_manifest(models / BASE).version_id
    assert m.lineage["gate"] == "passed" and m.lineage["steps"] == 40 and m.lineage["seed"] == 0
    assert m.lineage["recipe"]["learning_rate"] == RECIPE.learning_rate
    assert m.lineage["held_out"]["tuned"] == r.tuned and m.lineage["pairs"]["taxonomy"] > 0
    assert m.max_length == load_manifest(models / BASE).max_length  # trained at 32 tokens, served as the base
    assert (models / "tuned" / "weights" / "config.json").is_file()  # what a later tune starts from
    assert _left(models) == [BASE, "tuned"]  # the run's folder is gone
    # a tuned model tunes again from its kept weights
    again = _tune(models, catalog, "tuned-twice", base="tuned", steps=5, force=True)
    assert load_manifest(models / "tuned-twice").lineage["base"] == m.version_id and again.steps == 5


def test_hard_negatives_are_same_aisle_products_without_the_attribute(catalog: Path) -> None:
    from catalog.sources import read_path
    from catalog.tuning.catalog_pairs import Pair, add_negatives, attributes

    products = read_path(catalog).products
    by_title = {p.fields["title"]: p for p in products}
    dairy = next(p for p in products if "dairy free" in p.fields["title"])
    pairs = [Pair(f"dairy free {dairy.fields['title'].split()[-1]}", dairy.fields["title"], "attribute", dairy.id),
             Pair(dairy.fields["aisle"], dairy.fields["title"], "taxonomy", dairy.id)] * 20
    out = add_negatives(pairs, products, ("title",), seed=1)
    for pair in out:
        neg = by_title[pair.negative]
        assert pair.negative != pair.positive
        if pair.kind == "attribute":  # the same shelf, but not dairy free: what the shopper ruled out
            assert neg.fields["aisle"] == dairy.fields["aisle"] and "dairy free" not in attributes(pair.negative)
        else:  # the same aisle could be a right answer: another aisle's product
            assert neg.fields["aisle"] != dairy.fields["aisle"]
    assert {p.kind for p in out} == {"attribute", "taxonomy"}


def test_word_negatives_share_the_typed_words_from_another_aisle() -> None:
    from catalog.sources import Product
    from catalog.tuning.catalog_pairs import Pair, add_negatives

    rows = [("1", "Nonfat Greek Yogurt", "yogurt"), ("2", "Greek Yogurt Ranch Dressing", "salad dressing"),
            ("3", "Organic Greek Yogurt", "kosher foods"),  # ends with the words: the same thing shelved elsewhere
            ] + [(str(i), f"Filler Item {i}", f"aisle {i}") for i in range(4, 12)]
    products = [Product(pid, {"title": t, "aisle": a, "department": "d"}, i) for i, (pid, t, a) in enumerate(rows)]
    pairs = [Pair("greek yogurt", "Nonfat Greek Yogurt", "head", "1")] * 30
    with_words = {p.negative for p in add_negatives(pairs, products, ("title",), seed=0, words=True)}
    assert with_words == {"Greek Yogurt Ranch Dressing"}
    plain = {p.negative for p in add_negatives(pairs, products, ("title",), seed=0)}
    assert len(plain) > 3 and "Nonfat Greek Yogurt" not in plain


def test_tuning_with_hard_negatives_trains_on_triplets(models: Path, catalog: Path) -> None:
    r = _tune(models, catalog, "triplets", recipe=dataclasses.replace(RECIPE, hard_negatives=True), steps=20,
              force=True)
    assert r.steps == 20 and r.tuned["aisle"]["100"]["ndcg_at_10"] > r.base["aisle"]["100"]["ndcg_at_10"]
    assert load_manifest(models / "triplets").lineage["recipe"]["hard_negatives"] is True


def test_gate_refuses_a_worse_model_and_leaves_nothing_behind(models: Path, catalog: Path) -> None:
    bad = dataclasses.replace(RECIPE, learning_rate=0.5)  # wrecks the weights
    with pytest.raises(GateRefused, match="worse than shop on the held-out split") as err:
        _tune(models, catalog, "wrecked", recipe=bad)
    assert "--force" in str(err.value)
    assert _left(models) == [BASE]
    forced = _tune(models, catalog, "wrecked", recipe=bad, force=True)
    assert forced.misses and load_manifest(models / "wrecked").lineage["gate"].startswith("forced past: ")


def test_killed_run_resumes_to_the_same_weights(models: Path, catalog: Path) -> None:
    from safetensors.numpy import load_file

    def cmd(name: str) -> list[str]:
        return [sys.executable, "-m", "inference.cli_main", "model", "tune", "--models-dir", str(models),
                "--model", BASE, "--catalog", str(catalog), "--as", name, "--steps", "300", "--batch-size", "16",
                "--learning-rate", "1e-3", "--held-share", "0.2", "--no-progress", "--force"]

    whole = subprocess.run(cmd("whole"), cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert whole.returncode == 0, whole.stderr[-2000:]
    proc = subprocess.Popen(cmd("killed"), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpts = models / ".tune" / "killed" / "checkpoints"
    deadline = time.monotonic() + 300
    while not list(ckpts.glob("checkpoint-*/elapsed.json")):  # a complete checkpoint
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert not (models / "killed").exists()  # nothing published by a killed run
    resumed = subprocess.run(cmd("killed"), cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming the run" in resumed.stderr
    # its estimate counts what is left: the steps after the checkpoint, the tuned scoring only (the base's kept)
    plan = next(line for line in resumed.stderr.splitlines() if line.startswith("this run takes about "))
    assert "done before" in plan and "tuned model" in plan and "scoring the base" not in plan, plan
    a = load_file(str(models / "whole" / "weights" / "model.safetensors"))
    b = load_file(str(models / "killed" / "weights" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert load_manifest(models / "killed").lineage["steps"] == 300


def test_minutes_help_says_it_is_training_time_only(capsys: pytest.CaptureFixture[str]) -> None:
    from inference.cli_main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["model", "tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines
    assert "--minutes MINUTES minutes of training: the budget bounds the training alone." in text
    assert "exporting and checking the tuned model, and --rollout's index build come on top" in text
    assert "prints its estimate of the whole as it starts" in text


def test_a_run_says_its_whole_time_as_it_starts(models: Path, catalog: Path) -> None:
    said: list[str] = []
    req = Request(base=BASE, catalog=str(catalog), name="timed", recipe=RECIPE, minutes=0.02, force=True,
                  progress=False)
    r = tune(_settings(models), req, say=said.append)
    plans = [i for i, m in enumerate(said) if m.startswith("this run takes about ")]
    assert len(plans) == 1, said
    plan = said[plans[0]]
    assert "training (the --minutes 0.02 budget, which counts training only)" in plan
    assert "scoring the base and " in plan and "texts/s measured here" in plan
    assert "exporting and checking the tuned model's ONNX variants" in plan and "so far (catalog" in plan
    assert plans[0] < next(i for i, m in enumerate(said) if m.startswith("scoring the base model"))
    assert said[-2].startswith("timed published after ") and "(estimated about " in said[-2], said[-2]
    assert r.steps >= 1


def test_the_estimate_adds_up_its_phases() -> None:
    from catalog.tuning.estimate import EXPORT_FIXED_S, EXPORT_S_PER_M_PARAMS, Estimate, duration

    # the grocery run of the report: --minutes 2, MiniLM's 22.7M parameters
    e = Estimate(so_far_s=40, train_s=120, train_what="the --minutes 2 budget", scorings=2, documents=19_969,
                 queries=5_816, doc_rate=200, query_rate=800, params=22_700_000)
    scoring = 2 * (19_969 / 200 + 5_816 / 800)
    assert e.scoring_s == pytest.approx(scoring)
    assert e.total_s == pytest.approx(40 + 120 + scoring + EXPORT_FIXED_S + EXPORT_S_PER_M_PARAMS * 22.7)
    assert e.line().startswith(f"this run takes about {duration(e.total_s)} in all: 40 s so far")
    assert "19,969 documents and 5,816 query cuts each" in e.line() and "22.7M parameters" in e.line()
    assert "--rollout" not in e.line()
    assert "scoring the base and the tuned model on the held-out sets" in e.line()
    assert "(30,144 parameters)" in dataclasses.replace(e, params=30_144).line()
    assert "scoring the base and 3 tuned models on" in dataclasses.replace(e, scorings=4).line()
    assert "scoring the tuned model on" in dataclasses.replace(e, scorings=1, with_base=False).line()
    with_index = dataclasses.replace(e, rollout_products=49_688)
    assert with_index.total_s == pytest.approx(e.total_s + 49_688 / 200) and "49,688 products" in with_index.line()
    assert [duration(s) for s in (5, 89, 90, 600, 5400, 7200)] == ["5 s", "89 s", "1.5 min", "10.0 min", "1.5 h",
                                                                     "2.0 h"]


def test_query_log_pairs_train_and_judged_queries_gate(models: Path, catalog: Path, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in catalog.read_text().splitlines()]
    log = tmp_path / "log.csv"
    # a shopper's words for an aisle: the aisle's second word -> its products (with clicks)
    lines = ["query,product_id,clicks"] + [f"{r['aisle'].split()[1]} {i % 7},{r['id']},{i % 3}"
                                           for i, r in enumerate(rows)]
    log.write_text("\n".join(lines) + "\n")
    # labelled queries the gate scores: an aisle's first word -> the aisle; one is also a logged query,
    # whose pairs are then left out of training
    judged = tmp_path / "judged.csv"
    shared = lines[1].split(",")[0]
    aisles = sorted({r["aisle"] for r in rows})
    judged.write_text("query,category\n" + "".join(f"{a.split()[0]},{a}\n" for a in aisles)
                      + f"{shared},{rows[0]['aisle']}\n")
    r = _tune(models, catalog, "logged", pairs=log, judgements=judged, force=True)
    assert "logged" in r.tuned and set(r.tuned["logged"]) == {"25", "50", "75", "100"}
    assert "judged" in r.tuned and r.tuned["judged"]["100"]["queries"] == len(aisles) + 1
    lineage = load_manifest(models / "logged").lineage
    left_out = sum(1 for line in lines[1:] if line.split(",")[0] == shared)
    assert lineage["logged_pairs"] == len(rows) - left_out and lineage["pairs"]["logged"] > 0
    assert lineage["pairs_sha256"] and lineage["judgements_sha256"] and "judged" in lineage["held_out"]["base"]


def test_a_mostly_bad_query_log_is_refused_naming_the_row(models: Path, catalog: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"query": f"q{i}", "product_id": f"nope{i}"}) + "\n" for i in range(20)))
    with pytest.raises(InvalidInput, match="line 1"):
        _tune(models, catalog, "x", pairs=log)
    assert _left(models) == [BASE]


def test_mistakes_are_one_line(models: Path, catalog: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("search,sku_code\nmilk,p1\n")
    common = ["model", "tune", "--models-dir", str(models), "--catalog", str(catalog), "--as", "t", "--steps", "2"]
    cases = {
        "no prepared model 'nope'": [*common, "--model", "nope"],
        "empty.jsonl": ["model", "tune", "--models-dir", str(models), "--model", BASE, "--catalog", str(empty),
                        "--as", "t", "--steps", "2"],
        "out of range": [*common[:-2], "--minutes", "0"],
        "wrong.csv": [*common, "--model", BASE, "--pairs", str(wrong)],
        "--as '../up'": [*common[:6], "--as", "../up", "--steps", "2"],
        "unknown pair kinds": [*common, "--mix", "typo=1"],
    }
    for expect, args in cases.items():
        proc = _cli(*args)
        assert proc.returncode == 2, (expect, proc.stderr[-2000:])
        # one line says it (argparse's own mistakes come after its usage lines)
        said = [line for line in proc.stderr.splitlines() if expect in line]
        assert "Traceback" not in proc.stderr and len(said) == 1, (expect, proc.stderr)
        assert said[0].startswith(("embedcar: ", "embedcar model tune: error: ")), said
    assert _left(models) == [BASE]


@pytest.mark.slow
def test_tuned_in_place_rolls_out_with_its_index_under_load(models: Path, catalog: Path, settings: Settings,
                                                            tmp_path: Path) -> None:
    index_root = tmp_path / "index"
    common = ["--models-dir", str(models), "--model", BASE]
    built = _cli("catalog", "build", str(catalog), "--index-root", str(index_root), "--no-progress", *common)
    assert built.returncode == 0, built.stderr[-2000:]
    v1 = load_manifest(models / BASE)
    v1_id = v1.variant_id(v1.default_variant)
    with SidecarThread(rolling_settings(settings, models, index_root, BASE)) as sc, Load(sc.grpc_target) as load:
        load.wait_for_model(v1_id)
        tuned = _cli("model", "tune", *common, "--catalog", str(catalog), "--as", BASE, "--steps", "40",
                     "--batch-size", "16", "--learning-rate", "1e-3", "--held-share", "0.2", "--mix", "title=2",
                     "--tolerance", "0.05", "--no-progress", "--rollout", str(index_root))
        assert tuned.returncode == 0, tuned.stderr[-2000:]
        v2 = load_manifest(models / BASE)
        v2_id = v2.variant_id(v2.default_variant)
        assert v2_id != v1_id and v2.lineage["base"] == v1.version_id
        load.wait_for_model(v2_id)
        back = _cli("model", "rollback", *common)  # the base again, with its index
        assert back.returncode == 0, back.stderr[-2000:]
        load.wait_for_model(v1_id)
        _wait(lambda: not _candidate_warm(sc))
    _assert_never_mixed(load, index_root, v1_id, v2_id)


@pytest.mark.gpu
def test_tune_on_a_gpu(models: Path, catalog: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: the trainer's device choice and bf16/fp16 autocast run where one is lent")
    _tune(models, catalog, "on-gpu", force=True)
    assert load_manifest(models / "on-gpu").lineage["device"] == "cuda"
