"""gRPC's I/O path: the `embedcar` command turns the EventEngine I/O experiments off before gRPC
reads them (at its first import), unless the operator's environment says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from inference.grpc_io import EXPERIMENTS, POLLING_IO, for_other_grpc, prefer_polling_io

# Runs `embedcar sidecar --help` in a fresh interpreter (gRPC not imported yet), then reports what
# gRPC will have read and whether the subcommands imported it.
PROBE = """
import json, os, sys
from inference import cli_main
try:
    cli_main.main(["sidecar", "--help"])
except SystemExit:
    pass
print(json.dumps({"experiments": os.environ.get("GRPC_EXPERIMENTS"), "grpc_imported": "grpc" in sys.modules}))
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _env_without_experiments() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != EXPERIMENTS}


def test_the_command_turns_the_event_engine_io_off_before_grpc_is_imported() -> None:
    got = _probe(_env_without_experiments())
    assert got == {"experiments": POLLING_IO, "grpc_imported": True}


def test_an_operators_grpc_experiments_is_kept_even_empty() -> None:
    for value in ("", "-event_engine_listener"):
        got = _probe(_env_without_experiments() | {EXPERIMENTS: value})
        assert got["experiments"] == value


def test_too_late_once_grpc_is_imported() -> None:
    import grpc  # noqa: F401  (this process has it already: nothing may be set)

    env: dict[str, str] = {}
    assert prefer_polling_io(env) is False
    assert env == {}


def test_programs_on_another_grpc_build_get_the_operators_choice_not_ours() -> None:
    assert EXPERIMENTS not in for_other_grpc({EXPERIMENTS: POLLING_IO, "PATH": "/bin"})
    assert for_other_grpc({EXPERIMENTS: "-event_engine_client"})[EXPERIMENTS] == "-event_engine_client"
