"""The fault suite: real processes driven through failures, each scenario a module of its own.

`embedcar faults [--only NAME,...] [--quick]` runs the scenarios and writes one Markdown + JSON
report (docs/reliability.md quotes it). A scenario module exposes

    NAME: str                          # short id, e.g. "triton-kill"
    TITLE: str                         # one line for the report
    def run(settings: Settings, work: Path, *, quick: bool) -> ScenarioResult

`quick` is the suite's short form (the tests call it); without it the scenario runs the figures the
issue asks for. `work` is a private scratch folder.
"""

from loadtest.faults.result import Check, ScenarioResult

__all__ = ["Check", "ScenarioResult"]
