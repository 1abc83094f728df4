"""The prepared model on PyTorch: the transformer from the model folder's weights/, then the model's
head (pooling, Dense layers, normalisation) in torch, as inference/head.py computes it in numpy.

Two names are the interface (the torch backend, inference/backends/torch.py, and a Triton Python-backend
model import them; keep them stable):

    load_encoder(model_dir, *, device=None, dtype=None) -> TorchEncoder
        the manifest's PyTorch folder (Manifest.weights) loaded on `device` ("cuda" where there is one,
        else "cpu") in `dtype` (float16 on a GPU, float32 on a CPU, unless given), with the head.

    TorchEncoder.encode(input_ids, attention_mask, token_type_ids=None, *, skip=0) -> float32 [B, dim]
        numpy [B, L] int arrays in, numpy out; Internal when a vector is not finite. `skip`: leading
        positions the pooling leaves out (a prompt the model pools without: POOL_SKIP_PARAM in
        inference/triton/names.py). Prompts themselves are the tokenizer's: ids arrive with them.

`TorchEncoder.forward` is the same on tensors already on the device, with no host synchronisation
(`skip` may be a 0-d tensor), so a CUDA graph can capture it; its rows are not checked.

Torch and transformers come from the `torch` extra; this module imports nothing of the sidecar.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from inference.errors import FailedPrecondition, Internal, ModelError
from inference.head import Head
from inference.manifest import Manifest, load_manifest
from inference.pooling import check_finite

FloatArray = npt.NDArray[np.float32]
# The numpy head's activations (inference/head.py ACTIVATIONS), by the same names.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Identity": lambda x: x,
    "Tanh": torch.tanh,
    "ReLU": torch.relu,
    "Sigmoid": torch.sigmoid,
}
MAX_NEG = -1e9  # what the numpy max pooling puts at positions left out
# Architectures given a [B, L, L] mask: their SDPA path asks the host whether a [B, L] mask is all ones
# (transformers' _prepare_4d_attention_mask_for_sdpa), a synchronisation a CUDA graph cannot capture;
# a 3-d mask takes their other path (get_extended_attention_mask), with the same meaning.
MASK_3D = ("bert", "roberta", "xlm-roberta", "camembert", "electra")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> torch.dtype:
    """float16 on a GPU (closer to fp32 than bf16: 10 mantissa bits), float32 on a CPU."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


class TorchEncoder:
    """One prepared model's transformer and head on one device."""

    def __init__(self, model: Any, manifest: Manifest, head: Head, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.manifest = manifest
        self.head = head
        self.device = device
        self.dtype = dtype
        self.dim = manifest.dim
        self.uses_token_types = manifest.has_token_type_ids
        self._mask_3d = manifest.architecture in MASK_3D
        self._special = torch.tensor(head.special_ids or (-1,), dtype=torch.int64, device=device)
        # The Dense layers in float32 on the device, as the numpy head computes them.
        self._dense = [(torch.from_numpy(d.weight).to(device),
                        None if d.bias is None else torch.from_numpy(d.bias).to(device),
                        ACTIVATIONS[d.activation]) for d in head.dense]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                skip: int | torch.Tensor = 0) -> torch.Tensor:
        """[B, L] int64 tensors on the device -> [B, dim] float32 on the device (unchecked)."""
        mask = attention_mask[:, None, :].expand(-1, attention_mask.shape[1], -1) if self._mask_3d else attention_mask
        feed = {"input_ids": input_ids, "attention_mask": mask}
        if self.uses_token_types:
            feed["token_type_ids"] = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        hidden = self.model(**feed).last_hidden_state
        return self.pool_head(hidden, input_ids, attention_mask, skip)

    def pool_head(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  skip: int | torch.Tensor = 0) -> torch.Tensor:
        """inference.head.Head.__call__ in torch: pooling (inference.pooling.pool), Dense, normalise.
        Masked positions are selected away (torch.where), never multiplied: a NaN in padding stays there."""
        h = hidden.float()
        n = h.shape[1]
        positions = torch.arange(n, device=h.device)
        mask = attention_mask.bool() & (positions[None, :] >= skip)
        mode = self.head.mode
        if mode == "cls":
            out = h[:, 0, :]
        elif mode == "lasttoken":
            from_end = torch.argmax(mask.flip(1).to(torch.int32), dim=1)  # first attended from the right
            last = torch.where(mask.any(dim=1), n - 1 - from_end, torch.full_like(from_end, n - 1))
            out = h[torch.arange(h.shape[0], device=h.device), last, :]
        else:
            if mode == "mean_excluding_special":
                keep = mask & ~torch.isin(input_ids, self._special)
                mask = torch.where(keep.any(dim=1, keepdim=True), keep, mask)  # only special tokens: all attended
            sel = mask[:, :, None]
            if mode == "max":
                out = torch.where(sel, h, torch.full_like(h, MAX_NEG)).amax(dim=1)
            else:
                summed = torch.where(sel, h, torch.zeros_like(h)).sum(dim=1)
                out = summed / mask.sum(dim=1, dtype=torch.float32).clamp_min(1e-9)[:, None]
        for weight, bias, act in self._dense:
            out = out @ weight.T
            if bias is not None:
                out = out + bias
            out = act(out)
        if self.head.normalize:
            out = out / out.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return out

    def encode(self, input_ids: npt.NDArray[np.integer], attention_mask: npt.NDArray[np.integer],
               token_type_ids: npt.NDArray[np.integer] | None = None, *, skip: int = 0) -> FloatArray:
        """numpy [B, L] in -> [B, dim] float32 numpy; Internal if any value is not finite."""
        def dev(a: npt.NDArray[np.integer]) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

        types = dev(token_type_ids) if token_type_ids is not None else None
        try:
            out = self.forward(dev(input_ids), dev(attention_mask), types, skip)
        except (RuntimeError, ValueError) as exc:
            raise Internal(f"PyTorch failed on a {tuple(input_ids.shape)} batch: {exc}") from exc
        return check_finite(out.cpu().numpy().astype(np.float32, copy=False))


def load_encoder(model_dir: Path, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> TorchEncoder:
    """The prepared model in `model_dir` on PyTorch (see the module docstring)."""
    manifest = load_manifest(model_dir)
    weights = manifest.weights_dir(model_dir)
    if weights is None:
        raise FailedPrecondition(f"{manifest.name} in {model_dir} has no PyTorch weights (weights/), which the torch "
                                 "backend runs: prepare it again with `embedcar model prepare --force` (an ONNX-only "
                                 "model has none: serve it with the embedded backend)")
    dev = torch.device(device or default_device())
    dt = dtype or default_dtype(dev)
    model = _load_model(weights, manifest.architecture).to(device=dev, dtype=dt)
    return TorchEncoder(model, manifest, Head.from_manifest(model_dir, manifest), dev, dt)


def _load_model(folder: Path, architecture: str) -> Any:
    from transformers import AutoModel

    extra: dict[str, Any] = {"reference_compile": False} if architecture == "modernbert" else {}
    last: Exception | None = None
    # SDPA: fused attention kernels on a GPU; eager where an architecture has no SDPA path (MPNet).
    for attn in ("sdpa", "eager"):
        try:
            model = AutoModel.from_pretrained(str(folder), attn_implementation=attn, local_files_only=True,
                                              **extra)
        except (OSError, ValueError, ImportError) as exc:
            last = exc
            continue
        return model.eval()
    raise ModelError(f"{folder}: transformers cannot load the model: {last}") from last
