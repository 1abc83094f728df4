"""The one place backends are built from settings: `make_backend(settings, kind)`.

    embedded  in-process ONNX Runtime (the model file of settings.model.variant)
    triton    a client of the Triton pool in settings.triton.urls (imported lazily: the embedded
              path never loads tritonclient)
    torch     in-process PyTorch on the model's weights/, CUDA graphs on a GPU (the `torch` extra,
              imported lazily: the other backends never load torch)

A backend says itself what the pipeline needs to know about it (`Backend.batches_itself`), so no
caller tests a backend's name or the settings' backend string to decide how to schedule it.
"""

from __future__ import annotations

import importlib

from inference.backends.base import Backend
from inference.errors import FailedPrecondition, Unavailable
from inference.manifest import load_manifest
from inference.settings import Settings

KINDS = ("embedded", "triton", "torch")


def check_kind(kind: str) -> str:
    """`kind` when it names a backend; else FailedPrecondition: a setting an operator must fix."""
    if kind not in KINDS:
        raise FailedPrecondition(f"unknown backend {kind!r}: expected one of {', '.join(KINDS)}")
    return kind


def make_backend(settings: Settings, kind: str, *, max_batch: int | None = None,
                 batch_job: bool = False) -> Backend:
    """The backend `kind` names (the sidecar passes its sidecar.backend), configured from `settings`.

    `max_batch` overrides the largest batch one call may carry (the catalog job sends bigger ones
    than the sidecar accepts).
    `batch_job`: big batches (the catalog job): model.intra_op_threads 0 means every core, not the
    one-or-every choice a query path measures (inference.backends.onnx).
    """
    m = settings.model
    check_kind(kind)
    manifest = load_manifest(m.model_dir)
    if kind == "embedded":
        from inference.backends.onnx import OnnxBackend

        return OnnxBackend(m.model_dir, manifest, variant=m.variant, threads=m.intra_op_threads, lanes=m.forward_lanes,
                           max_batch=max_batch or m.max_texts_per_call,
                           choose_threads=not batch_job)
    if kind == "torch":
        try:
            torch_backend = importlib.import_module("inference.backends.torch")
        except ImportError as exc:
            raise FailedPrecondition(f"the torch backend needs the torch extra (pip install 'embedcar[torch]'): "
                                     f"{exc}") from exc
        backend: Backend = torch_backend.TorchBackend(m.model_dir, manifest, variant=m.variant,
                                                      threads=m.intra_op_threads,
                                                      max_batch=max_batch or m.max_texts_per_call)
        return backend
    try:
        triton = importlib.import_module("inference.backends.triton")
    except ImportError as exc:
        raise Unavailable(f"the Triton backend cannot load: {exc}") from exc
    from inference.triton.tls import client_credentials

    t = settings.triton
    backend = triton.TritonBackend(
        t.urls, manifest, variant=m.variant, timeout_s=t.timeout_ms / 1000,
        max_batch=min(max_batch or m.max_texts_per_call, t.max_batch_size),
        credentials=client_credentials(t))  # None in the local profile; files checked here, named if wrong
    return backend
