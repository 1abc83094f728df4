"""The demo section (the whole project's `Settings`, with every section, is embedcar_settings.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from catalog.fusion import SearchMode
from inference.settings import setting


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
    max_messages_per_s: float = setting(50.0, "Per-connection websocket message cap.", advanced=True)
    max_message_bytes: int = setting(4096, "Largest websocket message accepted; bigger closes the socket.",
                                     advanced=True)
    max_query_chars: int = setting(200, "Longest query text searched; longer gets an error message.", advanced=True)
    results: int = setting(10, "Products shown per keystroke.", advanced=True)
    search_timeout_s: float = setting(2.0, "Deadline of one Search call to the sidecar.", advanced=True)
    search_mode: str = setting(
        SearchMode.HYBRID.value, "The page's default Search mode (the page can switch): hybrid fuses the semantic "
        "and the lexical prefix search.", choices=tuple(m.value for m in SearchMode), advanced=True)
