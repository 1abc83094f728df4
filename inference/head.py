"""The model's head: token states -> pooling -> Dense layers -> normalise -> one checked vector per text.

What sentence-transformers runs after the transformer (modules.json: Pooling, Dense, Normalize),
in numpy, shared by the embedded backend and both Triton models (their config parameters carry it:
`params()` / `from_params()`), so every path answers with the same vector. Dense layers run after
pooling, not inside the exported graph: the pooling step sits between the encoder and them, and a
[B, H] x [H, D] product is microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from inference.errors import ModelError
from inference.manifest import Manifest
from inference.pooling import check_finite, check_mode, l2_normalize, pool

FloatArray = npt.NDArray[np.float32]

# sentence-transformers writes the activation as a dotted torch class name; the last part is read.
ACTIVATIONS: dict[str, Callable[[FloatArray], FloatArray]] = {
    "Identity": lambda x: x,
    "Tanh": np.tanh,
    "ReLU": lambda x: np.maximum(x, np.float32(0)),
    "Sigmoid": lambda x: (1.0 / (1.0 + np.exp(-x))).astype(np.float32),
}


def activation_name(dotted: str | None) -> str:
    """'torch.nn.modules.activation.Tanh' -> 'Tanh'; ModelError for one we do not run."""
    name = (dotted or "Identity").rsplit(".", 1)[-1]
    if name not in ACTIVATIONS:
        raise ModelError(f"Dense activation {dotted!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return name


@dataclass(frozen=True, slots=True)
class Dense:
    weight: FloatArray  # [out, in], as torch.nn.Linear stores it
    bias: FloatArray | None
    activation: str

    def __call__(self, x: FloatArray) -> FloatArray:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return ACTIVATIONS[self.activation](y.astype(np.float32, copy=False))


def save_dense(path: Path, layers: Sequence[Dense]) -> None:
    arrays: dict[str, FloatArray] = {}
    for i, layer in enumerate(layers):
        arrays[f"w{i}"] = layer.weight
        if layer.bias is not None:
            arrays[f"b{i}"] = layer.bias
    with path.open("wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


def load_dense(path: Path, activations: Sequence[str]) -> tuple[Dense, ...]:
    try:
        with np.load(path) as z:
            return tuple(Dense(np.asarray(z[f"w{i}"], np.float32),
                               np.asarray(z[f"b{i}"], np.float32) if f"b{i}" in z else None, activation_name(act))
                         for i, act in enumerate(activations))
    except (OSError, KeyError, ValueError) as exc:
        raise ModelError(f"cannot read the Dense layers in {path}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Head:
    mode: str
    special_ids: tuple[int, ...] = ()
    dense: tuple[Dense, ...] = ()
    normalize: bool = True

    @classmethod
    def from_manifest(cls, model_dir: Path, manifest: Manifest) -> Head:
        dense = load_dense(model_dir / manifest.dense_file, manifest.dense_activations) if manifest.dense_file else ()
        return cls(check_mode(manifest.pooling), manifest.special_ids, dense, manifest.normalize)

    def __call__(self, hidden: npt.NDArray[np.floating], attention_mask: npt.NDArray[np.integer], *,
                 input_ids: npt.NDArray[np.integer] | None = None, skip: int = 0) -> FloatArray:
        """[B, L, H] states -> [B, dim] float32; Internal if any value is not finite."""
        out = pool(hidden, attention_mask, self.mode, input_ids=input_ids, special_ids=self.special_ids,
                   normalize=False, skip=skip)
        for layer in self.dense:
            out = layer(out)
        return check_finite(l2_normalize(out) if self.normalize else out)


def head_params(model_dir: Path, manifest: Manifest) -> dict[str, str]:
    """The head as Triton string parameters (what `from_params` reads back inside a stub)."""
    return {
        "mode": manifest.pooling,
        "special_ids": ",".join(str(i) for i in manifest.special_ids),
        "normalize": str(int(manifest.normalize)),
        "dense_path": str((model_dir / manifest.dense_file).resolve()) if manifest.dense_file else "",
        "dense_activations": ",".join(manifest.dense_activations),
    }


def from_params(params: Mapping[str, str]) -> Head:
    acts = [a for a in params.get("dense_activations", "").split(",") if a]
    dense = load_dense(Path(params["dense_path"]), acts) if params.get("dense_path") else ()
    return Head(check_mode(params.get("mode", "mean")),
                tuple(int(x) for x in params.get("special_ids", "").split(",") if x),
                dense, params.get("normalize", "1") != "0")
