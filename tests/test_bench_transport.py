"""`embedcar bench transport`: an echo over raw TCP, a gRPC unary call and a gRPC stream message."""

from __future__ import annotations

import json
import sysconfig
import time
from pathlib import Path

import pytest

from inference import native_cache
from inference.cli_main import main as cli_main
from inference.errors import Unavailable
from loadtest import native_build
from loadtest.bench.transport import (
    COMPILED_SERVERS,
    ECHO_MODULE,
    ECHO_SERVER,
    NATIVE_TRANSPORTS,
    TRANSPORTS,
    compiled_unavailable_reason,
    markdown,
    run,
)
from tests.components import native_available

# The compiled sender's rows where it builds here (tests/test_loadtest_native.py says why not), and
# the compiled servers' where they build too.
EXPECTED = (TRANSPORTS + (NATIVE_TRANSPORTS if native_available() else ())
            + (COMPILED_SERVERS if native_available() and compiled_unavailable_reason() is None else ()))


def test_every_transport_echoes_and_is_timed() -> None:
    t0 = time.perf_counter()
    result = run(rounds=1, block=5, gap_ms=1.0)
    whole_ms = (time.perf_counter() - t0) * 1e3
    assert tuple(result) == EXPECTED
    for figures in result.values():
        # Timed, in milliseconds: no echo outlasts the whole run (a bound that holds however busy
        # the machine is; a fixed ceiling would not).
        assert 0 < figures["p50_ms"] <= figures["p95_ms"] <= whole_ms
        assert figures["client_cpu_ms"] > 0 and figures["server_cpu_ms"] >= 0
    table = markdown(result, rounds=1, block=5, gap_ms=1.0)
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "ms" not in line
            and not line.startswith("|---")] == list(EXPECTED)


def test_a_compiled_server_that_cannot_build_says_what_it_needs(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_cache, "BUILT", {})  # nothing built yet in this process
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})  # no Python.h there
    with pytest.raises(Unavailable, match="python3-dev"):
        native_build.build_native(ECHO_MODULE, "embedcar_echo", module=True, build_dir=tmp_path / "build")
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ on it
    with pytest.raises(Unavailable, match="libgrpc\\+\\+-dev"):
        native_build.build_native(ECHO_SERVER, "embedcar-echo-server", build_dir=tmp_path / "build")
    assert not list(tmp_path.glob("build/*"))


def test_without_the_native_rows_the_table_says_so() -> None:
    result = run(rounds=1, block=3, gap_ms=1.0, native=False)
    assert tuple(result) == TRANSPORTS
    assert "No native rows" in markdown(result, rounds=1, block=3, gap_ms=1.0)


def test_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert cli_main(["bench", "transport", "--rounds", "1", "--block", "3", "--gap-ms", "1", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())) == set(EXPECTED)
