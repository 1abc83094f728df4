"""Run the real tritonserver from the nvidia-pytriton wheel on this machine (no Docker needed).

`TritonServer` assembles a backend directory (the wheel's Python backend + the stub for this
Python), generates the CPU model repository, starts tritonserver in its own process group on
loopback, waits for readiness and warms every bucket. `stop()` ends the whole group, so no
backend stub outlives the server; `kill()` is SIGKILL for fault tests.

It serves `settings.model` by default, or every model `models` names (each with `variant`, or its
own default variant), from one repository: each version under its own names (inference/triton/names.py).
`encoder="torch"` runs the models' PyTorch weights instead of ONNX Runtime, on the CPU or, with
`target="gpu"`, on this machine's GPUs: a GPU repository without TensorRT (a TensorRT one needs its
engines built first: the compose triton service).

Start-up is ready only when this process listens on its own ports and answers over HTTP and gRPC:
a port taken by someone else between choosing and binding (or a foreign server answering on it)
is a bind failure, retried on fresh ports when the ports were chosen here, named when given.

`triton.tls_dir` set (the hardened profile: a host other machines reach) adds inference/triton/tls.py's
flags: gRPC over mutual TLS, API groups behind header keys, HTTP on loopback, model control off; the
launcher's own readiness and warm-up calls then use TLS and the key like any client. tritonserver
takes those keys as arguments only: they reach it through the environment and a preloaded shim
(inference/triton/argv_secrets.py), so its command line (`ps`) shows placeholders; where the shim
cannot be built they go on the command line, with a warning saying why. Never logged.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import re
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
from typing import IO, Any, Self

import numpy as np

from inference.errors import InvalidInput, ModelError, Unavailable
from inference.grpc_io import for_other_grpc
from inference.manifest import Manifest, load_manifest
from inference.settings import Settings
from inference.triton import argv_secrets
from inference.triton.repository import RepoModel, encoder_kind, generate_models, stub_sys_path
from inference.triton.tls import ServerFlags, hardened, server_flags

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


def platform_unsupported() -> str | None:
    """None where the wheel's tritonserver is built to run (Linux x86_64, glibc >= 2.35); else why not."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"tritonserver from nvidia-pytriton needs Linux x86_64, this is {sys.platform} {platform.machine()}"
    libc, ver = platform.libc_ver()
    try:
        parsed = tuple(int(x) for x in ver.split(".")[:2])
    except ValueError:
        parsed = (0, 0)
    if libc != "glibc" or parsed < MIN_GLIBC:
        return f"tritonserver needs glibc >= {'.'.join(map(str, MIN_GLIBC))}, found {libc or 'none'} {ver or '?'}"
    return None


def triton_unavailable_reason() -> str | None:
    """None when the wheel's tritonserver can run here; else one line saying why not."""
    hint = "use the embedded backend (EMBEDCAR_SIDECAR_BACKEND=embedded)"
    unsupported = platform_unsupported()
    if unsupported is not None:
        return f"{unsupported}: {hint}"
    root = pytriton_root()
    if root is None or not (root / "bin" / "tritonserver").exists():
        return f"the nvidia-pytriton wheel (tritonserver binary) is not installed: {hint}"
    if not _stub(root).exists():
        return f"nvidia-pytriton has no Python backend stub for Python {platform.python_version()}: {hint}"
    return _binary_runs(root, hint)


@functools.cache
def _binary_runs(root: Path, hint: str) -> str | None:
    """Ask the binary for its usage text: catches missing shared libraries and a foreign libc."""
    env = {**for_other_grpc(os.environ), "LD_LIBRARY_PATH": str(_libs_dir(root))}
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


# --- who listens on a port (Linux /proc) -------------------------------------------------------
_WILDCARDS = {"0.0.0.0", "::"}


