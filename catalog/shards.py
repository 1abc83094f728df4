"""Sharded builds: worker i of n embeds the products whose id hashes to i mod n and writes its
share to `<index root>/.shards/<input fingerprint>/shard-i-of-n/`; the merge reads all n shares
back in source order. Shard folders are published like versions (complete or absent)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog import store
from catalog.product_table import read_products, write_products
from catalog.settings import Settings
from catalog.sources import Loaded, Product, compose_text
from catalog.spec import BuildSpec, check_shard, content_hash, fingerprint
from inference.errors import ModelError, NotFound

F32 = npt.NDArray[np.float32]
SHARDS_DIR = ".shards"
SHARD_INFO = "shard.json"


@dataclass(frozen=True, slots=True)
class ShardSelection:
    products: list[Product]
    rows: list[int]  # position of each product in the full source order (for the merge)


@dataclass(frozen=True, slots=True)
class Gathered:
    vectors: F32
    products: list[Product]
    embed_seconds: float  # the slowest shard's: shards run in parallel


def shard_of(pid: str, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(pid.encode(), digest_size=8).digest(), "big") % n


def select_shard(products: Sequence[Product], i: int, n: int) -> ShardSelection:
    check_shard(i, n)
    rows = [r for r, p in enumerate(products) if n == 1 or shard_of(p.id, n) == i]
    return ShardSelection([products[r] for r in rows], rows)


def group_dir(settings: Settings, spec: BuildSpec, loaded: Loaded, model_id: str) -> Path:
    """The folder of the n shards of this input (whole source, not one share) and model."""
    texts = [compose_text(p.fields, spec.text_fields) for p in loaded.products]
    key = fingerprint(model_id, spec.text_fields, content_hash(loaded.products, texts), spec.shard[1])
    return settings.catalog.index_root / SHARDS_DIR / key[:24]


def publish_shard(group: Path, shard: tuple[int, int], vectors: F32, sel: ShardSelection,
                  meta: dict[str, Any]) -> Path:
    i, n = shard
    final = group / _shard_name(i, n)

    def write(tmp: Path) -> None:
        np.save(tmp / store.VECTORS_FILE, vectors)
        write_products(tmp / store.PRODUCTS_FILE, sel.products, rows=sel.rows)
        (tmp / SHARD_INFO).write_text(json.dumps({**meta, "shard": [i, n]}, indent=2))

    if final.exists():
        shutil.rmtree(final)
    return store.publish(group, write, name=final.name)


def gather_shards(group: Path, n: int, model_id: str) -> Gathered:
    """All n shards of `group` concatenated in source order; NotFound while one is unfinished."""
    parts = [group / _shard_name(i, n) for i in range(n)]
    missing = [p.name for p in parts if not (p / SHARD_INFO).exists()]
    if missing:
        raise NotFound(f"cannot merge: shards not finished: {', '.join(missing)} (under {group})")
    vec_parts, prods, rows, embed_s = [], [], [], 0.0
    for p in parts:
        info = json.loads((p / SHARD_INFO).read_text())
        if info.get("model_id") != model_id:
            raise ModelError(f"{p} was embedded with {info.get('model_id')}, not {model_id}")
        embed_s = max(embed_s, float(info["build"]["embed_seconds"]))
        vec_parts.append(np.load(p / store.VECTORS_FILE))
        pr, rw = read_products(p / store.PRODUCTS_FILE)
        prods.extend(pr)
        rows.extend(rw or [])
    order = np.argsort(np.asarray(rows, dtype=np.int64), kind="stable")
    return Gathered(np.concatenate(vec_parts)[order], [prods[j] for j in order], embed_s)


def _shard_name(i: int, n: int) -> str:
    return f"shard-{i}-of-{n}"
