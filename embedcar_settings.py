"""The whole project's `Settings`: every section. The demo, the load test, the fault suite and the docs
generator run with this one; each package reads only its own layer's `Settings` (inference/settings.py).
It sits at the top level, above every package, because only here may all the sections meet."""

from __future__ import annotations

from dataclasses import dataclass, field

from demo_ui.settings import DemoSettings
from sidecar import settings as sidecar


@dataclass(frozen=True, slots=True)
class Settings(sidecar.Settings):
    """Every section: the demo's stack, the load test and the fault suite run with this one."""

    demo: DemoSettings = field(default_factory=DemoSettings)