def _proc_ip(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # tcp6: four 32-bit words, each in host (little-endian) order
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening_sockets(port: int, host: str) -> set[int] | None:
    """Inodes of the TCP sockets listening on `port` at `host` or a wildcard; None where /proc has no table."""
    found: set[int] = set()
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not any(t.exists() for t in tables):
        return None
    wanted = {host, f"::ffff:{host}"} | _WILDCARDS
    for table in tables:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) < 10 or cols[3] != "0A":  # 0A = LISTEN
                    continue
                addr, _, hex_port = cols[1].partition(":")
                if int(hex_port, 16) == port and _proc_ip(addr) in wanted:
                    found.add(int(cols[9]))
    return found


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open."""
    out: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = str(fd.readlink())
                if target.startswith("socket:["):
                    out.add(int(target[8:-1]))
    return out


def socket_owners(inodes: set[int]) -> list[str]:
    """"pid N (name)" of each process holding one of these sockets (for error messages only: it scans /proc)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        if socket_inodes(int(proc.name)) & inodes:
            with contextlib.suppress(OSError):
                out.append(f"pid {proc.name} ({(proc / 'comm').read_text().strip()})")
    return out


class BindFailure(Unavailable):
    """tritonserver could not have (or does not have) one of its ports; `kinds` names which, if known."""

    def __init__(self, message: str, kinds: frozenset[str]) -> None:
        super().__init__(message)
        self.kinds = kinds


