"""TritonBackend against small gRPC servers speaking Triton's protocol: every endpoint failing, each
in its own way; how often it probes.

A fake only for what a real tritonserver cannot be made to do here on demand: stay up and answer
UNAVAILABLE with a message of its own (a draining server), and count the readiness probes it gets.
Everything a real server can show runs against one in tests/test_triton_server.py (a dead URL steered
around, a server of another variant refused at start, kill and restart, deadlines). `FakeTriton`
implements the four calls the backend makes (ModelReady, ModelMetadata, ModelConfig, ModelInfer) on a
real grpc.aio server on a free loopback port.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from inference.backends.triton import OUTPUT, TritonBackend
from inference.errors import Unavailable
from inference.manifest import Manifest
from inference.tokenizer import TokenBatch


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.refuse: str | None = None  # ModelInfer answers UNAVAILABLE with this message
        self.server: grpc.aio.Server | None = None
        self.url = ""
        self.infers = 0
        self.probes = 0  # ModelReady calls

    async def start(self) -> None:
        self.server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.url = f"127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802 - the protocol's names
        self.probes += 1
        return pb.ModelReadyResponse(ready=True)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        reply = pb.ModelMetadataResponse(name=request.name, platform="ensemble")
        for name in self.manifest.inputs:
            reply.inputs.add(name=name, datatype="INT32", shape=[-1, -1])
        reply.outputs.add(name=OUTPUT, datatype="FP32", shape=[-1, self.manifest.dim])
        return reply

    async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        reply = pb.ModelConfigResponse()
        reply.config.name = request.name
        return reply

    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.infers += 1
        if self.refuse is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.refuse)
        rows = int(request.inputs[0].shape[0])
        reply = pb.ModelInferResponse(model_name=request.model_name)
        reply.outputs.add(name=OUTPUT, datatype="FP32", shape=[rows, self.manifest.dim])
        reply.raw_output_contents.append(np.zeros((rows, self.manifest.dim), "<f4").tobytes())
        return reply


@pytest.fixture
async def fakes(manifest: Manifest) -> AsyncIterator[tuple[FakeTriton, FakeTriton]]:
    a, b = FakeTriton(manifest), FakeTriton(manifest)
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


def _batch() -> TokenBatch:
    ids = np.full((1, 16), 1000, dtype=np.int64)
    return TokenBatch(ids, np.ones_like(ids), np.zeros_like(ids))


async def test_every_endpoint_failing_names_each_url_with_its_own_error(
        fakes: tuple[FakeTriton, FakeTriton], manifest: Manifest) -> None:
    a, b = fakes
    backend = TritonBackend([a.url, b.url], manifest, timeout_s=5.0, probe_interval_s=60.0)
    await backend.start()  # both answer: ready, metadata, warm-up
    try:
        a.refuse = "fake A is draining"
        dead = b.url
        await b.stop()  # b is now a dead URL: connection refused
        for _ in range(2):  # whichever endpoint the round-robin tries first
            with pytest.raises(Unavailable) as info:
                await backend.embed(_batch())
            msg = info.value.message
            assert f"Triton {a.url}: fake A is draining" in msg
            # The dead URL is named with its own (connection) error, not A's.
            named = re.search(rf"Triton {re.escape(dead)}: ([^;]*)", msg)
            assert named is not None, msg
            assert "draining" not in named.group(1) and named.group(1).strip()
        assert not backend.ready()  # both were marked down
    finally:
        await backend.close()


async def test_requests_stand_in_for_probes_while_they_flow_an_idle_url_is_probed(
        fakes: tuple[FakeTriton, FakeTriton], manifest: Manifest) -> None:
    a, _b = fakes
    backend = TritonBackend([a.url], manifest, timeout_s=5.0, probe_interval_s=0.1)
    await backend.start()
    loop = asyncio.get_running_loop()
    try:
        before, end = a.probes, loop.time() + 1.0
        while loop.time() < end:  # a request every ~20 ms: each round finds a fresh answer
            await backend.embed(_batch())
            await asyncio.sleep(0.02)
        busy = a.probes - before
        before = a.probes
        await asyncio.sleep(1.0)  # no traffic: probed every round again
        idle = a.probes - before
        assert idle >= 5, idle
        assert busy <= idle // 3, (busy, idle)
        assert backend.ready()
    finally:
        await backend.close()


