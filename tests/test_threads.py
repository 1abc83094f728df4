"""The embedded backend's ORT threads: on the query path (threads 0, one lane) a typical query is
timed on one thread and on every core at load, and every core is kept only where it pays; batch
jobs and explicit settings get what they ask for."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from inference.backends.factory import make_backend
from inference.backends.onnx import MORE_THREADS_MIN_GAIN, OnnxBackend
from inference.settings import Settings


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host of two cores whatever this one has (the choice is between 1 and every core)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)


def _settings(model_dir: Path, **env: str) -> Settings:
    return Settings.load(environ={"EMBEDCAR_MODEL_MODELS_DIR": str(model_dir.parent),
                                  "EMBEDCAR_MODEL_NAME": model_dir.name, **env})


def test_query_path_keeps_every_core_only_where_it_is_faster(model_dir: Path, two_cores: None) -> None:
    backend = make_backend(_settings(model_dir), "embedded")
    assert isinstance(backend, OnnxBackend)
    backend.warm_up()
    t1, t2 = backend.thread_choice["1"], backend.thread_choice["2"]
    assert t1 > 0 and t2 > 0
    assert backend.threads == (2 if t2 <= (1 - MORE_THREADS_MIN_GAIN) * t1 else 1), backend.thread_choice
    # Whichever it kept, it computes what an explicit one-thread backend computes.
    pinned = make_backend(_settings(model_dir, EMBEDCAR_MODEL_INTRA_OP_THREADS="1"), "embedded")
    assert isinstance(pinned, OnnxBackend)
    pinned.warm_up()
    batch = backend._query(9)
    np.testing.assert_allclose(backend.embed_sync(batch), pinned.embed_sync(batch), rtol=0, atol=1e-5)


def test_batch_jobs_and_explicit_settings_are_not_measured(model_dir: Path, two_cores: None) -> None:
    job = make_backend(_settings(model_dir), "embedded", batch_job=True)
    explicit = make_backend(_settings(model_dir, EMBEDCAR_MODEL_INTRA_OP_THREADS="2"), "embedded")
    lanes = make_backend(_settings(model_dir, EMBEDCAR_MODEL_FORWARD_LANES="2"), "embedded")
    for backend, threads in ((job, 2), (explicit, 2), (lanes, 1)):
        assert isinstance(backend, OnnxBackend)
        backend.load()
        assert backend.threads == threads and backend.thread_choice == {}


def test_the_chosen_thread_count_is_the_one_session_served(model_dir: Path, two_cores: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OnnxBackend, "_one_thread_wins", lambda self, one, every: True)
    backend = make_backend(_settings(model_dir), "embedded")
    assert isinstance(backend, OnnxBackend)
    backend.load()
    assert backend.threads == 1
    monkeypatch.setattr(OnnxBackend, "_one_thread_wins", lambda self, one, every: False)
    kept = make_backend(_settings(model_dir), "embedded")
    assert isinstance(kept, OnnxBackend)
    kept.load()
    assert kept.threads == 2