PORT_KINDS = ("grpc", "http", "metrics")
# The Python backend's shared memory per stub: a 16 MiB region at start, grown 64 MiB at a time (a
# 256 x 512-token batch of hidden states is ~200 MB; docker-compose.yml sizes /dev/shm for it).
SHM_DEFAULT_BYTES = 16 * 2**20
SHM_GROWTH_BYTES = 64 * 2**20
STARTUP_TIMEOUT_S = 120.0  # longest wait for tritonserver to load the models and answer ready
_KIND_NAMES = {"grpc": "gRPC", "http": "HTTP", "metrics": "metrics"}
_LOG_KINDS = {"GRPC": "grpc", "HTTP": "http", "METRICS": "metrics"}
_FAILED_SERVICE = re.compile(r"failed to start (\w+) service", re.IGNORECASE)
_IN_USE = re.compile(r"address already in use|already in use", re.IGNORECASE)


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

    start_attempts = 3  # bind failures retried on fresh ports (automatic ports only)

    def __init__(self, settings: Settings, *, variant: str | None = None, models: Sequence[str] = (),
                 grpc_port: int | None = None, http_port: int | None = None, metrics_port: int | None = None,
                 log_file: Path | None = None, extra_args: Sequence[str] = (), pooling_step: bool = False,
                 encoder: str | None = None, target: str = "cpu") -> None:
        if encoder_kind(target, encoder) == "tensorrt":
            raise InvalidInput("the bundled tritonserver serves a GPU repository with the torch encoder only: a "
                               "TensorRT one needs its engines built first (the compose triton service)")
        self.settings = settings
        self.pooling_step = pooling_step  # the GPU target's two-step layout on CPU (repository.generate_models)
        self.encoder, self.target = encoder, target
        self.extra_args = list(extra_args)  # more tritonserver flags, e.g. tracing for a benchmark
        self.variant = variant or settings.model.variant  # "" = each model's own default
        self.model_names = tuple(models) or (settings.model.name,)
        self.served: list[RepoModel] = []  # read at start() (a restart serves the manifests of then)
        t = settings.triton
        self.host = t.host
        # Hardened: HTTP (the healthcheck) and the unauthenticated metrics only on loopback; a monitoring
        # interface gets them published (compose: EMBEDCAR_METRICS_ADDR) or through a local agent.
        self.hardened = hardened(t)
        self.http_host = self.metrics_host = "127.0.0.1" if self.hardened else t.host
        self._flags: ServerFlags | None = None
        # 0/None = chosen by start(), right before Popen (a port picked earlier can be gone by then).
        self.grpc_port = grpc_port or 0
        self.http_port = http_port or 0
        self.metrics_port = metrics_port or 0
        self.given_ports = frozenset(k for k, p in zip(PORT_KINDS, (grpc_port, http_port, metrics_port),
                                                       strict=True) if p)
        self._log_file = log_file
        self._log_offset = 0  # where this attempt's lines start in the (appended) log
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._shm_prefix = ""
        self._started_once = False
        self.repo: Path | None = None

    # --- addresses -------------------------------------------------------------------------
    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.http_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.metrics_host}:{self.metrics_port}/metrics"

    @property
    def log_file(self) -> Path:
        return self._log_file or self.settings.triton.repo_dir.parent / f"tritonserver-{self.grpc_port}.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def answers(self, timeout_s: float = 10.0) -> bool:
        """The process is alive and says over its own gRPC port that it and every ensemble are ready."""
        if not self.running():
            return False
        from tritonclient.utils import InferenceServerException

        client, headers = self.grpc_client()
        try:
            return bool(client.is_server_ready(headers=headers, client_timeout=timeout_s)
                        and all(client.is_model_ready(e, headers=headers, client_timeout=timeout_s)
                                for e in self.ensembles))
        except InferenceServerException:
            return False
        finally:
            client.close()

    @property
    def ensembles(self) -> list[str]:
        """The ensemble names this server serves (known once started)."""
        return [m.names.ensemble for m in self.served]

    def _models(self) -> list[RepoModel]:
        out = []
        for name in self.model_names:
            model_dir = self.settings.model.models_dir / name
            manifest = load_manifest(model_dir)
            out.append(RepoModel(manifest, model_dir, self.variant or manifest.default_variant))
        return out

    def ensure_running(self) -> Self:
        """Restart a server that died or stopped answering (a shared test server, a supervisor)."""
        if self._started_once and self.answers():
            return self
        if self._started_once:
            log.warning("tritonserver on %s is gone or not answering; restarting it", self.grpc_url)
        self.stop()
        return self.start()

    def _metrics_enabled(self) -> bool:
        return not re.search(r"--allow-metrics[= ](false|0)\b", " ".join(self.extra_args), re.IGNORECASE)

    def _port_kinds(self) -> tuple[str, ...]:
        return PORT_KINDS if self._metrics_enabled() else PORT_KINDS[:2]

    def port_of(self, kind: str) -> int:
        return int(getattr(self, f"{kind}_port"))

    def host_of(self, kind: str) -> str:
        return {"grpc": self.host, "http": self.http_host, "metrics": self.metrics_host}[kind]

    def grpc_client(self) -> tuple[Any, dict[str, str] | None]:
        """A tritonclient gRPC client of this server and the headers its calls need (hardened: TLS + key).

        The launcher presents tls_dir's client certificate where it holds one, else the host's own
        (`embedcar triton certs` gives host certificates the client usage too), and checks the server's
        against "localhost", which that command puts in every host certificate: its own server, whatever
        address it binds."""
        import tritonclient.grpc as grpcclient

        if not self.hardened:
            return grpcclient.InferenceServerClient(self.grpc_url), None
        from inference.triton.tls import CLIENT_KEY_NAME, GRPC_HEADER_PREFIX, client_files, client_key

        t = self.settings.triton
        ca, cert, key = client_files(t)
        client = grpcclient.InferenceServerClient(
            self.grpc_url, ssl=True, root_certificates=str(ca), certificate_chain=str(cert), private_key=str(key),
            channel_args=[("grpc.ssl_target_name_override", "localhost")])
        return client, {GRPC_HEADER_PREFIX + CLIENT_KEY_NAME: client_key(t)}

    # --- lifecycle -------------------------------------------------------------------------
    def command(self) -> list[str]:
        t = self.settings.triton
        root = pytriton_root()
        assert root is not None and self.repo is not None
        return [
            str(root / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            f"--backend-directory={assemble_backend_dir(t.backend_dir)}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--http-address={self.http_host}", f"--http-port={self.http_port}",
            f"--metrics-address={self.metrics_host}", f"--metrics-port={self.metrics_port}",
            f"--backend-config=python,shm-default-byte-size={SHM_DEFAULT_BYTES}",
            f"--backend-config=python,shm-growth-byte-size={SHM_GROWTH_BYTES}",
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            "--strict-readiness=true", "--exit-timeout-secs=5", "--log-verbose=0",
            *(self._flags.args if self._flags else ()),  # holds the keys: never logged
            *self.extra_args,
        ]

    def _env(self) -> dict[str, str]:
        root = pytriton_root()
        assert root is not None
        env = for_other_grpc(os.environ)
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
        # Every certificate, key and key file checked before anything starts (named if wrong).
        self._flags = server_flags(self.settings.triton) if self.hardened else None
        self.served = self._models()
        # One folder per set of versions: servers of other models or versions may start side by side
        # from one checkout without removing each other's models.
        repo_dir = self.settings.triton.repo_dir
        key = hashlib.sha256(" ".join(self.ensembles).encode()).hexdigest()[:10]
        # A torch server's folder is its own: it never rewrites the ONNX one of the same models.
        layout = f"{self.target}-{self.encoder}" if self.encoder else self.target
        self.repo = generate_models(self.settings, self.served, target=self.target, pooling_step=self.pooling_step,
                                    encoder=self.encoder, out_dir=repo_dir.with_name(f"{repo_dir.name}-{layout}-{key}"))
        auto = [k for k in self._port_kinds() if k not in self.given_ports]
        attempts = max(1, self.start_attempts) if auto else 1
        # A restart keeps its ports (clients know them) unless one of them has been taken since.
        fresh = not self._started_once
        for attempt in range(1, attempts + 1):
            if fresh:
                for kind, port in self._pick_ports(auto).items():
                    setattr(self, f"{kind}_port", port)
            try:
                self._launch()
                self._wait_ready(STARTUP_TIMEOUT_S)
                self.warm_up()
                if not self.running():
                    raise Unavailable(f"tritonserver exited after warm-up; last log lines:\n{self.log_tail()}")
            except BindFailure as exc:
                self.stop()
                given = (exc.kinds or frozenset(self._port_kinds())) & self.given_ports
                if given or attempt == attempts:
                    raise
                log.warning("tritonserver start attempt %d/%d: %s; retrying on fresh ports",
                            attempt, attempts, exc.message)
                fresh = True
                continue
            except BaseException:
                self.stop()
                raise
            self._started_once = True
            return self
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _pick_ports(self, kinds: Sequence[str]) -> dict[str, int]:
        """A free port per kind, all held open together so they differ; called right before Popen."""
        with contextlib.ExitStack() as stack:
            out: dict[str, int] = {}
            for kind in kinds:
                host = self.host_of(kind)
                s = stack.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
                s.bind((host, 0))
                out[kind] = int(s.getsockname()[1])
            return out

    def _launch(self) -> None:
        # Unique per server: several tritonservers on one machine must not share /dev/shm regions.
        self._shm_prefix = f"embedcar_{os.getpid()}_{self.grpc_port}_"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_file.open("ab")
        self._log_offset = self._log.tell()
        log.info("starting tritonserver on %s (log %s)", self.grpc_url, self.log_file)
        cmd, env = self.command(), self._env()
        if self._flags is not None:
            try:
                cmd, env = argv_secrets.hide(cmd, self._flags.secrets, env)
            except Unavailable as exc:
                log.warning("tritonserver's API keys go on its command line, where local users can read them "
                            "(ps): %s", exc.message)
        self._proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    def _describe_port(self, kind: str) -> str:
        how = "given" if kind in self.given_ports else "chosen automatically"
        return f"{_KIND_NAMES[kind]} port {self.host_of(kind)}:{self.port_of(kind)} ({how})"

    def _foreign(self) -> dict[str, set[int]]:
        """Port kind -> the sockets some other process listens with there (tritonserver cannot bind it)."""
        assert self._proc is not None
        found = {k: listening_sockets(self.port_of(k), self.host_of(k)) for k in self._port_kinds()}
        # Read our sockets after the listeners: a socket is ours in /proc/<pid>/fd before it listens.
        ours = socket_inodes(self._proc.pid)
        return {k: ls for k, ls in found.items() if ls and not ls & ours}

    def _owns_ports(self) -> bool:
        """Every port is listened on by this tritonserver (True where /proc cannot tell)."""
        assert self._proc is not None
        found = [listening_sockets(self.port_of(k), self.host_of(k)) for k in self._port_kinds()]
        ours = socket_inodes(self._proc.pid)
        return all(ls is None or ls & ours for ls in found)

    def _exit_failure(self) -> Unavailable:
        """Why the process ended during start-up, from this attempt's log lines."""
        text = self._attempt_log()
        if _IN_USE.search(text):
            kinds = frozenset(_LOG_KINDS[m.group(1).upper()] for m in _FAILED_SERVICE.finditer(text)
                              if m.group(1).upper() in _LOG_KINDS)
            where = ", ".join(self._describe_port(k) for k in sorted(kinds)) or "one of its ports"
            return BindFailure(f"tritonserver could not listen on {where}: address already in use; "
                               f"last log lines:\n{self.log_tail()}", kinds)
        return Unavailable(f"tritonserver exited during start-up; last log lines:\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float) -> None:
        """Ready = alive, every port ours, HTTP ready and gRPC ServerReady + ModelReady(every ensemble)."""
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + timeout_s
        url = f"{self.http_url}/v2/health/ready"
        client, headers = self.grpc_client()
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    raise self._exit_failure()
                foreign = self._foreign()
                if foreign:
                    where = ", ".join(self._describe_port(k) for k in foreign)
                    owners = ", ".join(socket_owners(set().union(*foreign.values()))) or "another process"
                    raise BindFailure(f"{owners} listens on tritonserver's {where}: address already in use",
                                      frozenset(foreign))
                if self._http_ready(url) and self._owns_ports():
                    with contextlib.suppress(InferenceServerException):
                        if client.is_server_ready(headers=headers, client_timeout=5.0) and \
                                all(client.is_model_ready(e, headers=headers, client_timeout=5.0)
                                    for e in self.ensembles):
                            return
                time.sleep(0.1)
        finally:
            client.close()
        raise Unavailable(f"tritonserver not ready after {timeout_s:.0f} s; last log lines:\n{self.log_tail()}")

    @staticmethod
    def _http_ready(url: str) -> bool:
        with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(url, timeout=1.0) as r:
            return bool(r.status == 200)
        return False

    def warm_up(self) -> None:
        """One request per model and bucket (batch 1 and 2): ORT and the stubs set up each shape first."""
        client, headers = self.grpc_client()
        try:
            for served in self.served:
                self._warm_model(client, headers, served.manifest, served.names.ensemble)
        except Exception as exc:
            raise ModelError(f"Triton warm-up failed: {exc}; log tail:\n{self.log_tail()}") from exc
        finally:
            client.close()

    @staticmethod
    def _warm_model(client: Any, headers: dict[str, str] | None, m: Manifest, ensemble: str) -> None:
        import tritonclient.grpc as grpcclient

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
                client.infer(ensemble, inputs, headers=headers, client_timeout=60.0)

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
        if self._shm_prefix:  # empty before the first launch: never glob all of /dev/shm
            for f in Path("/dev/shm").glob(f"{self._shm_prefix}*"):
                f.unlink(missing_ok=True)

    def _attempt_log(self) -> str:
        """The log lines written since the latest start attempt (the file is appended across starts)."""
        try:
            with self.log_file.open("rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        text = self._attempt_log()
        return "\n".join(text.splitlines()[-lines:]) if text else "(no log)"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
