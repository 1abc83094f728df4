"""The model manifest: what a prepared model directory holds and the version id derived from it.

The version id hashes every checksum that can change an embedding (weights, tokenizer, ONNX
variants, pooling, max length), so cache keys and indexes built with it never mix models.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

from inference.errors import ModelError
from inference.files import atomic_write_text, sha256_file
from inference.pooling import check_mode

MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True, slots=True)
class Variant:
    file: str
    sha256: str
    precision: str  # fp32 | fp16 | int8
    fused: bool
    check: dict[str, float] = field(default_factory=dict)  # agreement with PyTorch at export


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    source: dict[str, str]
    architecture: str
    dim: int
    max_length: int
    pooling: str
    lowercase: bool
    buckets: tuple[int, ...]
    inputs: tuple[str, ...]
    special_ids: tuple[int, ...]
    pad_id: int
    tokenizer_sha256: str
    variants: dict[str, Variant]
    default_variant: str = "fp32"
    created: str = ""
    version_id: str = ""

    def with_version(self) -> Self:
        return type(self)(**{**_fields(self), "version_id": self.compute_version_id()})

    def compute_version_id(self) -> str:
        h = hashlib.sha256()
        for part in (
            self.source.get("sha256", ""),
            self.tokenizer_sha256,
            self.pooling,
            str(self.max_length),
            *(f"{k}:{v.sha256}" for k, v in sorted(self.variants.items())),
        ):
            h.update(part.encode())
            h.update(b"\0")
        return f"{self.name}@{h.hexdigest()[:16]}"

    def variant_id(self, variant: str) -> str:
        """Version id of one served variant: fp32 and int8 embeddings differ, so caches must too."""
        return f"{self.version_id}/{variant}"

    def variant(self, name: str | None = None) -> Variant:
        key = name or self.default_variant
        if key not in self.variants:
            raise ModelError(f"model {self.name} has no {key!r} variant (has: {', '.join(self.variants)})")
        return self.variants[key]

    @property
    def has_token_type_ids(self) -> bool:
        return "token_type_ids" in self.inputs

    def to_json(self) -> str:
        return json.dumps(_fields(self) | {"variants": {k: asdict(v) for k, v in self.variants.items()}},
                          indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Self:
        raw: dict[str, Any] = json.loads(text)
        raw["variants"] = {k: Variant(**v) for k, v in raw["variants"].items()}
        raw["buckets"] = tuple(raw["buckets"])
        raw["inputs"] = tuple(raw["inputs"])
        raw["special_ids"] = tuple(raw["special_ids"])
        m = cls(**raw)
        check_mode(m.pooling)
        return m

    def save(self, model_dir: Path) -> None:
        atomic_write_text(model_dir / MANIFEST_FILE, self.to_json())


def _fields(m: Manifest) -> dict[str, Any]:
    return {name: getattr(m, name) for name in m.__dataclass_fields__}


def load_manifest(model_dir: Path) -> Manifest:
    path = model_dir / MANIFEST_FILE
    if not path.exists():
        raise ModelError(f"no model at {model_dir}: run `embedcar model prepare` first")
    try:
        return Manifest.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{path} is not a valid manifest: {exc}") from exc


def verify_files(model_dir: Path, manifest: Manifest) -> list[str]:
    """Problems found comparing the files on disk with their manifest checksums (empty = fine)."""
    problems = []
    tok = model_dir / "tokenizer.json"
    if not tok.exists() or sha256_file(tok) != manifest.tokenizer_sha256:
        problems.append("tokenizer.json missing or changed")
    for key, v in manifest.variants.items():
        p = model_dir / v.file
        if not p.exists() or sha256_file(p) != v.sha256:
            problems.append(f"variant {key} ({v.file}) missing or changed")
    if manifest.version_id != manifest.compute_version_id():
        problems.append("version id does not match the checksums")
    return problems
