"""Pieces the fault scenarios share: a recording sidecar target, phases of open-loop load, RSS."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedcar_settings import Settings
from inference.embedder import load_tokenizer
from inference.errors import DeadlineExceeded
from inference.manifest import load_manifest
from inference.settings import TritonSettings
from loadtest.faults.result import ScenarioResult
from loadtest.queries import QueryMix
from loadtest.runner import OK, RunConfig, RunResult, Sample, run_load
from loadtest.targets import SidecarEmbedTarget, Target, Timings


class RecordingEmbedTarget(SidecarEmbedTarget):
    """Sidecar Embed that also counts which backend answered each request (EmbedReply.backend)."""

    def __init__(self, grpc_target: str, **kw: Any) -> None:
        super().__init__(grpc_target, **kw)
        self.answered: Counter[str] = Counter()

    async def call(self, texts: list[str], *, timeout_s: float) -> Timings | None:
        res = await self._client.embed(texts, timeout_s=timeout_s)
        self.observed(OK, "", res.backend)
        return dict(res.timings_ns)

    def observed(self, code: str, message: str, backend: str) -> None:
        if code == OK:
            self.answered[backend or "cache"] += 1


# Where a DEADLINE_EXCEEDED came from, by the sidecar's message: refused at admission (the request
# never took backend time), or expired after it was admitted; anything else expired client-side.
_REFUSED = ("deadline leaves", "expired before inference")


def deadline_kind(message: str) -> str:
    """Where a DEADLINE_EXCEEDED happened, by its message: refused_at_admission | expired_in_sidecar |
    expired_client_side."""
    if any(m in message for m in _REFUSED):
        return "refused_at_admission"
    return "expired_in_sidecar" if "expired" in message else "expired_client_side"


def fresh_queries(settings: Settings, n: int, seed: int) -> list[str]:
    """`n` distinct shopper queries (cache misses: the backend is exercised every time)."""
    m = settings.model
    tokenizer = load_tokenizer(m.model_dir, load_manifest(m.model_dir))
    return QueryMix(tokenizer, seed=seed, repeat_share=0.0, unique=True).take(n)


@dataclass(slots=True)
class Phase:
    """Outcome counts and latencies of one load run, in ms."""

    samples: list[Sample]
    codes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, result: RunResult) -> Phase:
        measured = result.measured
        return cls(measured, dict(Counter(s.code for s in measured)))

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def ok(self) -> int:
        return self.codes.get(OK, 0)

    @property
    def failed(self) -> int:
        return self.n - self.ok

    def latencies_ms(self, code: str = OK) -> np.ndarray:
        return np.array([s.latency_s * 1e3 for s in self.samples if s.code == code], dtype=np.float64)

    def deadline_kinds(self) -> Counter[str]:
        """This phase's DEADLINE_EXCEEDED outcomes by where they happened (deadline_kind)."""
        return Counter(deadline_kind(s.message) for s in self.samples if s.code == DeadlineExceeded.code)

    def pct(self, p: float, code: str = OK) -> float | None:
        lat = self.latencies_ms(code)
        return float(np.percentile(lat, p)) if len(lat) else None


async def load_during(target: Target, texts: Sequence[str], config: RunConfig,
                      *actions: tuple[float, Any]) -> tuple[RunResult, dict[str, float]]:
    """Run open-loop load; meanwhile call each blocking `action` (in a thread) `at` seconds after the
    measured window starts. Returns the run and, per action's __name__, when it returned (window time)."""
    done: dict[str, float] = {}
    start = time.perf_counter() + config.warmup_s

    async def act(at: float, fn: Any) -> None:
        await asyncio.sleep(max(start + at - time.perf_counter(), 0.0))
        await asyncio.to_thread(fn)
        done[getattr(fn, "__name__", repr(fn))] = time.perf_counter() - start

    tasks = [asyncio.create_task(act(at, fn)) for at, fn in actions]
    try:
        result = await run_load(target, texts, config)
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    return result, done


def rss_mb(pid: int | None, field: str = "VmRSS") -> float | None:
    """Resident set size of process `pid` in MiB (Linux /proc), None if it is gone; `field` another
    of its status lines in kB, e.g. RssAnon (anonymous memory only)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def check_no_key_material(res: ScenarioResult, t: TritonSettings, work: Path) -> None:
    """A hardened run: no Triton key or private key in any log the scenario's processes wrote under `work`
    (the sidecars' and tritonserver's), as the auth scenario checks for API keys."""
    from inference.triton.tls import secret_markers

    markers = secret_markers(t)
    if not markers:
        return
    logs = sorted(work.rglob("*.log"))
    leaked = [p.name for p in logs if any(m in p.read_text(errors="replace") for m in markers)]
    res.check("hardened Triton: key material in the run's logs", "0 files",
              f"{len(leaked)} of {len(logs)} files" + (f" ({', '.join(leaked)})" if leaked else ""),
              bool(logs) and not leaked)

