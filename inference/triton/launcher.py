"""Run the real tritonserver from the nvidia-pytriton wheel on this machine (no Docker needed).

`TritonServer` assembles a backend directory (the wheel's Python backend + the stub for this
Python), generates the CPU model repository, starts tritonserver in its own process group on
loopback, waits for readiness and warms every bucket. `stop()` ends the whole group, so no
backend stub outlives the server; `kill()` is SIGKILL for fault tests.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import numpy as np

from inference.errors import ModelError, Unavailable
from inference.manifest import Manifest, load_manifest
from inference.settings import Settings
from inference.triton.repository import ENSEMBLE, generate_repository, stub_sys_path

log = logging.getLogger(__name__)

MIN_GLIBC = (2, 35)


def pytriton_root() -> Path | None:
    """The wheel's tritonserver folder, found without importing pytriton (installed --no-deps)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


def _libs_dir(root: Path) -> Path:
    return root.parent.parent / "nvidia_pytriton.libs"


def _stub(root: Path) -> Path:
    return root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / \
        "triton_python_backend_stub"


def triton_unavailable_reason() -> str | None:
    """None when the wheel's tritonserver can run here; else one line saying why not."""
    hint = "use the embedded backend (EMBEDCAR_SIDECAR_BACKEND=embedded)"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        here = f"{sys.platform} {platform.machine()}"
        return f"tritonserver from nvidia-pytriton needs Linux x86_64, this is {here}: {hint}"
    libc, ver = platform.libc_ver()
    try:
        parsed = tuple(int(x) for x in ver.split(".")[:2])
    except ValueError:
        parsed = (0, 0)
    if libc != "glibc" or parsed < MIN_GLIBC:
        return f"tritonserver needs glibc >= 2.35, found {libc or 'none'} {ver or '?'}: {hint}"
    root = pytriton_root()
    if root is None or not (root / "bin" / "tritonserver").exists():
        return f"the nvidia-pytriton wheel (tritonserver binary) is not installed: {hint}"
    if not _stub(root).exists():
        return f"nvidia-pytriton has no Python backend stub for Python {platform.python_version()}: {hint}"
    return _binary_runs(root, hint)


