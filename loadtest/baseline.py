"""The naive first-prototype stack, kept as a baseline to compare against.

A FastAPI app that, per request, tokenizes with padding to the model's max length (256), runs the
same ONNX model, mean-pools and answers in the OpenAI embeddings shape: no batching across
requests, no length buckets, no cache. Run it as its own process (`python -m loadtest.baseline`,
or `BaselineServer` from code) so it never shares the load generator's event loop.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np
from pydantic import BaseModel

from inference.errors import InvalidInput, Unavailable
from inference.head import Head
from inference.lifecycle import terminate
from inference.manifest import load_manifest
from inference.ports import free_port


class EmbeddingRequest(BaseModel):
    """The OpenAI embeddings request (module level: FastAPI resolves the annotation by name)."""

    input: str | list[str]
    model: str | None = None


def create_app(model_dir: Path, *, variant: str = "fp32", threads: int = 0) -> Any:
    from fastapi import FastAPI, HTTPException
    from tokenizers import Tokenizer

    from inference.runtimes import open_graph

    manifest = load_manifest(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.enable_truncation(max_length=manifest.max_length)
    # The prototype's mistake on purpose: every text padded to the model maximum.
    tok.enable_padding(length=manifest.max_length, pad_id=manifest.pad_id)
    graph = open_graph(model_dir / manifest.variant(variant).file, manifest.variant(variant).precision, threads)
    model_id = manifest.variant_id(variant)
    head = Head.from_manifest(model_dir, manifest)

    app = FastAPI(title="embedcar naive baseline")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "model": model_id}

    @app.post("/v1/embeddings")
    def embeddings(req: EmbeddingRequest) -> dict[str, Any]:
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts or any(not t.strip() for t in texts):
            raise HTTPException(status_code=400, detail="input must be non-empty strings")
        encs = tok.encode_batch(texts)
        ids = np.array([e.ids for e in encs], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encs], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        hidden = graph.hidden({k: v for k, v in feed.items() if k in graph.inputs})
        emb = head(np.asarray(hidden), mask, input_ids=ids)
        n_tokens = int(mask.sum())
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": row.tolist()} for i, row in enumerate(emb)],
            "model": model_id,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }

    return app


class BaselineServer:
    """The baseline as a subprocess on 127.0.0.1 and a free port (sync context manager)."""

    def __init__(self, model_dir: Path, *, variant: str = "fp32", threads: int = 0, port: int | None = None,
                 startup_timeout_s: float = 120.0, log_file: Path | None = None) -> None:
        self.model_dir = model_dir
        self.variant = variant
        self.threads = threads
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.log_file = log_file
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        import httpx

        cmd = [sys.executable, "-m", "loadtest.baseline", "--model-dir", str(self.model_dir),
               "--variant", self.variant, "--threads", str(self.threads), "--port", str(self.port)]
        out = self.log_file.open("ab") if self.log_file else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        finally:
            if self.log_file:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise Unavailable(f"baseline server exited with {self._proc.returncode} (command: {' '.join(cmd)})")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise Unavailable(f"baseline server not ready within {self.startup_timeout_s:g} s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            terminate(proc, 10)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.baseline", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=Path("models/all-MiniLM-L6-v2"))
    p.add_argument("--variant", default="fp32")
    p.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0 = all cores)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    args = p.parse_args(argv)
    if args.port <= 0:
        raise InvalidInput("--port must be a real port (BaselineServer picks a free one for you)")
    import uvicorn

    uvicorn.run(create_app(args.model_dir, variant=args.variant, threads=args.threads), host=args.host,
                port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
