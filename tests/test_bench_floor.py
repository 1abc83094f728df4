"""The do-nothing Embedder server the sidecar bench compares cache hits with (loadtest/bench/floor.py)."""

from __future__ import annotations

import numpy as np

from embedcar_client.client import Client
from loadtest.bench.floor import floor_process
from loadtest.bench.sidecar import bench_hits_alternating


def test_floor_server_answers_embed_with_a_fixed_unit_vector() -> None:
    with floor_process(8) as target:
        with Client(target) as c:
            r = c.embed(["anything at all"])
        assert r.embeddings.shape == (1, 8) and r.model == "floor" and r.cache_hits == [True]
        assert np.isclose(float(np.linalg.norm(r.embeddings[0])), 1.0, atol=1e-6)
        stats = bench_hits_alternating({"a": target, "b": target}, "x", 20, block=10)
        assert set(stats) == {"a", "b"} and all(s["n"] == 20 and s["median_ms"] > 0 for s in stats.values())
