"""The whole project's `Settings`: every section, and the demo's own section.

The demo, the load test, the fault suite and the docs generator run with this one; each package below
reads only its own layer's `Settings` (inference/settings.py). It sits at the top level, above
inference/, catalog/ and sidecar/ and below demo_ui/ and loadtest/, so that the tools need not take
the whole project's settings from the demo. The demo's section is here because the demo's layer is
the first that holds every section: this module is that layer's settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from catalog.fusion import SearchMode
from inference.settings import setting
from sidecar import settings as sidecar


@dataclass(frozen=True, slots=True)
class DemoSettings:
    host: str = setting("127.0.0.1", "Address the demo web server binds to.")
    port: int = setting(8765, "Demo web server port (0 = a free one).")
    tls_cert_file: Path | None = setting(
        None, "PEM certificate the demo serves HTTPS with; required beyond loopback (sidecar/tls.py).")
    tls_key_file: Path | None = setting(None, "PEM private key of tls_cert_file (0600).")
    plaintext_beyond_loopback: bool = setting(
        False, "Serve plain HTTP on a non-loopback host (TLS ends in a proxy in front).")
    budget_ms: float = setting(20.0, "Per-keystroke latency budget shown on the page.", advanced=True)
    search_mode: str = setting(
        SearchMode.HYBRID.value, "The page's default Search mode (the page can switch): hybrid fuses the semantic "
        "and the lexical prefix search.", choices=tuple(m.value for m in SearchMode), advanced=True)


@dataclass(frozen=True, slots=True)
class Settings(sidecar.Settings):
    """Every section: the demo's stack, the load test and the fault suite run with this one."""

    demo: DemoSettings = field(default_factory=DemoSettings)
