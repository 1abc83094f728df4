"""A build's checkpoints: one .npy file per finished chunk plus a progress file, under
`<index root>/.work/<fingerprint>/`, each written atomically.

The progress file is written after the chunk file, and a chunk counts only when both say so, so
a build killed at any instant resumes from exactly the chunks it finished.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inference.errors import ModelError
from inference.files import atomic_write, atomic_write_text

F32 = npt.NDArray[np.float32]
WORK_DIR = ".work"
PROGRESS_FILE = "progress.json"
SCRATCH_FILE = "vectors.scratch.npy"


class Checkpoints:
    """The chunk files and progress of the build named by `fingerprint` under `index_root`."""

    def __init__(self, index_root: Path, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.dir = index_root / WORK_DIR / fingerprint[:24]
        self.lock_path = self.dir.with_name(f"{self.dir.name}.lock")  # beside the folder: it outlives resets
        self.n_chunks = 0

    def resume(self, n_chunks: int) -> set[int]:
        """The chunks already done; a folder left by another input (or none) starts empty."""
        self.n_chunks = n_chunks
        try:
            data: dict[str, Any] = json.loads((self.dir / PROGRESS_FILE).read_text())
        except (FileNotFoundError, ValueError):
            data = {}
        if data.get("fingerprint") != self.fingerprint or data.get("chunks") != n_chunks:
            if self.dir.exists():
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
            return set()
        return {int(k) for k in data.get("done", []) if self._chunk_path(int(k)).exists()}

    def read(self, k: int, shape: tuple[int, int]) -> F32:
        arr: F32 = np.load(self._chunk_path(k))
        if arr.shape != shape:
            raise ModelError(f"checkpoint {self._chunk_path(k)} has shape {arr.shape}, expected {shape}")
        return arr

    def write(self, k: int, emb: F32, done: set[int]) -> None:
        """Chunk k's vectors, then the progress file listing `done` (which includes k)."""
        atomic_write(self._chunk_path(k), lambda f: np.save(f, emb))
        self.save_progress(done)

    def save_progress(self, done: set[int]) -> None:
        atomic_write_text(self.dir / PROGRESS_FILE, json.dumps(
            {"fingerprint": self.fingerprint, "chunks": self.n_chunks, "done": sorted(done)}))

    def scratch(self, shape: tuple[int, int]) -> F32:
        """A memory-mapped float32 array in this build's folder (not a checkpoint: rebuilt from the
        chunk files on every run, removed with them by `discard`)."""
        out: F32 = np.lib.format.open_memmap(self.dir / SCRATCH_FILE, mode="w+", dtype=np.float32, shape=shape)
        return out

    def discard(self) -> None:
        """After publishing: the checkpoints have done their job."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.lock_path.unlink(missing_ok=True)

    def _chunk_path(self, k: int) -> Path:
        return self.dir / f"chunk-{k:06d}.npy"
