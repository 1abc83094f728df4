"""docs/settings.md and docs/metrics.md are what `embedcar docs reference` writes from the code."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import embedcar_docs as reference
from embedcar_settings import Settings
from inference.cli_main import main as cli_main
from inference.settings import env_name, setting
from inference.settings_reference import settings_page
from sidecar.metrics import ALERTS, Metrics
from sidecar.metrics_reference import metric_rows

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_committed_pages_are_what_the_code_generates() -> None:
    assert reference.stale(DOCS) == [], "the reference pages are stale: run `embedcar docs reference`"


def test_every_setting_has_a_description_and_a_row() -> None:
    page = settings_page(Settings)
    for sec in dataclasses.fields(Settings):
        for f in dataclasses.fields(typing.get_type_hints(Settings)[sec.name]):
            assert str(f.metadata.get("doc") or "").strip(), f"{sec.name}.{f.name} has no description"
            assert f"`{env_name(sec.name, f.name)}`" in page


@dataclass(frozen=True)
class Vault:
    token: str = setting("hunter2", "A secret.", secret=True)
    path: Path | None = setting(None, "A key file.")


@dataclass(frozen=True)
class WithVault:
    vault: Vault = dataclasses.field(default_factory=Vault)


def test_a_secret_default_never_reaches_the_page() -> None:
    page = settings_page(WithVault)
    assert "hunter2" not in page and "(secret, set)" in page
    assert "| `EMBEDCAR_VAULT_PATH` | path, optional | unset | A key file. |" in page


def test_every_metric_has_alert_guidance_and_none_is_left_over() -> None:
    exported = {fam.name for fam in Metrics().registry.collect()}
    assert exported == set(ALERTS), "sidecar.metrics.ALERTS must name exactly the exported metrics"
    rows = {row.name: row for row in metric_rows()}
    assert all(row.help and row.alert for row in rows.values())
    # Labels of a metric with no series yet come from its declaration.
    assert list(rows["embedcar_requests"].labels) == ["rpc", "code"]
    assert rows["embedcar_gc_pause_seconds"].labels == {"generation": ("0", "1", "2")}


def test_the_command_writes_every_page_and_checks_them(tmp_path: Path) -> None:
    assert cli_main(["docs", "reference", "--check", "--out", str(tmp_path)]) == 1  # missing = stale
    assert cli_main(["docs", "reference", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["catalog-files.md", "http.md", "metrics.md", "settings.md"]
    assert cli_main(["docs", "reference", "--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "settings.md").write_text("edited by hand\n")
    assert cli_main(["docs", "reference", "--check", "--out", str(tmp_path)]) == 1
