"""The demo websocket's per-connection limits (apart from demo_ui.server so a caller that overrides them
need not import the web stack)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DemoLimits:
    """Per-connection limits and the page's result count: constants, not settings (nothing about a
    deployment changes them); tests and the fault suite pass others to create_app and build_server."""

    max_messages_per_s: float = 50.0  # per connection; a fast typist sends ~10
    max_message_bytes: int = 4096  # a bigger frame closes the socket (1009)
    max_query_chars: int = 200  # a longer query gets an error message
    results: int = 10  # products shown per keystroke
    search_timeout_s: float = 2.0  # deadline of one Search call to the sidecar


LIMITS = DemoLimits()
