"""Property-based fuzzing of every client surface (the fault suite's `fuzz` scenario, few examples).

The same hypothesis properties as `embedcar faults --only fuzz` (loadtest/faults/fuzz.py), run with a
small example count against the real sidecar fixtures and a real demo server in front of one:
no INTERNAL/UNKNOWN/UNAVAILABLE, no 5xx, no hang, no crash. Each property records bad cases rather
than raising on the first, so a failure lists every broken input it met.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from demo_ui.server import parse_message
from embedcar_settings import Settings
from inference.errors import InvalidInput
from loadtest.faults import fuzz
from loadtest.faults.surfaces import DemoThread, http_post
from sidecar.app import Sidecar
from tests.fixtures_demo import sidecar_search_target

__all__ = ["sidecar_search_target"]  # fixture imported for pytest

N = 60  # examples per property: a few hundred cases in all, some seconds


def assert_clean(tally: fuzz.Tally, surface: str, n: int) -> None:
    assert tally.cases(surface) >= n
    assert not tally.bad[surface], "\n".join(tally.bad[surface])


def test_grpc_raw_bytes_get_proper_codes(sidecar_search_target: str) -> None:
    tally = fuzz.Tally()
    fuzz.fuzz_grpc_raw(sidecar_search_target, N, tally)
    assert_clean(tally, "grpc-raw", N)
    assert any(o.endswith("INVALID_ARGUMENT") for o in tally.counts["grpc-raw"])
    assert fuzz.grpc_still_serves(sidecar_search_target, None)


def test_grpc_messages_with_hostile_fields_get_proper_codes(sidecar_search_target: str) -> None:
    tally = fuzz.Tally()
    fuzz.fuzz_grpc_messages(sidecar_search_target, N, tally)
    assert_clean(tally, "grpc-msg", N)
    assert tally.counts["grpc-msg"]["Search OK"] > 0  # the index path ran, not only the checks
    assert fuzz.grpc_still_serves(sidecar_search_target, None)


def test_grpc_search_without_an_index_is_a_failed_precondition(sidecar_embedded: Sidecar) -> None:
    tally = fuzz.Tally()
    fuzz.fuzz_grpc_messages(sidecar_embedded.grpc_target, 30, tally)
    assert_clean(tally, "grpc-msg", 30)
    searched = {o for o in tally.counts["grpc-msg"] if o.startswith("Search")}
    assert searched <= {"Search FAILED_PRECONDITION", "Search INVALID_ARGUMENT"}


def test_http_hostile_bodies_headers_and_encodings_get_4xx(sidecar_embedded: Sidecar) -> None:
    port = sidecar_embedded.http_port
    assert port is not None
    tally = fuzz.Tally()
    fuzz.fuzz_http(port, 80, tally)
    assert_clean(tally, "http", 80)
    assert {"200", "400"} <= set(tally.counts["http"])
    assert fuzz.http_still_serves(port, None)


@pytest.mark.parametrize(("body", "message"), [
    (b'{"input": "\\ud800"}', "lone surrogate"),
    (b'{"input": ["ok", "\\udfff milk"]}', "text 1 holds a lone surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"input": "a", "model": ' + b"9" * 5000 + b"}", "integer string conversion"),
    (b'{"\\ud800": 1, "input": "x"}', "unknown fields"),
])
def test_http_bodies_that_were_500s_are_400s(sidecar_embedded: Sidecar, body: bytes, message: str) -> None:
    assert sidecar_embedded.http_port is not None
    reply = http_post(sidecar_embedded.http_port, "/v1/embeddings", body)
    assert reply.status == 400, reply.body[:300]
    assert message.encode() in reply.body


@pytest.fixture(scope="module")
def demo_ws(sidecar_search_target: str) -> Iterator[str]:
    with DemoThread(sidecar_search_target) as url:
        yield url


def test_demo_websocket_survives_hostile_frames(demo_ws: str) -> None:
    tally = fuzz.Tally()
    fuzz.fuzz_demo(demo_ws, N, tally)
    assert_clean(tally, "demo-ws", N)
    assert "results" in tally.counts["demo-ws"]
    assert fuzz.demo_still_serves(demo_ws, None)


@pytest.mark.parametrize(("raw", "message"), [
    ('{"seq": 1, "text": "\\ud800"}', "lone surrogate"),
    ("[" * 3000 + "]" * 3000, "not JSON"),
    ('{"seq": ' + "7" * 5000 + ', "text": "x"}', "not JSON"),
])
def test_demo_frames_that_reached_the_sidecar_are_refused(raw: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse_message(raw, max_query_chars=200, default_k=10)


def test_fuzz_scenario_quick(settings: Settings, tmp_path: Path) -> None:
    """The scenario as the fault command runs it (its own sidecar, with an API key), short form."""
    result = fuzz.run(settings, tmp_path, quick=True)
    assert result.passed, result.to_json()
    assert sum(result.figures["cases"].values()) >= sum(fuzz.QUICK.values())
    assert set(result.figures["outcomes"]) == set(fuzz.SURFACES)
