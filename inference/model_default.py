"""`embedcar model set-default NAME VARIANT`: the variant a model serves where a sidecar names none.

Written into the model's manifest, atomically (the manifest's save); the model's version id does
not change with it, so caches and indexes stay valid. Sidecars serving the model's default (an
empty model.variant) roll over to it with an index built with it, as for a new version
(sidecar/rollout.py). `embedcar model report --set-default` chooses the variant from what it
measured and writes it through here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from inference.errors import ModelError
from inference.manifest import load_manifest


def set_default_variant(model_dir: Path, variant: str, reason: str, *,
                        expected_version_id: str | None = None) -> str | None:
    """Make `variant` (a prepared one) the default of the model in `model_dir`, recording `reason`;
    the previous default where the manifest changed, None where it already said so.

    `expected_version_id`: the version a choice was measured on; a model prepared again since is
    refused (ModelError), so a measurement of one version never picks another's default."""
    manifest = load_manifest(model_dir)
    if expected_version_id is not None and manifest.version_id != expected_version_id:
        raise ModelError(f"{model_dir} changed while it was measured ({expected_version_id} -> "
                         f"{manifest.version_id}): run the report again")
    manifest.variant(variant)  # a ModelError naming the prepared variants when it is not one
    if (manifest.default_variant, manifest.default_reason) == (variant, reason):
        return None
    dataclasses.replace(manifest, default_variant=variant, default_reason=reason).save(model_dir)
    return manifest.default_variant
