"""The Triton model names of one served model version (the repository writes them, clients call them),
and the request parameters the client and the models share.

Each (model, served variant) gets its own ensemble and steps, named after the model and a short hash
of its variant id: `embedder.<model>.<hash>`, `encoder.<model>.<hash>`, `pooling.<model>.<hash>`. A
client calls exactly the name of the version it serves, so a Triton that serves another version
answers "model not found" instead of computing vectors of another model for an index built with
this one; and one repository can hold several models, or the old and the new version of one.

Triton takes a model's directory name as its name and puts it in URL paths (/v2/models/<name>):
the model part keeps letters, digits, `_` and `-` only, so names stay valid and split on `.`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from inference.manifest import Manifest

ENSEMBLE_PREFIX = "embedder"
ENCODER_PREFIX = "encoder"
POOLING_PREFIX = "pooling"
# Request parameters the client sends and the repository's models read. The caller's deadline, wall
# clock (ns since the epoch): the CPU encoder answers EXPIRED instead of computing a request that
# waited past it (inference/triton/models/encoder; across hosts this needs synchronised clocks:
# docs/scale.md).
DEADLINE_PARAM = "embedcar_deadline_ns"
EXPIRED = "request timeout expired before the encoder ran"
# Leading tokens the pooling leaves out (a prompt the model pools without): sent only when not 0.
POOL_SKIP_PARAM = "embedcar_pool_skip"
_MODEL_CHARS = 40  # a readable model part; the hash, not the name, keeps versions apart
_HASH_CHARS = 10


@dataclass(frozen=True, slots=True)
class ModelNames:
    """The names of one served version's models in a Triton repository."""

    ensemble: str
    encoder: str
    pooling: str
    variant_id: str  # what the names were computed from (error messages name it)


def is_ensemble(model: str) -> bool:
    """Whether a Triton model name is one of our ensembles (statistics and traces list every step)."""
    return model.startswith(ENSEMBLE_PREFIX + ".")


def model_slug(name: str) -> str:
    return (re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-") or "model")[:_MODEL_CHARS]


def served_names(manifest: Manifest, variant: str | None = None) -> ModelNames:
    """Names for `manifest` served as `variant` (empty: the model's default): deterministic, so the
    repository generator and every client compute the same ones from the manifest alone."""
    vid = manifest.variant_id(variant or manifest.default_variant)
    suffix = f"{model_slug(manifest.name)}.{hashlib.sha256(vid.encode()).hexdigest()[:_HASH_CHARS]}"
    return ModelNames(f"{ENSEMBLE_PREFIX}.{suffix}", f"{ENCODER_PREFIX}.{suffix}", f"{POOLING_PREFIX}.{suffix}", vid)
