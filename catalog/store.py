"""Versioned index directories on disk, published atomically.

Layout under an index root:
    v-<UTC timestamp>-<rand>/   one complete version: manifest.json, index.faiss, embeddings.npy,
                                products.parquet (row i of each belongs to vector i), lexical/
                                (tantivy, documents keyed by row; absent in older versions)
    held-v-<...>/               a complete version the job held back: it failed its publish checks
                                (catalog/publish.py), so it is written but never current
    .tmp-*/                     versions being written (never read)
    .work/ .shards/             batch-job checkpoints and shard outputs

A version is written into a hidden temp folder, every file fsynced, then renamed to its final
name in one step: a reader sees a complete version or none, and a crash mid-build leaves the
previous version serving. Names sort by build time, so "newest" is the greatest name.

A held version is kept out of readers' sight twice: its folder lacks the `v-` prefix every reader
lists (a sidecar of any age never sees it), and its manifest's `checks` say it failed, so a copy
renamed into place by hand is still not served (`refusal`): `catalog build --force` publishes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from inference.errors import ModelError, NotFound

VERSION_PREFIX = "v-"
HELD_PREFIX = "held-"  # + a version name
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.faiss"
VECTORS_FILE = "embeddings.npy"
PRODUCTS_FILE = "products.parquet"
FORMAT = 1


def new_version_name(now: datetime | None = None) -> str:
    t = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{VERSION_PREFIX}{t}-{secrets.token_hex(2)}"


def complete_versions(root: Path) -> list[Path]:
    """Published versions, oldest first. Temp folders start with '.', so never match."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith(VERSION_PREFIX) and (p / MANIFEST_FILE).is_file())


def read_manifest(version_dir: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((version_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise NotFound(f"no index manifest in {version_dir}") from exc
    except ValueError as exc:
        raise ModelError(f"{version_dir / MANIFEST_FILE} is not valid JSON: {exc}") from exc
    if data.get("format") != FORMAT:
        raise ModelError(f"{version_dir} has index format {data.get('format')!r}, expected {FORMAT}")
    return data


def refusal(manifest: dict[str, Any]) -> str | None:
    """Why a version must not be served (it failed its publish checks and was not forced), or None.
    Versions written before the checks existed have none: servable."""
    checks = manifest.get("checks")
    if not isinstance(checks, dict) or checks.get("passed", True) or checks.get("forced"):
        return None
    return "it failed its publish checks: " + "; ".join(checks.get("failures") or ["no reason recorded"])


def newest_version(root: Path, *, model_id: str | None = None) -> Path | None:
    """The current version: the newest complete one (of `model_id`, when given) that may be served."""
    for v in reversed(complete_versions(root)):
        try:
            manifest = read_manifest(v)
        except (NotFound, ModelError):
            if model_id is None:
                return v  # unreadable: the reader that opens it reports why
            continue
        if (model_id is None or manifest.get("model_id") == model_id) and refusal(manifest) is None:
            return v
    return None


def held_name(name: str) -> str:
    return HELD_PREFIX + name


def refused_versions(root: Path, *, model_id: str | None = None, newer_than: str = "") -> list[tuple[Path, str]]:
    """Versions written but not servable (held ones, and any whose manifest says it failed its
    checks) built after the version named `newer_than`, oldest first, each with the reason."""
    if not root.is_dir():
        return []
    out: list[tuple[Path, str]] = []
    for p in root.iterdir():
        stamp = p.name.removeprefix(HELD_PREFIX)
        if not (stamp.startswith(VERSION_PREFIX) and stamp > newer_than and (p / MANIFEST_FILE).is_file()):
            continue
        try:
            manifest = read_manifest(p)
        except (NotFound, ModelError):
            continue
        why = refusal(manifest) or ("it was held back" if p.name != stamp else None)
        if why is not None and (model_id is None or manifest.get("model_id") == model_id):
            out.append((p, why))
    return sorted(out, key=lambda pw: pw[0].name.removeprefix(HELD_PREFIX))


def fsync_tree(path: Path) -> None:
    """fsync every file, then every folder bottom-up: the rename must not outrun the data."""
    for dirpath, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(root: Path, write: Callable[[Path], None], *, name: str | None = None) -> Path:
    """Run `write(tmp_dir)`, then make the result appear as `root/name` in one rename."""
    root.mkdir(parents=True, exist_ok=True)
    name = name or new_version_name()
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the published version from other users
        fsync_tree(tmp)
        final = root / name
        tmp.rename(final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune(root: Path, *, keep: int) -> list[Path]:
    """Delete all but the newest `keep` versions of each model (open memory maps of deleted files
    stay valid). Per model: while a catalog moves to another model, sidecars still on the old one
    keep versions to serve and to restart on."""
    by_model: dict[object, list[Path]] = {}
    for v in complete_versions(root):
        try:
            model = read_manifest(v).get("model_id")
        except (NotFound, ModelError):
            model = None
        by_model.setdefault(model, []).append(v)
    old = sorted(v for vs in by_model.values() for v in (vs[:-keep] if keep > 0 else []))
    for v in old:
        drop(v)
    return old


def drop(version: Path) -> None:
    """Delete a version folder; renamed first so a half-deleted version never looks complete."""
    hidden = version.with_name(f".del-{version.name}")
    version.rename(hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def prune_held(root: Path, *, keep: int) -> list[Path]:
    """Delete all but the newest `keep` held versions: they are kept to inspect or force, and each
    is as large as a version (they never count against the live versions `prune` keeps)."""
    held = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(HELD_PREFIX + VERSION_PREFIX))
    old = held[:-keep] if keep > 0 else held
    for v in old:
        drop(v)
    return old


def remove_stale_temps(root: Path) -> None:
    """Leftovers of crashed builds (a live build's temp folder is younger than a day)."""
    if not root.is_dir():
        return
    now = datetime.now(UTC).timestamp()
    for p in root.iterdir():
        if p.name.startswith((".tmp-", ".del-")) and now - p.stat().st_mtime > 86_400:
            shutil.rmtree(p, ignore_errors=True)
