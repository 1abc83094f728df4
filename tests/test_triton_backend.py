"""TritonBackend's endpoint handling against small real gRPC servers speaking Triton's protocol.

No tritonserver is needed: `FakeTriton` implements the four calls the backend makes (ModelReady,
ModelMetadata, ModelConfig, ModelInfer) on a real grpc.aio server on a free loopback port, and can be
told to refuse inference with its own message, or be stopped (a dead URL).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from inference.backends.triton import OUTPUT, TritonBackend
from inference.errors import FailedPrecondition, Unavailable
from inference.manifest import Manifest
from inference.tokenizer import TokenBatch
from inference.triton.repository import VARIANT_ID_PARAM


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.refuse: str | None = None  # ModelInfer answers UNAVAILABLE with this message
        self.server: grpc.aio.Server | None = None
        self.url = ""
        self.infers = 0
        self.variant_id = ""  # the ensemble's variant_id parameter (a generated repository's); "" = none

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
        if self.variant_id:
            reply.config.parameters[VARIANT_ID_PARAM].string_value = self.variant_id
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


async def test_one_endpoint_failing_is_steered_around_without_an_error(
        fakes: tuple[FakeTriton, FakeTriton], manifest: Manifest) -> None:
    a, b = fakes
    backend = TritonBackend([a.url, b.url], manifest, timeout_s=5.0, probe_interval_s=60.0)
    await backend.start()
    try:
        a.refuse = "fake A is draining"
        for _ in range(4):
            assert (await backend.embed(_batch())).shape == (1, manifest.dim)
        assert backend.ready() and b.infers >= 4
    finally:
        await backend.close()


async def test_a_triton_serving_another_variant_is_refused_at_start(
        fakes: tuple[FakeTriton, FakeTriton], manifest: Manifest) -> None:
    """Its embeddings would not match the sidecar's cache keys or the index of its own variant."""
    a, _ = fakes
    a.variant_id = manifest.variant_id("fp32")
    backend = TritonBackend([a.url], manifest, variant="int8", timeout_s=5.0, probe_interval_s=60.0)
    try:
        with pytest.raises(FailedPrecondition, match=r"serves .*/fp32.*configured for .*/int8.*EMBEDCAR_MODEL_VARIANT"):
            await backend.start()
        assert not backend.ready() and a.infers == 0
    finally:
        await backend.close()
    same = TritonBackend([a.url], manifest, variant="fp32", timeout_s=5.0, probe_interval_s=60.0)
    try:
        await same.start()
        assert same.ready()
    finally:
        await same.close()
