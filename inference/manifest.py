"""The model manifest: what a prepared model directory holds and the version id derived from it.

The version id hashes every checksum that can change an embedding (weights, tokenizer, ONNX
variants, pooling, max length, and the head: Dense layers, normalisation, prompts), so cache keys
and indexes built with it never mix models.
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
WEIGHTS_DIR = "weights"  # the PyTorch folder kept inside a prepared model directory


@dataclass(frozen=True, slots=True)
class Variant:
    file: str
    sha256: str
    precision: str  # fp32 | fp16 | int8 | bf16
    fused: bool
    check: dict[str, float] = field(default_factory=dict)  # agreement with PyTorch at export
    # A torch-only model's variants (Manifest.torch_only) are precisions torch computes from the one
    # PyTorch folder: `file` is that folder (weights/), `sha256` its tree_sha256.


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
    # What sentence-transformers runs after the transformer (inference/head.py): Dense layers
    # (weights in `dense_file`, one activation each), then L2 normalisation when `normalize`.
    hidden_size: int = 0  # the encoder's width (0: same as dim); dim is the served vector's length
    normalize: bool = True
    dense_file: str = ""
    dense_sha256: str = ""
    dense_activations: tuple[str, ...] = ()
    # Text put before each query / each catalog document (config_sentence_transformers.json), and
    # each prompt's length in tokens with [CLS]: pooled over unless `include_prompt` is false.
    prompts: dict[str, str] = field(default_factory=dict)
    prompt_lengths: dict[str, int] = field(default_factory=dict)
    include_prompt: bool = True
    similarity: str = "cosine"
    # Reduced-precision variants left out because they missed their tolerance, with their figures.
    refused: dict[str, dict[str, float]] = field(default_factory=dict)
    # How the default variant was chosen (measured figures), for `model show` and the report.
    default_reason: str = ""
    # How a tuned model was made (`embedcar model tune`): base model and version, data, recipe, seed,
    # steps, held-out figures, the gate's verdict. Empty for a model prepared as it came.
    lineage: dict[str, Any] = field(default_factory=dict)
    # The PyTorch folder the variants were exported from (config.json, weights), relative to the
    # model directory: what the torch backend loads and `model tune` starts from; "" for none (an
    # ONNX folder, or a model prepared before weights were kept). Not in the version id: the source
    # checksum already covers the same weights.
    weights: str = ""
    # Prepared for torch only (`model prepare --torch-only`): no ONNX variant, the variants are the
    # precisions torch computes from `weights`; the embedded backend and Triton's ONNX/TensorRT
    # encoders refuse it (`onnx_refusal`).
    torch_only: bool = False

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
            *self._head_parts(),
            *(["torch-only"] if self.torch_only else []),  # absent otherwise: older ids stay as they were
        ):
            h.update(part.encode())
            h.update(b"\0")
        return f"{self.name}@{h.hexdigest()[:16]}"

    def _head_parts(self) -> list[str]:
        # Only what differs from the plain mean-pooled, normalised model, so ids of such models
        # (and the caches and indexes keyed by them) stay what they were before these fields.
        parts = [] if self.normalize else ["unnormalized"]
        if self.dense_file:
            parts.append(f"dense:{self.dense_sha256}:{','.join(self.dense_activations)}")
        parts += [f"prompt:{k}:{v}" for k, v in sorted(self.prompts.items()) if v]
        if not self.include_prompt:
            parts.append("exclude-prompt")
        return parts

    @property
    def encoder_width(self) -> int:
        """Width of the encoder's last_hidden_state (before any Dense layer)."""
        return self.hidden_size or self.dim

    def prompt(self, role: str) -> str:
        """The text put before a `role` ("query" or "document") text; "" for none."""
        return self.prompts.get(role, "")

    def pool_skip(self, role: str) -> int:
        """Leading tokens a `role` text's pooling leaves out (its prompt, when include_prompt is off)."""
        return 0 if self.include_prompt or not self.prompt(role) else self.prompt_lengths.get(role, 0)

    def variant_id(self, variant: str) -> str:
        """Version id of one served variant: fp32 and int8 embeddings differ, so caches must too.
        An empty `variant` is the model's default."""
        return f"{self.version_id}/{variant or self.default_variant}"

    def variant(self, name: str | None = None) -> Variant:
        key = name or self.default_variant
        if key not in self.variants:
            raise ModelError(f"model {self.name} has no {key!r} variant (has: {', '.join(self.variants)})")
        return self.variants[key]

    def weights_dir(self, model_dir: Path) -> Path | None:
        """The kept PyTorch folder, where there is one (a tuned model of before the field: weights/)."""
        rel = self.weights or (WEIGHTS_DIR if self.source.get("requirement") == "local"
                               and self.source.get("folder") == WEIGHTS_DIR else "")
        path = model_dir / rel if rel else None
        return path if path is not None and (path / "config.json").is_file() else None

    def onnx_refusal(self, consumer: str) -> str:
        """One line for `consumer`, which runs ONNX, meeting a torch-only model: what it is and how to
        prepare it fully."""
        src = self.source.get("folder", "") if self.source.get("requirement") == "local" else ""
        again = f"embedcar model prepare --force --model {self.name}" + (f" --from {src}" if src else "")
        return (f"model {self.name} was prepared for torch only (no ONNX variants), which {consumer} needs: "
                f"prepare it fully with `{again}` (without --torch-only), or serve it with sidecar.backend=torch")

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
        raw["dense_activations"] = tuple(raw.get("dense_activations", ()))
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


def tree_sha256(folder: Path) -> str:
    """A checksum of every file under `folder`, with their relative paths."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode())
        h.update(bytes.fromhex(sha256_file(path)))
    return h.hexdigest()


def verify_files(model_dir: Path, manifest: Manifest) -> list[str]:
    """Problems found comparing the files on disk with their manifest checksums (empty = fine)."""
    problems = []
    tok = model_dir / "tokenizer.json"
    if not tok.exists() or sha256_file(tok) != manifest.tokenizer_sha256:
        problems.append("tokenizer.json missing or changed")
    digests: dict[str, str] = {}  # a torch-only model's variants share one folder: hashed once
    for key, v in manifest.variants.items():
        p = model_dir / v.file
        if v.file not in digests:
            digests[v.file] = tree_sha256(p) if p.is_dir() else sha256_file(p) if p.exists() else ""
        if digests[v.file] != v.sha256:
            problems.append(f"variant {key} ({v.file}) missing or changed")
    if manifest.dense_file:
        dense = model_dir / manifest.dense_file
        if not dense.exists() or sha256_file(dense) != manifest.dense_sha256:
            problems.append(f"Dense layers ({manifest.dense_file}) missing or changed")
    if manifest.weights and manifest.weights_dir(model_dir) is None:
        problems.append(f"PyTorch weights ({manifest.weights}/) missing")
    if manifest.version_id != manifest.compute_version_id():
        problems.append("version id does not match the checksums")
    return problems
