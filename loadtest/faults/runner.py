"""Run fault scenarios and write one Markdown + JSON report."""

from __future__ import annotations

import importlib
import json
import logging
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from embedcar_settings import Settings
from inference.errors import InvalidInput
from loadtest.faults.result import ScenarioResult

log = logging.getLogger(__name__)

# Scenario modules in report order; each exposes NAME, TITLE and run(settings, work, *, quick).
MODULES = ("triton_kill", "triton_pool", "index_swap", "job_kill", "overload", "fuzz", "auth")


def scenarios() -> dict[str, ModuleType]:
    out: dict[str, ModuleType] = {}
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(f"loadtest.faults.{mod_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"loadtest.faults.{mod_name}":
                raise
            continue
        out[mod.NAME] = mod
    return out


def run_scenarios(settings: Settings, names: Sequence[str] | None, work: Path, *, quick: bool) -> list[ScenarioResult]:
    known = scenarios()
    chosen = list(names) if names else list(known)
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise InvalidInput(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(known)}")
    results = []
    for name in chosen:
        mod = known[name]
        d = work / name
        d.mkdir(parents=True, exist_ok=True)
        log.info("fault scenario %s: %s", name, mod.TITLE)
        t0 = time.perf_counter()
        try:
            res: ScenarioResult = mod.run(settings, d, quick=quick)
        except Exception as exc:  # one broken scenario must not cost the report of the others
            log.exception("fault scenario %s crashed", name)
            res = ScenarioResult(name, mod.TITLE)
            res.check("scenario ran to the end", "no exception", f"{type(exc).__name__}: {exc}"[:300], False)
        res.seconds = res.seconds or time.perf_counter() - t0
        log.info("fault scenario %s: %s in %.0f s", name, "passed" if res.passed else "FAILED", res.seconds)
        results.append(res)
    return results


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "?"
    except OSError:
        return "?"


def markdown(results: Sequence[ScenarioResult], *, quick: bool, command: str) -> str:
    lines = [f"# Fault suite{' (quick)' if quick else ''}", "",
             f"`{command}` · {time.strftime('%Y-%m-%d %H:%M')} · commit {_commit()} · "
             f"{platform.machine()} {__import__('os').cpu_count()} cores", "",
             "| scenario | result | seconds |", "|---|---|---:|"]
    lines += [f"| {r.name} — {r.title} | {'pass' if r.passed else '**FAIL**'} | {r.seconds:.0f} |" for r in results]
    for r in results:
        lines += ["", f"## {r.name}: {r.title}", "", "| check | target | measured | |", "|---|---|---|---|"]
        lines += [f"| {c.name} | {c.target} | {c.measured} | {'ok' if c.passed else '**FAIL**'} |" for c in r.checks]
        if r.notes:
            lines += [""] + [f"- {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


def write_report(results: Sequence[ScenarioResult], out_dir: Path, *, quick: bool, command: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "faults-quick" if quick else "faults"
    md, js = out_dir / f"{name}.md", out_dir / f"{name}.json"
    doc = {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": _commit(), "quick": quick,
           "scenarios": [r.to_json() for r in results]}
    for path, text in ((md, markdown(results, quick=quick, command=command)),
                       (js, json.dumps(doc, indent=1, default=str) + "\n")):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a reader never sees half a report
    return {"md": md, "json": js}