@functools.cache
def _binary_runs(root: Path, hint: str) -> str | None:
    """Ask the binary for its usage text: catches missing shared libraries and a foreign libc."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(_libs_dir(root))}
    try:
        out = subprocess.run([str(root / "bin" / "tritonserver"), "--help"], capture_output=True, text=True,
                             env=env, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"tritonserver cannot run here ({exc}): {hint}"
    text = out.stdout + out.stderr
    if "Usage: tritonserver" not in text:
        first = next((line for line in text.splitlines() if line.strip()), f"exit status {out.returncode}")
        return f"tritonserver cannot run here ({first.strip()}): {hint}"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def assemble_backend_dir(dest: Path) -> Path:
    """<dest>/python/{libtriton_python.so, triton_python_backend_utils.py, triton_python_backend_stub}.

    The Python backend looks for its stub next to libtriton_python.so; the wheel keeps the stubs
    elsewhere (one per Python version), hence this folder.
    """
    root = pytriton_root()
    if root is None:
        raise Unavailable("nvidia-pytriton is not installed")
    src = root / "backends" / "python"
    out = dest.resolve() / "python"
    out.mkdir(parents=True, exist_ok=True)
    for f in (src / "libtriton_python.so", src / "triton_python_backend_utils.py", _stub(root)):
        target = out / f.name
        if target.exists() and target.stat().st_size == f.stat().st_size:
            continue
        tmp = out / f".{f.name}.{os.getpid()}"
        shutil.copy2(f, tmp)
        tmp.replace(target)  # atomic: a concurrent start sees the old or the new file
    return dest.resolve()


class TritonServer:
    """`with TritonServer(settings) as t:` -> a ready tritonserver at `t.grpc_url`."""

    def __init__(self, settings: Settings, *, variant: str | None = None, grpc_port: int | None = None,
                 http_port: int | None = None, metrics_port: int | None = None,
                 log_file: Path | None = None, extra_args: Sequence[str] = ()) -> None:
        self.settings = settings
        self.extra_args = list(extra_args)  # more tritonserver flags, e.g. tracing for a benchmark
        self.variant = variant or settings.model.variant
        self.host = settings.triton.host
        self.grpc_port = grpc_port or free_port(self.host)
        self.http_port = http_port or free_port(self.host)
        self.metrics_port = metrics_port or free_port(self.host)
        self.log_file = log_file or settings.triton.repo_dir.parent / f"tritonserver-{self.grpc_port}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        # Unique per server: several tritonservers on one machine must not share /dev/shm regions.
        self._shm_prefix = f"embedcar_{os.getpid()}_{self.grpc_port}_"
        self.repo: Path | None = None

    # --- addresses -------------------------------------------------------------------------
    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # --- lifecycle -------------------------------------------------------------------------
    def command(self) -> list[str]:
        t = self.settings.triton
        root = pytriton_root()
        assert root is not None and self.repo is not None
        mib = 1024 * 1024
        return [
            str(root / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            f"--backend-directory={assemble_backend_dir(t.backend_dir)}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            f"--backend-config=python,shm-default-byte-size={t.shm_default_mb * mib}",
            f"--backend-config=python,shm-growth-byte-size={t.shm_growth_mb * mib}",
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            "--strict-readiness=true", "--exit-timeout-secs=5", "--log-verbose=0",
            *self.extra_args,
        ]

    def _env(self) -> dict[str, str]:
        root = pytriton_root()
        assert root is not None
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(_libs_dir(root)), env.get("LD_LIBRARY_PATH")) if p)
        # The stub embeds the system Python; it needs numpy (for the backend utils) before model.py runs.
        env["PYTHONPATH"] = os.pathsep.join(stub_sys_path())
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        return env

    def start(self) -> Self:
        reason = triton_unavailable_reason()
        if reason:
            raise Unavailable(reason)
        if self.running():
            return self
        model_dir = self.settings.model.model_dir
        manifest = load_manifest(model_dir)
        # One folder per variant: servers of different variants may start side by side from one checkout.
        repo_dir = self.settings.triton.repo_dir
        self.repo = generate_repository(self.settings, manifest, model_dir, target="cpu", variant=self.variant,
                                        out_dir=repo_dir.with_name(f"{repo_dir.name}-cpu-{self.variant}"))
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_file.open("ab")
        log.info("starting tritonserver on %s (log %s)", self.grpc_url, self.log_file)
        self._proc = subprocess.Popen(self.command(), env=self._env(), stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(self.settings.triton.startup_timeout_s)
            self.warm_up(manifest)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise Unavailable(f"tritonserver exited during start-up; last log lines:\n{self.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, OSError), \
                    urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == 200:
                    return
            time.sleep(0.1)
        raise Unavailable(f"tritonserver not ready after {timeout_s:.0f} s; last log lines:\n{self.log_tail()}")

    def warm_up(self, manifest: Manifest | None = None) -> None:
        """One request per bucket (batch 1 and 2): ORT and the stubs set up each shape before traffic."""
        import tritonclient.grpc as grpcclient

        m = manifest or load_manifest(self.settings.model.model_dir)
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            for n in m.buckets:
                for b in (1, 2):
                    ids = np.full((b, n), m.pad_id, dtype=np.int32)
                    ids[:, 0] = m.special_ids[0] if m.special_ids else 1
                    inputs = []
                    for name in m.inputs:
                        arr = ids if name == "input_ids" else (
                            np.ones_like(ids) if name == "attention_mask" else np.zeros_like(ids))
                        inp = grpcclient.InferInput(name, list(arr.shape), "INT32")
                        inp.set_data_from_numpy(arr)
                        inputs.append(inp)
                    client.infer(ENSEMBLE, inputs, client_timeout=60.0)
        except Exception as exc:
            raise ModelError(f"Triton warm-up failed: {exc}; log tail:\n{self.log_tail()}") from exc
        finally:
            client.close()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (Triton unloads models and ends its stubs), then SIGKILL whatever is left in the group."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("tritonserver ignored SIGTERM for %.0f s; killing it", timeout_s)
            self._kill_group(proc)
        self._cleanup()

    def kill(self) -> None:
        """SIGKILL the server and its stubs at once (fault tests)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            self._kill_group(proc)
        self._cleanup()

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        # The stubs are the server's children: wait until the kernel has taken them all away.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)
        log.warning("processes of tritonserver group %d still present after SIGKILL", proc.pid)

    def _cleanup(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        # A killed stub leaves its shared-memory regions behind.
        for f in Path("/dev/shm").glob(f"{self._shm_prefix}*"):
            f.unlink(missing_ok=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
