"""FAISS, imported on first use (it is heavy), for both the index builder and the reader."""

from __future__ import annotations

import logging
from typing import Any


def faiss_module() -> Any:
    """FAISS, typed loosely (its SWIG stubs are partial)."""
    # Its loader logs every CPU-variant probe at INFO: noise in every command's output.
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    import faiss

    return faiss


def ivf_of(index: Any) -> Any:
    """The IVF part of an IVF or IVF-PQ (+ re-rank) index: where nprobe and nlist live."""
    return faiss_module().extract_index_ivf(index)
