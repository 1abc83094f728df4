"""pyproject.toml: the tools-only libraries live in the `tools` extra, and a tool without them says so."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from inference.cli_main import TOOLS_EXTRA, missing_extra, report

ROOT = Path(__file__).resolve().parent.parent
SERVICE_PACKAGES = ("inference", "catalog", "sidecar", "demo_ui")


def _name(requirement: str) -> str:
    return requirement.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()


def test_tools_libraries_are_an_extra_not_a_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    assert not core & set(TOOLS_EXTRA)
    assert {_name(r) for r in project["optional-dependencies"]["tools"]} == set(TOOLS_EXTRA)
    assert ",tools]" in (ROOT / "Makefile").read_text()  # make test and make demo install it


def test_no_service_module_imports_a_tools_library() -> None:
    for package in SERVICE_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                assert not {n.partition(".")[0] for n in names} & set(TOOLS_EXTRA), path


def test_a_missing_tools_library_is_one_line(capsys: object) -> None:
    exc = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    assert "embedcar[tools]" in (missing_extra(exc) or "")
    assert missing_extra(ModuleNotFoundError("No module named 'numpy'", name="numpy")) is None
    assert report(exc, verbose=False) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert err.count("\n") == 1 and "pip install 'embedcar[tools]'" in err
