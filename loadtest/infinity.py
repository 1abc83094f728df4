"""Infinity (infinity-emb 0.0.78) serving our ONNX file, for `embedcar bench serving` and the load test.

Infinity is the off-the-shelf comparison: a FastAPI server with its own dynamic batching over
ONNX Runtime through optimum. It lives in its own venv (`make infinity`: var/infinity-venv, with
a CPU torch), never in ours. `InfinityServer` prepares a model folder per variant under
var/infinity/ (config.json and tokenizer.json copied from the prepared model, model.onnx a
symlink to the variant's file), starts `infinity_emb v2` there and waits for GET /health.

Infinity 0.0.78 with optimum finds a local ONNX file only when the model id is "." (an absolute
id fails with "Could not find any ONNX files with target file name"), so the server runs with
its cwd in that folder. Its embeddings route is POST /embeddings with {"input": [...], "model":
<served name>}. The on-disk vector cache is off (every benchmark query is new anyway: a cache
would only add its writes); the folder's tokenizer_config.json gives the tokenizer the model's
max length, which tokenizer.json alone does not carry.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from inference.errors import ModelError, Unavailable
from inference.files import atomic_write_text
from inference.lifecycle import terminate
from inference.manifest import load_manifest
from inference.ports import free_port

log = logging.getLogger(__name__)

VERSION = "0.0.78"
DEFAULT_EXE = Path("var/infinity-venv/bin/infinity_emb")
WORK_ROOT = Path("var/infinity")
INSTALL_HINT = "make infinity"


def infinity_unavailable_reason(exe: Path) -> str | None:
    """None when `exe` can be started; else a short reason for a report row."""
    if not exe.exists():
        return f"not installed: {INSTALL_HINT}"
    if not os.access(exe, os.X_OK):
        return f"{exe} is not executable: {INSTALL_HINT}"
    return None


def prepare_folder(model_dir: Path, variant: str, work_root: Path = WORK_ROOT) -> Path:
    """var/infinity/<model>-<variant>/ with config.json, tokenizer.json, tokenizer_config.json and
    model.onnx -> the variant's file (per the manifest). Idempotent; returns the folder."""
    manifest = load_manifest(model_dir)
    source = (model_dir / manifest.variant(variant).file).resolve()
    if not source.exists():
        raise ModelError(f"{source} is missing: run `embedcar model prepare`")
    folder = work_root / f"{model_dir.name}-{variant}"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(model_dir / name, folder / name)
    atomic_write_text(folder / "tokenizer_config.json", json.dumps({"model_max_length": manifest.max_length}) + "\n")
    link = folder / "model.onnx"
    tmp = folder / ".model.onnx.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(source)
    tmp.replace(link)  # a rename: the link is never missing or pointing at the old variant halfway
    return folder


class InfinityServer:
    """`with InfinityServer(model_dir, "fp32") as s:` -> Infinity answering at `s.url`."""

    def __init__(self, model_dir: Path, variant: str, *, exe: Path = DEFAULT_EXE, port: int | None = None,
                 batch_size: int = 32, log_file: Path | None = None, work_root: Path = WORK_ROOT,
                 served_name: str | None = None, startup_timeout_s: float = 120.0) -> None:
        self.model_dir = model_dir
        self.variant = variant
        self.exe = exe
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.batch_size = batch_size
        self.work_root = work_root
        self.log_file = log_file or work_root / f"infinity-{variant}-{self.port}.log"
        self.served_name = served_name or f"{model_dir.name}-{variant}"
        self.startup_timeout_s = startup_timeout_s
        self.folder: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        return [
            str(self.exe.absolute()), "v2", "--model-id", ".", "--served-model-name", self.served_name,
            "--engine", "optimum", "--pooling-method", "mean", "--onnx-disable-optimize", "--device", "cpu",
            "--batch-size", str(self.batch_size), "--no-vector-disk-cache", "--log-level", "warning",
            "--host", self.host, "--port", str(self.port),
        ]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        # Local files only, no telemetry: the benchmark machine may have no network at all.
        env.update({"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"})
        return env

    def start(self) -> Self:
        reason = infinity_unavailable_reason(self.exe)
        if reason:
            raise Unavailable(f"Infinity: {reason}")
        self.folder = prepare_folder(self.model_dir, self.variant, self.work_root)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        out: IO[bytes] = self.log_file.open("ab")
        self._log_offset = out.tell()
        log.info("starting Infinity %s on %s (%s, log %s)", VERSION, self.url, self.variant, self.log_file)
        try:
            # cwd = the prepared folder: the model id "." is the only one optimum finds a local ONNX file by.
            self._proc = subprocess.Popen(self.command(), cwd=self.folder, env=self._env(), stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise Unavailable(f"Infinity exited during start-up (code {code}); last log lines:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.25)
        raise Unavailable(f"Infinity not ready within {self.startup_timeout_s:g} s; last log lines:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            with self.log_file.open("rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            terminate(proc, 30)  # SIGTERM: uvicorn shuts down; SIGKILL after 30 s

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
