"""`embedcar bench serving` (loadtest/bench/serving.py) and the Infinity launcher (loadtest/infinity.py).

Behaviour, not timings: the table and figure from a synthetic result, the sweep dropping a failing
target, alternating rounds, Infinity's model folder; the floor: the model alone in a process of
its own keeping the schedule; then one short real run over floor, gRPC and HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from inference.cli_main import main as cli_main
from inference.errors import Unavailable
from inference.manifest import load_manifest
from loadtest.bench import cli as bench_cli
from loadtest.bench.model_floor import FloorTarget
from loadtest.bench.serving import (
    DEFAULT_KINDS,
    KINDS,
    Contender,
    ServingConfig,
    fixed_rounds,
    serving_markdown,
    start_contenders,
    sweep_targets,
    table_rows,
    write_reports,
)
from loadtest.infinity import DEFAULT_EXE, InfinityServer, infinity_unavailable_reason, prepare_folder
from loadtest.report import summarize
from loadtest.runner import RunConfig, run_load
from loadtest.targets import StubTarget, Target, Timings
from sidecar.settings import Settings as SidecarSettings
from tests.components import native_available


def _run(p50: float | None, p95: float | None, p99: float | None = None, *, rate: float = 100.0,
         errors: dict[str, int] | None = None, passed: bool = True) -> dict[str, Any]:
    return {"rate": rate, "p50": p50, "p95": p95, "p99": p99 if p99 is not None else p95, "max": p99, "mean": p50,
            "requests": 100, "ok": 100, "errors": errors or {}, "error_share": 0.0, "achieved_rate": rate,
            "pass": passed, "generator_lag_p99_ms": 0.1, "generator_warning": None}


def _sweep(best: float | None, dropped: float | None, rates: list[float]) -> dict[str, Any]:
    steps = [_run(2.0, 5.0, rate=r, passed=best is not None and r <= best) for r in rates
             if dropped is None or r <= dropped]
    return {"steps": steps, "best_rate": best, "dropped_at": dropped}


RATES = [25.0, 50.0, 75.0, 100.0]


def _synthetic() -> dict[str, Any]:
    def entry(target: str, variant: str, fixed: list[dict[str, Any]], sweep: dict[str, Any],
              skipped: str | None = None) -> dict[str, Any]:
        return {"target": target, "variant": variant, "skipped": skipped, "fixed": fixed, "sweep": sweep}

    return {
        "name": "serving", "date": "2026-12-01T10:00:00+00:00", "commit": "abc1234", "model": "tiny",
        "command": "embedcar bench serving --variants fp32,int8",
        "machine": {"platform": "Linux", "machine": "x86_64", "cpu": "Test CPU", "cpu_count": 2, "cpus_usable": 2,
                    "python": "3.11.9", "onnxruntime": "1.20"},
        "config": ServingConfig(sweep_rates=tuple(RATES)).to_json(),
        "ceilings": {"fp32": {"qps": 300.0, "threads": 2}, "int8": {"qps": 400.0, "threads": 2}},
        "sanity": {"infinity:fp32": {"cosine": 0.99999, "ok": True, "text": "q"}},
        "complete": True,
        "runs": {
            "floor:fp32": entry("floor", "fp32", [_run(2.0, 3.0, 4.0), _run(2.2, 3.4, 4.4)], _sweep(75, 100, RATES)),
            "grpc:fp32": entry("grpc", "fp32", [_run(3.0, 5.0, 7.0), _run(3.4, 6.0, 8.0, errors={"unavailable": 1})],
                               _sweep(50, 75, RATES)),
            "infinity:fp32": entry("infinity", "fp32", [], _sweep(None, None, []),
                                   skipped="not installed: make infinity"),
            "floor:int8": entry("floor", "int8", [_run(1.0, 2.0), _run(1.0, 2.0)], _sweep(None, 25, RATES)),
            "grpc:int8": entry("grpc", "int8", [_run(1.5, 4.0), _run(1.5, 4.0)], _sweep(100, None, RATES)),
        },
    }


def test_table_rows_compare_each_target_with_its_own_variants_floor_and_ceiling() -> None:
    rows = {r["key"]: r for r in table_rows(_synthetic())}
    assert list(rows) == ["floor:fp32", "grpc:fp32", "infinity:fp32", "floor:int8", "grpc:int8"]
    g = rows["grpc:fp32"]
    # Medians over the two rounds, against the fp32 floor's medians (P95 3.2, P50 2.1).
    assert g["p50"] == pytest.approx(3.2) and g["p95"] == pytest.approx(5.5) and g["p99"] == pytest.approx(7.5)
    assert g["p95_over_floor"] == pytest.approx(5.5 / 3.2) and g["p50_minus_floor"] == pytest.approx(1.1)
    assert g["errors"] == 1 and g["errors_by_code"] == {"unavailable": 1}
    assert g["best_rate"] == 50 and g["best_over_ceiling"] == pytest.approx(50 / 300)
    assert rows["floor:fp32"]["p95_over_floor"] == pytest.approx(1.0)
    assert rows["floor:fp32"]["best_over_ceiling"] == pytest.approx(75 / 300)
    # int8 against the int8 floor and the int8 ceiling, not fp32's.
    i = rows["grpc:int8"]
    assert i["p95_over_floor"] == pytest.approx(2.0) and i["p50_minus_floor"] == pytest.approx(0.5)
    assert i["best_rate"] == 100 and i["best_is_lower_bound"] and i["best_over_ceiling"] == pytest.approx(0.25)
    assert rows["floor:int8"]["best_rate"] is None and rows["floor:int8"]["swept"]
    assert rows["infinity:fp32"]["skipped"] == "not installed: make infinity"


def test_report_files_one_table_row_per_target_and_variant(tmp_path: Path) -> None:
    paths = write_reports(_synthetic(), tmp_path)
    assert set(paths) == {"json", "md", "png"}
    md = paths["md"].read_text()
    assert md == serving_markdown(_synthetic())
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| target | variant | P50 ms | P95 ms | P99 ms | P95 / floor | P50 − floor ms | errors")
    assert "highest rate ≤ 20 ms, 0 errors | / ceiling |" in table[0]
    body = table[1:]
    assert len(body) == 5
    cells = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): [c.strip() for c in line.strip("|").split("|")]
             for line in body}
    assert cells[("grpc", "fp32")][2:] == ["3.20", "5.50", "7.50", "1.72", "+1.10", "1 (unavailable 1)", "50/s", "17%"]
    assert cells[("floor", "fp32")][2:] == ["2.10", "3.20", "4.20", "1.00", "+0.00", "0", "75/s", "25%"]
    assert cells[("floor", "int8")][8:] == ["none", "–"]
    assert cells[("grpc", "int8")][8:] == ["≥ 100/s", "25%"]
    assert cells[("infinity", "fp32")][2] == "not installed: make infinity"
    assert "Floor: the model alone in its own process" in md
    # The header names where and how it was measured.
    assert "commit `abc1234`" in md and "`embedcar bench serving --variants fp32,int8`" in md
    assert "fp32 **300 queries/s**" in md and "int8 **400 queries/s**" in md and "infinity:fp32 0.999990" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 10_000
    assert json.loads(paths["json"].read_text())["runs"]["grpc:fp32"]["sweep"]["best_rate"] == 50


class BusyAboveRate(Target):
    """Answers in 1 ms when offered at most `limit`/s, else in 1 s: far over the test's SLA either way.

    The offered rate comes from the schedule, not a stopwatch: the sweep asks for as many texts as
    the step sends (rate x its seconds), and `step_texts` writes that count into each one.
    """

    name = "busy"

    def __init__(self, limit: float, seconds: float) -> None:
        self.limit = limit
        self.seconds = seconds

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        await asyncio.sleep(1.0 if int(texts[0]) / self.seconds > self.limit else 0.001)
        return None


def step_texts(n: int) -> list[str]:
    return [str(n)] * n


async def test_sweep_drops_a_target_at_its_first_failing_rate() -> None:
    base = RunConfig(rate=20, duration_s=0.5, warmup_s=0.15, deadline_ms=5000)
    steady = Contender("steady", "x", StubTarget(1.0))
    busy = Contender("busy", "x", BusyAboveRate(60.0, base.warmup_s + base.duration_s))
    # SLA 500 ms: 1 ms answers pass with room for a busy machine, 1 s answers cannot.
    out = await sweep_targets([steady, busy], [20, 40, 80, 100], base, step_texts, sla_ms=500.0,
                              settle_s=0.0, settle_max_s=5.0)
    assert [s["rate"] for s in out["busy:x"]["steps"]] == [20, 40, 80]  # not run at 100: dropped at 80
    assert out["busy:x"]["best_rate"] == 40 and out["busy:x"]["dropped_at"] == 80
    assert not out["busy:x"]["steps"][-1]["pass"] and out["busy:x"]["steps"][-1]["p95"] > 500
    assert [s["rate"] for s in out["steady:x"]["steps"]] == [20, 40, 80, 100]
    assert out["steady:x"]["best_rate"] == 100 and out["steady:x"]["dropped_at"] is None


async def test_fixed_rounds_alternate_the_order() -> None:
    a, b = Contender("a", "x", StubTarget(0.5)), Contender("b", "x", StubTarget(0.5))
    out = await fixed_rounds([a, b], RunConfig(rate=20, duration_s=0.2, warmup_s=0.05), 2, lambda n: ["q"] * n,
                             sla_ms=20.0, settle_s=0.0)
    assert [(r["round"], r["position"]) for r in out["a:x"]] == [(1, 1), (2, 2)]
    assert [(r["round"], r["position"]) for r in out["b:x"]] == [(1, 2), (2, 1)]
    assert all(r["requests"] == 4 and r["pass"] for r in out["a:x"] + out["b:x"])


def test_infinity_folder_holds_the_variants_file_and_the_tokenizer(tmp_path: Path, model_dir: Path) -> None:
    manifest = load_manifest(model_dir)
    for variant in ("fp32", "int8", "fp32"):  # switching back and forth relinks
        folder = prepare_folder(model_dir, variant, tmp_path)
        assert folder == tmp_path / f"{model_dir.name}-{variant}"
        link = folder / "model.onnx"
        assert link.is_symlink() and link.resolve() == (model_dir / manifest.variant(variant).file).resolve()
    for name in ("config.json", "tokenizer.json"):
        assert (folder / name).read_bytes() == (model_dir / name).read_bytes()
    assert json.loads((folder / "tokenizer_config.json").read_text()) == {"model_max_length": manifest.max_length}
    server = InfinityServer(model_dir, "int8", exe=tmp_path / "bin" / "infinity_emb", work_root=tmp_path, port=1234)
    cmd = server.command()
    # Run in the folder with the model id ".": the only form optimum finds a local ONNX file by.
    assert cmd[1:4] == ["v2", "--model-id", "."] and "optimum" in cmd and cmd[-1] == "1234"
    assert cmd[cmd.index("--served-model-name") + 1] == server.served_name == f"{model_dir.name}-int8"
    assert infinity_unavailable_reason(tmp_path / "bin" / "infinity_emb") == "not installed: make infinity"
    with pytest.raises(Unavailable, match="make infinity"):
        server.start()


def test_a_missing_infinity_is_a_skipped_row_not_a_failure(tmp_path: Path, model_dir: Path) -> None:
    settings = SidecarSettings.load(environ={}, overrides={"model": {"models_dir": model_dir.parent}})
    cfg = ServingConfig(variants=("fp32", "int8"), targets=("floor", "infinity"), infinity_exe=tmp_path / "nope",
                        log_dir=tmp_path / "logs")
    assert cfg.kinds_for("int8") == ["floor"]  # infinity only for --infinity-variants (fp32)
    with contextlib.ExitStack() as stack:
        got = start_contenders(settings, cfg, "fp32", stack)
    assert [(c.key, c.skipped) for c in got] == [("floor:fp32", None),
                                                 ("infinity:fp32", "not installed: make infinity")]
    assert got[0].target is not None and got[1].target is None


def test_the_floor_is_the_model_alone_in_its_own_process(model_dir: Path) -> None:
    settings = SidecarSettings.load(environ={}, overrides={"model": {"models_dir": model_dir.parent}})
    target = FloorTarget.for_model(settings.model, "int8")
    cfg = RunConfig(rate=40.0, duration_s=0.1, warmup_s=0.05, deadline_ms=5000.0)

    async def go() -> Any:
        await target.start()
        try:
            await target.call(["green tea"], timeout_s=5.0)  # a settle probe: one query
            return await run_load(target, ["red apples", "oat milk", "sourdough bread"], cfg)
        finally:
            await target.close()

    result = asyncio.run(go())
    assert [s.code for s in result.samples] == ["ok"] * 6 and [s.warmup for s in result.samples].count(True) == 2
    assert all(0 < s.latency_s < 5 for s in result.samples)
    facts = summarize(result, name="floor", sla_ms=5000.0)["target"]
    # Its own process, on the sidecar's settings (threads as the sidecar chooses them), its own CPU.
    assert facts["pid"] != os.getpid() and facts["backend"] == "embedded" and facts["threads"] >= 1
    assert facts["variant"].endswith("/int8") and 0 < facts["cpu_ms_per_query"] < 1_000
    assert result.generator_cpu_s == facts["cpu_s"]


def test_cli_defaults_match_the_modules() -> None:
    # bench/cli.py spells these out so that `embedcar` does not import the bench at start-up.
    assert ",".join(KINDS) == bench_cli.SERVING_ALL_TARGETS
    assert ",".join(DEFAULT_KINDS) == bench_cli.SERVING_TARGETS
    assert bench_cli.INFINITY_EXE == DEFAULT_EXE


@pytest.mark.slow
def test_bench_serving_end_to_end_over_floor_grpc_and_http(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "report"
    # The compiled sender's row too, where it builds here (else it is a skipped row: tests/test_loadtest_native.py).
    native = native_available()
    kinds = ["floor", "grpc", *(["stream-native"] if native else []), "http"]
    rc = cli_main(["bench", "serving", "--models-dir", str(model_dir.parent), "--variants", "fp32",
                   "--targets", ",".join(kinds), "--rate", "20", "--duration", "2", "--warmup", "1", "--rounds", "1",
                   "--sweep", "20:40:20", "--sweep-duration", "2", "--sweep-warmup", "0.5", "--ceiling-seconds", "1",
                   "--settle", "0.2", "--out", str(out), "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    assert {p.name for p in out.iterdir()} >= {"serving.json", "serving.md", "serving.png"}
    result = json.loads((out / "serving.json").read_text())
    assert result["complete"] and result["ceilings"]["fp32"]["qps"] > 0
    assert set(result["runs"]) == {f"{k}:fp32" for k in kinds}
    # The sidecar serves the model the floor runs.
    assert {k: v["cosine"] > 0.999 for k, v in result["sanity"].items()} == {f"{k}:fp32": True for k in kinds[1:]}
    floor = result["runs"]["floor:fp32"]["fixed"][0]["summary"]["target"]
    assert floor["pid"] != os.getpid() and floor["cpu_ms_per_query"] > 0
    for run in result["runs"].values():
        assert len(run["fixed"]) == 1 and run["fixed"][0]["requests"] == 40
        assert run["sweep"]["steps"][0]["rate"] == 20
    rows = [line for line in (out / "serving.md").read_text().splitlines() if line.startswith("| ")][1:]
    assert [r.split("|")[1].strip() for r in rows] == kinds
    for r in rows:
        p50, p95, p99 = (float(c) for c in r.split("|")[3:6])
        assert 0 < p50 <= p95 <= p99


INFINITY = Path(__file__).resolve().parent.parent / DEFAULT_EXE


@pytest.mark.slow
@pytest.mark.skipif(not INFINITY.exists(), reason=f"Infinity is not installed ({DEFAULT_EXE}): make infinity")
def test_loadtest_start_stack_drives_infinity(tmp_path: Path, model_dir: Path) -> None:
    rc = cli_main(["loadtest", "--start-stack", "--target", "infinity", "--rate", "5", "--duration", "1",
                   "--warmup", "0.4", "--no-cache", "--deadline-ms", "30000", "--sla-ms", "30000",
                   "--models-dir", str(model_dir.parent), "--infinity-exe", str(INFINITY), "--out", str(tmp_path),
                   "--name", "inf", "--log-dir", str(tmp_path / "logs")])
    summary = json.loads((tmp_path / "inf.json").read_text())
    assert summary["errors"] == {}, summary["error_examples"]
    assert rc == 0 and summary["ok"] == 5
    # No variant given: Infinity serves the default variant's file, int8, under the name it is given.
    assert summary["target"]["path"] == "/embeddings" and summary["target"]["model"] == f"{model_dir.name}-int8"
