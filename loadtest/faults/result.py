"""What a fault scenario reports: named checks (target vs measured) and free-form figures."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class Check:
    name: str  # e.g. "failed requests"
    target: str  # e.g. "0"
    measured: str  # e.g. "0 of 1500"
    passed: bool


@dataclass(slots=True)
class ScenarioResult:
    name: str
    title: str
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)  # JSON-able numbers and short strings
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def check(self, name: str, target: str, measured: str, passed: bool) -> bool:
        self.checks.append(Check(name, target, measured, bool(passed)))
        return bool(passed)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        return out
