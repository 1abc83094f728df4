"""The Triton ensemble called with its tensors in system shared memory (`bench triton --shm`).

The issue's lever "shared-memory transport between sidecar and Triton", measured rather than
built into the sidecar first: the same request as TritonBackend.embed, but the ids go into a
shared-memory region registered with Triton and the embedding comes back through it, so the gRPC
messages carry region references instead of tensor bytes. Local Triton only (one host).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from inference.backends.triton import ID_TYPES, OUTPUT, map_error, wire_inputs
from inference.errors import Internal, InvalidInput
from inference.manifest import Manifest
from inference.tokenizer import TokenBatch
from inference.triton.names import served_names


class SharedMemoryCaller:
    """One region for inputs then output, sized for batches up to `max_rows` x `max_tokens`;
    one call at a time (the bench's single queries)."""

    def __init__(self, url: str, manifest: Manifest, *, max_rows: int = 32, max_tokens: int = 256,
                 variant: str | None = None, timeout_s: float = 10.0) -> None:
        self.url = url
        self.manifest = manifest
        self.timeout_s = timeout_s
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.model_name = served_names(manifest, variant).ensemble  # the version this caller serves
        self.name = f"embedcar-bench-{os.getpid()}"
        self._input_bytes = max_rows * max_tokens * 8 * len(manifest.inputs)  # int64 at most
        self._size = self._input_bytes + max_rows * manifest.dim * 4
        self._types: dict[str, Any] = {}
        self._handle: Any = None
        self._channel: Any = None
        self._stub: Any = None

    async def start(self) -> None:
        import grpc
        import tritonclient.utils.shared_memory as shm
        from tritonclient.grpc import service_pb2 as pb
        from tritonclient.grpc import service_pb2_grpc

        self._channel = grpc.aio.insecure_channel(self.url)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        try:
            meta = await self._stub.ModelMetadata(pb.ModelMetadataRequest(name=self.model_name), timeout=self.timeout_s)
            self._types = {i.name: ID_TYPES.get(i.datatype, np.int64) for i in meta.inputs}
            self._handle = shm.create_shared_memory_region(self.name, f"/{self.name}", self._size)
            await self._stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
                name=self.name, key=f"/{self.name}", offset=0, byte_size=self._size), timeout=self.timeout_s)
        except Exception as exc:
            await self.close()
            raise map_error(exc, self.url) from exc

    async def embed(self, batch: TokenBatch) -> np.ndarray:
        import tritonclient.utils.shared_memory as shm
        from tritonclient.grpc import service_pb2 as pb

        b, n = batch.shape
        if b > self.max_rows or n > self.max_tokens:
            raise InvalidInput(f"batch {batch.shape} is over the region's {self.max_rows} x {self.max_tokens}")
        req = pb.ModelInferRequest(model_name=self.model_name)
        offset = 0
        for name, datatype, arr in wire_inputs(batch, self._types, self.model_name):
            shm.set_shared_memory_region(self._handle, [arr], offset=offset)
            t = req.inputs.add(name=name, datatype=datatype, shape=arr.shape)
            _place(t.parameters, self.name, arr.nbytes, offset)
            offset += arr.nbytes
        out_bytes = b * self.manifest.dim * 4
        _place(req.outputs.add(name=OUTPUT).parameters, self.name, out_bytes, self._input_bytes)
        try:
            reply = await self._stub.ModelInfer(req, timeout=self.timeout_s)
        except Exception as exc:
            raise map_error(exc, self.url) from exc
        if not reply.outputs or list(reply.outputs[0].shape) != [b, self.manifest.dim]:
            raise Internal(f"Triton returned {reply.outputs[0].shape if reply.outputs else None}")
        out: np.ndarray = shm.get_contents_as_numpy(self._handle, np.float32, (b, self.manifest.dim),
                                                    offset=self._input_bytes).copy()
        return out

    async def close(self) -> None:
        import tritonclient.utils.shared_memory as shm
        from tritonclient.grpc import service_pb2 as pb

        if self._stub is not None and self._handle is not None:
            # The server may be gone already; the region is ours to remove anyway.
            with contextlib.suppress(Exception):
                await self._stub.SystemSharedMemoryUnregister(
                    pb.SystemSharedMemoryUnregisterRequest(name=self.name), timeout=self.timeout_s)
        if self._handle is not None:
            handle, self._handle = self._handle, None
            shm.destroy_shared_memory_region(handle)
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()


def _place(params: Any, region: str, nbytes: int, offset: int) -> None:
    params["shared_memory_region"].string_param = region
    params["shared_memory_byte_size"].int64_param = nbytes
    params["shared_memory_offset"].int64_param = offset
