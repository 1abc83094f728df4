"""The job's last step: build the FAISS index over the vectors and the lexical (tantivy) index over
the same texts, write both into one version folder, publish it atomically (`catalog.store.publish`),
then prune old versions and stale temp folders. Shard merges publish through here too, so a merged
version gets its lexical index as well.

The publish checks (`check_build`) guard the step: a build with too many bad rows, or far fewer
items than the version it would replace, is written aside as a held version (catalog/store.py), not
made current, unless forced; the verdict is recorded in the manifest either way."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog import store
from catalog.attributes import Vocabulary, mine
from catalog.faiss_lib import faiss_module
from catalog.filters import filter_fields as resolve_filter_fields
from catalog.filters import product_columns
from catalog.index_build import build_faiss
from catalog.lexical import LEXICAL_DIR, build_lexical, words
from catalog.product_table import write_products
from catalog.settings import CatalogSettings, Settings
from catalog.sources import BadRow, Product, compose_text
from inference.errors import FailedPrecondition
from inference.settings import check_range

F32 = npt.NDArray[np.float32]
KEEP_VERSIONS = 3
KEEP_HELD = 2  # the newest held version and the one before, to compare two failed attempts
LIMITS = ("max_bad_share", "max_bad_rows", "min_count_share")  # the catalog settings the checks read


@dataclass(frozen=True, slots=True)
class PublishChecks:
    """A build's publish checks and their verdict (the manifest's `checks`)."""

    rows: int  # rows read: items + bad rows
    bad_rows: int
    items: int
    current: str | None  # the version this one would replace (None: a first build)
    failures: tuple[str, ...]
    forced: bool
    limits: tuple[tuple[str, float], ...]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def servable(self) -> bool:
        return self.passed or self.forced

    def to_manifest(self) -> dict[str, Any]:
        # Only what this build decides: the same input gives the same manifest whatever the root held
        # (a failure's text names the version it was measured against).
        return {"passed": self.passed, "forced": self.forced, "failures": list(self.failures), "rows": self.rows,
                "bad_rows": self.bad_rows, "items": self.items, "limits": dict(self.limits)}

    def refusal(self, held: Path, rerun: str) -> str:
        """The one line a held build ends with: why, where it is, what serves, how to publish anyway."""
        serving = self.current or "nothing (no version published yet)"
        return (f"new index version held back, not published: {'; '.join(self.failures)}. Written aside as "
                f"{held}; still current: {serving}. To publish it anyway: {rerun}")


def check_limits(cs: CatalogSettings) -> None:
    """The checks' settings within their fields' ranges: flags and variables are checked as they are
    read, settings made in code only here (before a build spends minutes embedding)."""
    fields = {f.name: f for f in dataclasses.fields(cs)}
    for name in LIMITS:
        check_range(fields[name], getattr(cs, name), f"catalog.{name}")


def check_build(settings: Settings, *, items: int, bad: Sequence[BadRow], model_id: str,
                force: bool = False) -> PublishChecks:
    """Judge a build of `items` products with `bad` skipped rows against the limits and the current version."""
    cs = settings.catalog
    check_limits(cs)
    rows, failures = items + len(bad), []
    # Either limit alone lets a build through: a share alone would refuse a 50-row file for one
    # typo, a count alone would not scale with the catalog.
    allowed = max(cs.max_bad_rows, math.floor(cs.max_bad_share * rows))
    if len(bad) > allowed:
        failures.append(f"{len(bad)} of {rows} rows are bad ({len(bad) / rows:.1%}; allowed: {allowed}, "
                        f"max_bad_rows {cs.max_bad_rows} or max_bad_share {cs.max_bad_share:.1%} of the rows), "
                        f"e.g. line {bad[0].line}: {bad[0].reason}")
    # The version a sidecar of this model serves now; across a model change, the other model's
    # (the catalog's size does not depend on the model).
    root = cs.index_root
    current = store.newest_version(root, model_id=model_id) or store.newest_version(root)
    if current is not None:
        count = int(store.read_manifest(current).get("count") or 0)
        if items < cs.min_count_share * count:
            failures.append(f"{items} items, under min_count_share {cs.min_count_share:.0%} of the {count} of "
                            f"the current version {current.name}")
    return PublishChecks(rows=rows, bad_rows=len(bad), items=items, current=current.name if current else None,
                         failures=tuple(failures), forced=force,
                         limits=tuple((name, getattr(cs, name)) for name in LIMITS))


def check_same_catalog(settings: Settings, ids: Sequence[str]) -> None:
    """Refuse, before any embedding, a build whose ids barely overlap the current version's: another
    catalog pointed at this index root (a team's first file landing in the demo's index). Not a
    publish check --force passes: replacing one catalog by another is never what a build means."""
    cs = settings.catalog
    current = store.newest_version(cs.index_root)
    if cs.min_id_overlap <= 0 or current is None or not ids:
        return
    import pyarrow.parquet as pq

    try:
        # One column, read on this thread: no Arrow thread pool left running in a job that then exits
        table = pq.read_table(current / store.PRODUCTS_FILE, columns=["id"], use_threads=False, memory_map=False)
        theirs = {str(v) for v in table["id"].to_pylist()}
    except (OSError, ValueError, KeyError):
        return  # an unreadable version is not evidence of another catalog
    shared = len(theirs.intersection(ids))
    if shared < cs.min_id_overlap * min(len(theirs), len(ids)):
        raise FailedPrecondition(
            f"another catalog: {shared} of this build's {len(ids)} ids are among the {len(theirs)} of "
            f"{cs.index_root}'s current version {current.name} (min_id_overlap {cs.min_id_overlap:.0%}). Build it "
            f"into its own index: --name NAME (indexes/NAME) or --index-root FOLDER")


def publish_index(settings: Settings, vectors: F32, products: Sequence[Product], meta: dict[str, Any],
                  *, index_type: str | None = None, calibration: F32 | None = None,
                  checks: PublishChecks | None = None,
                  say: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """Publish a new version of `products` (row i = vectors[i]); returns it and the index parameters.
    With `checks` that failed (and were not forced) it is written as a held version instead.
    `say`: one status line per phase, with its time (a 100k-item index takes seconds to build)."""
    faiss = faiss_module()
    root = settings.catalog.index_root
    say = say or (lambda _line: None)
    t0 = time.perf_counter()
    index, params = build_faiss(vectors, settings.catalog, index_type=index_type, queries=calibration)
    params["build_seconds"] = round(time.perf_counter() - t0, 3)
    say(f"FAISS index built: {params.get('type')}, {len(products)} items, {params['build_seconds']:.1f} s")
    held = checks is not None and not checks.servable
    name = store.held_name(store.new_version_name()) if held else store.new_version_name()
    manifest = {"format": store.FORMAT, "version": name, "count": len(products), "dim": int(vectors.shape[1]),
                "index": params, "generated_items": sum(1 for p in products if p.fields.get("generated") == "true"),
                **meta}
    if checks is not None:
        manifest["checks"] = checks.to_manifest()

    # The lexical index searches the very text that was embedded (the manifest's text fields).
    text_fields = tuple(meta.get("text_fields") or settings.catalog.text_fields)
    if "filter_fields" in meta:  # the job resolved them against the file's columns
        filter_fields = tuple(meta["filter_fields"])
    else:
        filter_fields = resolve_filter_fields(settings.catalog.filter_fields, product_columns(products), "products")
    manifest["filter_fields"] = list(filter_fields)

    def write(tmp: Path) -> None:
        faiss.write_index(index, str(tmp / store.INDEX_FILE))
        np.save(tmp / store.VECTORS_FILE, np.ascontiguousarray(vectors, dtype=np.float32))
        write_products(tmp / store.PRODUCTS_FILE, products)
        texts = [compose_text(p.fields, text_fields) for p in products]
        manifest["attributes"] = mined = mine(words(t) for t in texts)
        manifest["lexical"] = lexical = build_lexical(tmp / LEXICAL_DIR, texts, products, filter_fields,
                                                      Vocabulary(mined))
        say(f"lexical index built: {lexical['docs']} documents, {len(mined)} attributes, "
            f"{lexical['build_seconds']:.1f} s")
        (tmp / store.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))

    t1 = time.perf_counter()
    version = store.publish(root, write, name=name)
    say(f"{'held back' if held else 'published'}: {version} ({time.perf_counter() - t1:.1f} s to write)")
    if held:
        store.prune_held(root, keep=KEEP_HELD)
    else:
        store.prune(root, keep=KEEP_VERSIONS)
    store.remove_stale_temps(root)
    return version, params
