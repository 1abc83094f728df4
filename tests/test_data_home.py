"""Data folders (models, indexes, Triton's repository) are found from any working folder: their defaults
live under the data home (EMBEDCAR_HOME, the checkout, the container's /app, a per-user folder)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from embedcar_settings import Settings
from inference.settings import HOME_ENV, data_home
from tests.conftest import ROOT


def _checkout(folder: Path) -> Path:
    (folder / "inference").mkdir(parents=True)
    (folder / "inference" / "settings.py").write_text("")
    (folder / "pyproject.toml").write_text("[project]\nname = 'embedcar'\n")
    return folder


def test_the_home_is_the_variable_then_the_checkout_then_the_working_folder_then_the_users(tmp_path: Path) -> None:
    code = _checkout(tmp_path / "code")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    installed = tmp_path / "site-packages"  # the code installed as a package: no checkout around it
    installed.mkdir()
    assert data_home({HOME_ENV: str(tmp_path / "h")}, code_root=code, cwd=elsewhere) == tmp_path / "h"
    assert data_home({HOME_ENV: "rel"}, code_root=code, cwd=elsewhere) == elsewhere / "rel"
    assert data_home({}, code_root=code, cwd=elsewhere) == code
    app = _checkout(tmp_path / "app")  # a container's WORKDIR holding the project
    assert data_home({}, code_root=installed, cwd=app) == app
    assert data_home({"XDG_DATA_HOME": str(tmp_path / "xdg")}, code_root=installed, cwd=elsewhere) \
        == tmp_path / "xdg" / "embedcar"
    assert data_home({}, code_root=installed, cwd=elsewhere) == Path.home() / ".local" / "share" / "embedcar"


def test_defaults_follow_the_home_and_given_paths_are_kept(tmp_path: Path) -> None:
    s = Settings.load(environ={HOME_ENV: str(tmp_path)})
    assert s.model.models_dir == tmp_path / "models"
    assert s.catalog.index_root == tmp_path / "indexes" / "grocery"
    assert s.triton.repo_dir == tmp_path / "var" / "triton" / "repo"
    given = Settings.load(environ={HOME_ENV: str(tmp_path), "EMBEDCAR_MODEL_MODELS_DIR": "mine"},
                          overrides={"catalog": {"index_root": Path("idx")}})
    assert given.model.models_dir == Path("mine") and given.catalog.index_root == Path("idx")
    assert Settings.load(environ={}).model.models_dir == ROOT / "models"  # this checkout's


def test_a_command_run_from_another_folder_finds_the_checkouts_model(tmp_path: Path) -> None:
    """`make test` prepared the model in this checkout; `model show` from elsewhere reads it."""
    proc = subprocess.run([sys.executable, "-m", "inference.cli_main", "model", "show"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert '"architecture": "bert"' in proc.stdout
