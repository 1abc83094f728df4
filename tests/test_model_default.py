"""`embedcar model set-default`: the served-by-default variant written into the manifest, nothing else.

The roll-over of sidecars serving the default is covered by test_model_report.py (the report's
--set-default writes through the same function)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from inference.cli_main import main
from inference.errors import ModelError
from inference.manifest import MANIFEST_FILE, Manifest, load_manifest
from inference.model_default import set_default_variant


@pytest.fixture
def model_copy(model_dir: Path, tmp_path: Path) -> Path:
    """The test model's manifest alone: setting a default reads and writes nothing else."""
    d = tmp_path / "models" / "shop"
    d.mkdir(parents=True)
    shutil.copy(model_dir / MANIFEST_FILE, d / MANIFEST_FILE)
    return d


def _other(m: Manifest) -> str:
    return next(v for v in sorted(m.variants) if v != m.default_variant)


def test_set_default_writes_variant_and_reason_and_keeps_the_version(model_copy: Path) -> None:
    before = load_manifest(model_copy)
    other = _other(before)
    assert set_default_variant(model_copy, other, "measured") == before.default_variant
    after = load_manifest(model_copy)
    assert (after.default_variant, after.default_reason) == (other, "measured")
    assert after.version_id == before.version_id and after.variants == before.variants
    assert set_default_variant(model_copy, other, "measured") is None  # already so: nothing written
    with pytest.raises(ModelError, match="has no 'fp9' variant"):
        set_default_variant(model_copy, "fp9", "typo")
    with pytest.raises(ModelError, match="changed while it was measured"):
        set_default_variant(model_copy, before.default_variant, "x", expected_version_id="other@0000")
    assert load_manifest(model_copy).default_variant == other  # a refusal writes nothing


def test_the_command_sets_the_default_by_name(model_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = _other(load_manifest(model_copy))
    models = str(model_copy.parent)
    assert main(["model", "set-default", "shop", other, "--models-dir", models]) == 0
    after = load_manifest(model_copy)
    assert after.default_variant == other and "embedcar model set-default" in after.default_reason
    assert f"serves {other} by default now" in capsys.readouterr().out
    assert main(["model", "set-default", "shop", "fp9", "--models-dir", models]) != 0
