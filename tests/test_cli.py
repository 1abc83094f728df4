"""The `embedcar` tool as a user runs it (a real subprocess)."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inference.cli_main import OwnInfo, build_parser, own_packages
from inference.errors import InvalidInput
from inference.flags import flag_overrides
from inference.manifest import Manifest


def _embedcar(*args: str, models_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inference.cli_main", *args, "--models-dir", str(models_dir)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_prepare_is_idempotent(model_dir: Path, manifest: Manifest) -> None:
    p = _embedcar("model", "prepare", models_dir=model_dir.parent)
    assert p.returncode == 0, p.stderr
    assert "nothing to do" in p.stdout
    assert manifest.version_id in p.stdout


def test_embed_json_for_scripts(model_dir: Path, manifest: Manifest) -> None:
    p = _embedcar("embed", "--json", "best marathon training shoes for women", "running shoes",
                  models_dir=model_dir.parent)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    emb = np.array(out["embeddings"])
    # No variant given: the CPU default, int8.
    assert out["model"] == manifest.variant_id("int8") and out["dim"] == 384 and emb.shape == (2, 384)
    assert 0.5 < float(emb[0] @ emb[1]) < 0.95  # related, not identical


def test_embed_bad_input_is_a_clear_error(model_dir: Path) -> None:
    p = _embedcar("embed", "   ", models_dir=model_dir.parent)
    assert p.returncode == 2
    assert "text 0 is empty" in p.stderr
    assert "Traceback" not in p.stderr


def test_missing_model_says_what_to_run(tmp_path: Path) -> None:
    p = _embedcar("embed", "tea", models_dir=tmp_path)
    assert p.returncode == 2
    assert "embedcar model prepare" in p.stderr


def test_every_subcommand_loads() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    helps = {c.dest: c.help for c in sub._choices_actions}  # type: ignore[attr-defined]
    assert {"model", "embed", "triton", "sidecar", "catalog", "demo", "loadtest", "bench"} <= set(helps)
    broken = {k: v for k, v in helps.items() if v and v.startswith("(unavailable")}
    assert not broken


@pytest.mark.parametrize(("argv", "takes", "not_theirs"), [
    (("catalog", "info"), {"--index-root"}, {"--batch-size", "--index-type", "--threads", "--model"}),
    (("catalog", "search"), {"--index-root", "--model", "--variant"}, {"--batch-size", "--in-flight"}),
    (("model", "show"), {"--models-dir", "--model"}, {"--threads", "--lanes", "--variant"}),
])
def test_a_command_lists_only_the_flags_it_reads(argv: tuple[str, ...], takes: set[str],
                                                  not_theirs: set[str]) -> None:
    parser = build_parser()
    sub = parser
    for word in argv:  # down the subcommands to the one named
        action = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction))
        sub = action.choices[word]
    options = {o for a in sub._actions for o in a.option_strings}
    assert takes <= options and not (not_theirs & options), options


def test_flags_come_from_settings_fields() -> None:
    from sidecar.settings import Settings

    parser = build_parser()
    args = parser.parse_args(["sidecar", "serve", "--models-dir", "m", "--model", "mini", "--threads", "1",
                              "--triton-url", "a:1", "--triton-url", "b:1,c:1", "--backend", "triton",
                              "--grpc-port", "0", "--index-dir", "idx"])
    s = Settings.load(environ={"EMBEDCAR_SIDECAR_HTTP_PORT": "-1", "EMBEDCAR_SIDECAR_GRPC_PORT": "7"},
                      overrides=flag_overrides(args))
    assert (s.model.models_dir, s.model.name, s.model.intra_op_threads) == (Path("m"), "mini", 1)
    assert s.triton.urls == ("a:1", "b:1", "c:1") and s.sidecar.backend == "triton"
    assert (s.sidecar.grpc_port, s.sidecar.http_port) == (0, -1)  # a flag beats the environment; unset keeps it
    assert s.sidecar.index_dir == Path("idx")
    with pytest.raises(InvalidInput, match="--grpc-port"):
        flag_overrides(parser.parse_args(["sidecar", "serve", "--grpc-port", "many"]))


def test_help_shows_settings_flags_with_their_variables() -> None:
    for argv, flags in [(("sidecar", "serve"), ("--models-dir", "--model", "--variant", "--threads", "--backend",
                                                 "--triton-url", "--index-dir", "EMBEDCAR_SIDECAR_GRPC_PORT")),
                        (("catalog", "build"), ("--index-root", "--text-fields", "--batch-size",
                                                "EMBEDCAR_CATALOG_INDEX_TYPE"))]:
        p = subprocess.run([sys.executable, "-m", "inference.cli_main", *argv, "--help"],
                           capture_output=True, text=True, timeout=120, check=False)
        assert p.returncode == 0, p.stderr
        text = " ".join(p.stdout.split())  # argparse wraps help lines
        assert all(flag in text for flag in flags), (argv, text)


def test_library_info_lines_stay_out_of_the_log_ours_do_not() -> None:
    # ONNX Runtime's quantizer logs a line per tensor through the root logger at INFO.
    quiet = OwnInfo(own_packages())
    assert {"inference", "sidecar", "catalog", "demo_ui", "loadtest"} <= quiet.packages

    def record(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "message", None, None)

    assert quiet.filter(record("sidecar.app", logging.INFO))
    assert quiet.filter(record("inference", logging.INFO))
    assert not quiet.filter(record("root", logging.INFO))
    assert not quiet.filter(record("onnx_model", logging.INFO))
    assert not quiet.filter(record("inference_server", logging.INFO))  # a prefix is not our package
    assert quiet.filter(record("root", logging.WARNING))
