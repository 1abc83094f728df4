"""The compiled load generator (loadtest/native.py, loadtest/native/loadgen.cc) against real sidecars.

It needs g++ and gRPC's C++ library (`make test` installs Debian's libgrpc++-dev when it can);
without them the tests that send skip and say why.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from embedcar_settings import Settings
from inference import native_cache
from inference.backends.onnx import OnnxBackend
from inference.cli_main import main as cli_main
from inference.errors import DeadlineExceeded, InvalidInput, Unauthenticated, Unavailable
from inference.ports import free_port
from inference.tokenizer import QueryTokenizer
from loadtest.native import NativeTarget, build_loadgen
from loadtest.queries import query_stream
from loadtest.report import summarize
from loadtest.runner import OK, RunConfig, RunResult, run_load
from loadtest.stack import TargetSpec
from loadtest.targets import HttpEmbedTarget, SidecarEmbedTarget, SidecarSearchTarget, SidecarStreamTarget
from sidecar.app import SidecarThread
from tests.components import require_native
from tests.fixtures_sidecar import sidecar_settings

CONFIG = RunConfig(rate=20, duration_s=1.5, warmup_s=0.5, deadline_ms=30_000)  # 40 requests, 30 measured
KEY = "native-generator-test-key"


@pytest.fixture(scope="module")
def loadgen() -> Path:
    require_native()
    return build_loadgen()


def _seed(base: int, cls: type) -> int:
    """Queries of their own per test and target: the session sidecar caches what it embedded."""
    return base * 10 + (cls is SidecarStreamTarget)


async def _run(target: NativeTarget, texts: list[str], config: RunConfig = CONFIG) -> RunResult:
    await target.start()
    try:
        return await run_load(target, texts, config)
    finally:
        await target.close()


def _check_complete(result: RunResult, config: RunConfig = CONFIG) -> None:
    """Every scheduled request has one record, warm-up flagged, latencies from the schedule."""
    assert len(result.samples) == config.requests
    assert [s.index for s in result.samples] == list(range(config.requests))
    assert sum(s.warmup for s in result.samples) == round(config.rate * config.warmup_s)
    assert all(s.latency_s >= s.send_lag_s >= 0 for s in result.samples)
    last_due = (config.requests - 1) / config.rate
    assert result.generator_cpu_s > 0 and result.wall_s >= last_due
    assert result.window_ns is not None and result.window_ns[1] > result.window_ns[0]


@pytest.mark.parametrize("cls", [SidecarEmbedTarget, SidecarStreamTarget])
async def test_embed_calls_sent_natively_are_answered_and_timed(loadgen: Path, sidecar_embedded: Any,
                                                               tokenizer: QueryTokenizer,
                                                               cls: type[SidecarEmbedTarget]) -> None:
    texts = query_stream(tokenizer, CONFIG.requests, seed=_seed(21, cls), unique=True)
    target = NativeTarget(cls(sidecar_embedded.grpc_target))
    result = await _run(target, texts)
    _check_complete(result)
    assert all(s.code == OK for s in result.samples), result.errors_seen
    summary = summarize(result, name="native", sla_ms=30_000)
    assert summary["target"]["client"] == "native" and summary["target"]["target"] == cls.name
    assert summary["target"]["model"]  # read from the replies
    assert {"tokenize", "inference", "total"} <= set(summary["stages_ms"])
    for s in result.samples:  # each reply went to its own request: never faster than the server's own time
        assert s.timings_ns is not None and s.latency_s * 1e9 >= s.timings_ns["total"] > 0
        assert s.timings_ns["inference"] > 0  # computed, not from the session sidecar's cache


async def test_search_calls_sent_natively(loadgen: Path, tokenizer: QueryTokenizer, settings: Settings,
                                          grocery_index_root: Path) -> None:
    with SidecarThread(sidecar_settings(settings, index_dir=grocery_index_root)) as sc:
        texts = query_stream(tokenizer, CONFIG.requests, seed=22, unique=True)
        result = await _run(NativeTarget(SidecarSearchTarget(sc.grpc_target, k=5)), texts)
    _check_complete(result)
    assert all(s.code == OK for s in result.samples), result.errors_seen
    assert all(s.timings_ns and s.timings_ns["search"] > 0 for s in result.samples)


@pytest.fixture(scope="module")
def keyed_sidecar(settings: Settings, onnx_backend: OnnxBackend) -> Iterator[Any]:
    with SidecarThread(sidecar_settings(settings, api_keys=f"shop={KEY}"), backend=onnx_backend) as sc:
        yield sc


@pytest.mark.parametrize("cls", [SidecarEmbedTarget, SidecarStreamTarget])
async def test_the_api_key_reaches_the_sidecar_and_failures_keep_their_codes(
        loadgen: Path, keyed_sidecar: Any, tokenizer: QueryTokenizer, cls: type[SidecarEmbedTarget]) -> None:
    texts = query_stream(tokenizer, 8, seed=23, unique=True)
    long_text = "x" * 100_000  # over the sidecar's text limit: INVALID_ARGUMENT
    config = RunConfig(rate=20, duration_s=1.0, warmup_s=0.0, deadline_ms=30_000)
    ok = await _run(NativeTarget(cls(keyed_sidecar.grpc_target, api_key=KEY)), [*texts[:4], long_text], config)
    _check_complete(ok, config)
    codes = [s.code for s in ok.samples]
    assert codes == [OK, OK, OK, OK, InvalidInput.code] * 4
    assert "characters" in ok.errors_seen[InvalidInput.code]
    denied = await _run(NativeTarget(cls(keyed_sidecar.grpc_target, api_key="wrong")), texts, config)
    assert {s.code for s in denied.samples} == {Unauthenticated.code}, denied.errors_seen


@pytest.mark.parametrize("cls", [SidecarEmbedTarget, SidecarStreamTarget])
async def test_a_deadline_shorter_than_the_model_fails_requests_without_losing_any(
        loadgen: Path, sidecar_embedded: Any, tokenizer: QueryTokenizer, cls: type[SidecarEmbedTarget]) -> None:
    config = RunConfig(rate=50, duration_s=0.6, warmup_s=0.0, deadline_ms=0.2)
    texts = query_stream(tokenizer, config.requests, seed=_seed(24, cls), unique=True)
    result = await _run(NativeTarget(cls(sidecar_embedded.grpc_target)), texts, config)
    assert len(result.samples) == config.requests
    codes = {s.code for s in result.samples}
    assert DeadlineExceeded.code in codes and codes <= {OK, DeadlineExceeded.code}, result.errors_seen


@pytest.mark.parametrize("cls", [SidecarEmbedTarget, SidecarStreamTarget])
async def test_the_concurrency_cap_holds_requests_back_and_counts_the_wait(
        loadgen: Path, sidecar_embedded: Any, tokenizer: QueryTokenizer, cls: type[SidecarEmbedTarget]) -> None:
    # One in flight at a time, sent faster than one forward pass: each waits for the one before.
    config = RunConfig(rate=1000, duration_s=0.03, warmup_s=0.0, deadline_ms=30_000, concurrency=1)
    texts = query_stream(tokenizer, config.requests, seed=_seed(25, cls), unique=True)
    result = await _run(NativeTarget(cls(sidecar_embedded.grpc_target)), texts, config)
    assert all(s.code == OK for s in result.samples), result.errors_seen
    by_send = sorted(result.samples, key=lambda s: s.scheduled_s + s.send_lag_s)
    for before, after in itertools.pairwise(by_send):  # never two in flight
        assert after.scheduled_s + after.send_lag_s >= before.scheduled_s + before.latency_s - 1e-4
    assert result.samples[-1].send_lag_s > 0.005


async def test_an_unreachable_sidecar_is_unavailable(loadgen: Path) -> None:
    target = NativeTarget(SidecarEmbedTarget(f"127.0.0.1:{free_port()}"))
    config = RunConfig(rate=10, duration_s=0.2, warmup_s=0.0)
    with pytest.raises(Unavailable, match="did not start"):
        await _run(target, ["oat milk"], config)


def test_the_cli_runs_a_native_target(loadgen: Path, sidecar_embedded: Any, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["loadtest", "--target", "sidecar-stream+native", "--sidecar", sidecar_embedded.grpc_target,
                   "--rate", "20", "--duration", "1", "--warmup", "0.3", "--no-cache", "--deadline-ms", "30000",
                   "--sla-ms", "30000", "--out", str(tmp_path), "--name", "n"])
    assert rc == 0, capsys.readouterr().out
    summary = json.loads((tmp_path / "n.json").read_text())
    assert summary["target"]["client"] == "native" and summary["ok"] == summary["requests"] == 20


def test_target_specs_name_the_client() -> None:
    spec = TargetSpec.parse("sidecar-stream:embedded+native")
    assert (spec.target, spec.backend, spec.client, spec.label) == (
        "sidecar-stream", "embedded", "native", "sidecar-stream:embedded+native")
    assert TargetSpec.parse("sidecar-embed").client == "python"
    for bad in ("http+native", "sidecar-stream@2+native", "sidecar-embed+rust", "inprocess+native"):
        with pytest.raises(InvalidInput):
            TargetSpec.parse(bad)
    with pytest.raises(InvalidInput, match="native client"):
        NativeTarget.wrap(HttpEmbedTarget("http://127.0.0.1:1"))


def test_a_build_without_a_compiler_says_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ on it
    monkeypatch.setattr(native_cache, "BUILT", {})  # nothing built yet in this process
    with pytest.raises(Unavailable, match="libgrpc\\+\\+-dev"):
        build_loadgen(tmp_path / "build")
    assert not list((tmp_path).glob("build/*"))
