"""Start the system under test on this machine (`embedcar loadtest --start-stack`).

Each server runs in its own process, never on the load generator's event loop: tritonserver via
inference.triton.launcher.TritonServer, the sidecar as `python -m inference.cli_main sidecar serve`
configured through EMBEDCAR_* variables, the baseline via loadtest.baseline.BaselineServer, Infinity
via loadtest.infinity.InfinityServer (`make infinity`). All bind 127.0.0.1 on free ports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from inference.backends.factory import check_kind
from inference.errors import EmbedcarError, InvalidInput, Unavailable
from inference.lifecycle import terminate
from inference.ports import free_port
from inference.triton.tls import ClientCredentials, client_credentials
from loadtest.baseline import BaselineServer
from loadtest.targets import (
    TARGETS,
    HttpEmbedTarget,
    InProcessTarget,
    PoolTarget,
    SidecarEmbedTarget,
    SidecarSearchTarget,
    SidecarStreamTarget,
    StubTarget,
    Target,
    TritonTarget,
)
from sidecar.settings import Settings

log = logging.getLogger(__name__)


SIDECAR_TARGETS = ("sidecar-embed", "sidecar-stream", "sidecar-search", "http")
NATIVE_TARGETS = ("sidecar-embed", "sidecar-stream", "sidecar-search")  # what `+native` can send
CLIENTS = ("python", "native")


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """`target[:backend][@processes][+native]` as given to --target/--compare, e.g.
    "sidecar-embed:triton", "sidecar-stream:embedded@2" (two sidecar processes sharing the cores,
    model threads split between them, requests spread round-robin over one connection to each), or
    "sidecar-stream:embedded+native": the calls sent by the compiled client (loadtest/native.py)."""

    target: str
    backend: str
    processes: int = 1
    client: str = "python"

    @classmethod
    def parse(cls, text: str, default_backend: str = "embedded") -> TargetSpec:
        text, plus, client = text.strip().partition("+")
        if plus and client not in CLIENTS:
            raise InvalidInput(f"{text}+{client}: the client after + is one of {', '.join(CLIENTS)}")
        client = client or "python"
        head, _, count = text.partition("@")
        target, _, backend = head.partition(":")
        backend = backend or default_backend
        if target not in TARGETS:
            raise InvalidInput(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")
        try:
            processes = int(count) if count else 1
        except ValueError:
            raise InvalidInput(f"{text!r}: the count after @ must be a whole number of sidecar processes") from None
        if processes < 1 or (processes > 1 and target not in SIDECAR_TARGETS):
            raise InvalidInput(f"{text!r}: @N takes N >= 1, and only for a sidecar target "
                               f"({', '.join(SIDECAR_TARGETS)})")
        if client == "native" and (target not in NATIVE_TARGETS or processes > 1):
            raise InvalidInput(f"{text}+native: the native client sends gRPC calls to one sidecar "
                               f"({', '.join(NATIVE_TARGETS)}, without @N)")
        return cls(target, check_kind(backend), processes, client)

    @property
    def label(self) -> str:
        if self.target in ("baseline", "triton", "inprocess", "stub", "infinity"):
            return self.target
        return (f"{self.target}:{self.backend}" + (f"@{self.processes}" if self.processes > 1 else "")
                + ("+native" if self.client == "native" else ""))


class SidecarProcess:
    """`embedcar sidecar serve` in a child process, configured through EMBEDCAR_* variables.

    http=False leaves the HTTP facade off; uds_path: gRPC also on this Unix socket (`uds_target`).
    """

    def __init__(self, settings: Settings, *, backend: str, variant: str, triton_url: str | None = None,
                 index_dir: Path | None = None, log_file: Path | None = None, http: bool = True,
                 uds_path: Path | None = None, startup_timeout_s: float = 180.0,
                 extra_env: dict[str, str] | None = None) -> None:
        self.grpc_port = free_port()
        self.http_port = free_port() if http else -1
        self.uds_path = uds_path
        self.log_file = log_file
        self.startup_timeout_s = startup_timeout_s
        env = dict(os.environ)
        env.update({
            "EMBEDCAR_MODEL_MODELS_DIR": str(settings.model.models_dir.resolve()),
            "EMBEDCAR_MODEL_NAME": settings.model.name,
            "EMBEDCAR_MODEL_VARIANT": variant,
            # The generator's flags reach the sidecar (--threads, --lanes); a pool overrides the threads.
            "EMBEDCAR_MODEL_INTRA_OP_THREADS": str(settings.model.intra_op_threads),
            "EMBEDCAR_MODEL_FORWARD_LANES": str(settings.model.forward_lanes),
            "EMBEDCAR_SIDECAR_HOST": "127.0.0.1",
            "EMBEDCAR_SIDECAR_GRPC_PORT": str(self.grpc_port),
            "EMBEDCAR_SIDECAR_HTTP_PORT": str(self.http_port),
            "EMBEDCAR_SIDECAR_BACKEND": backend,
            # A local test stack runs without keys (whatever this shell configures): the generator
            # measures the serving path, and a key check costs microseconds.
            "EMBEDCAR_SIDECAR_API_KEYS": "",
            "EMBEDCAR_SIDECAR_API_KEYS_FILE": "",
        })
        if triton_url:
            env["EMBEDCAR_TRITON_URLS"] = triton_url
        if index_dir is not None:
            env["EMBEDCAR_SIDECAR_INDEX_DIR"] = str(index_dir.resolve())
        if uds_path is not None:
            env["EMBEDCAR_SIDECAR_UDS_PATH"] = str(uds_path.resolve())
        env.update(extra_env or {})  # e.g. EMBEDCAR_SIDECAR_EMBEDDED_FALLBACK for a fault scenario
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def uds_target(self) -> str:
        if self.uds_path is None:
            raise InvalidInput("this sidecar has no Unix socket (uds_path not given)")
        return f"unix:{self.uds_path.resolve()}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "inference.cli_main", "sidecar", "serve"]
        out = self.log_file.open("ab") if self.log_file else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(cmd, env=self._env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        finally:
            if self.log_file:
                out.close()  # type: ignore[union-attr]
        self._wait_ready()

    def _wait_ready(self) -> None:
        from embedcar_client.client import Client

        deadline = time.monotonic() + self.startup_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise Unavailable(f"sidecar exited during start-up (code {code}); see {self.log_file or 'its log'}")
            try:
                with Client(self.grpc_target) as c:
                    c.embed(["load test readiness probe"], timeout_s=2.0)
                return
            except EmbedcarError as exc:
                last = exc
            time.sleep(0.5)
        self.stop()
        raise Unavailable(f"sidecar not ready within {self.startup_timeout_s:g} s: {last}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            terminate(proc, 30)  # SIGTERM first: the sidecar drains gracefully

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def start_stack(spec: TargetSpec, settings: Settings, stack: contextlib.ExitStack, *, variant: str,
                api_key: str | None = None, k: int = 10, index_dir: Path | None = None,
                log_dir: Path | None = None, infinity_exe: Path | None = None,
                pids: dict[str, int] | None = None, triton_trace: Path | None = None) -> Target:
    """Start what `spec` needs (entered on `stack`, so leaving it stops everything) -> its target.

    `pids` receives each started server's process id by name (loadtest.proc_cpu measures them);
    `triton_trace`: a started tritonserver traces every request into that file (written when it stops).
    """
    started: dict[str, int] = {} if pids is None else pids
    if spec.target == "stub":
        return StubTarget()
    model_dir = settings.model.model_dir
    if spec.target == "inprocess":
        return InProcessTarget.for_model(settings.model, variant)
    logs = log_dir or Path("var/loadtest")
    logs.mkdir(parents=True, exist_ok=True)
    if spec.target == "baseline":
        base = stack.enter_context(BaselineServer(model_dir, variant=variant, threads=settings.model.intra_op_threads,
                                                  log_file=logs / "baseline.log"))
        _note(started, "baseline", base.pid)
        return HttpEmbedTarget(base.url, name="baseline")
    if spec.target == "infinity":
        from loadtest.infinity import DEFAULT_EXE, InfinityServer

        inf = stack.enter_context(InfinityServer(model_dir, variant, exe=infinity_exe or DEFAULT_EXE,
                                                 log_file=logs / f"infinity-{variant}.log"))
        _note(started, "infinity", inf.pid)
        return HttpEmbedTarget(inf.url, name="infinity", path="/embeddings", model=inf.served_name)
    triton_url: str | None = None
    if spec.target == "triton" or spec.backend == "triton":
        from inference.triton.launcher import TritonServer

        log.info("starting tritonserver (%s)", variant)
        from inference.triton.trace import trace_args

        extra = trace_args(triton_trace.resolve()) if triton_trace is not None else ()
        server = stack.enter_context(TritonServer(settings, variant=variant, models=settings.sidecar.models,
                                                  extra_args=extra))  # every model the sidecar serves
        _note(started, "tritonserver", server.pid)
        triton_url = server.grpc_url
    if spec.target == "triton":
        assert triton_url is not None
        return TritonTarget([triton_url], model_dir, variant=variant, credentials=client_credentials(settings.triton))
    if spec.target == "sidecar-search" and index_dir is None:
        from catalog.job import ensure_index
        from catalog.sources import GROCERY_SOURCE
        from catalog.spec import BuildSpec

        # loadtest/queries.py builds its shopper queries from the same grocery catalog.
        log.info("making sure the grocery index exists (built once; minutes on CPU)")
        ensure_index(settings.with_section("model", variant=variant),
                     BuildSpec(source=GROCERY_SOURCE, text_fields=settings.catalog.text_fields))
        index_dir = settings.catalog.index_root
    n = spec.processes
    log.info("starting %s (%s backend, %s)", "the sidecar" if n == 1 else f"{n} sidecars", spec.backend, variant)
    # Several processes split the model's threads: each forward on fewer threads, n at a time.
    threads = settings.model.intra_op_threads or os.cpu_count() or 1
    env = {"EMBEDCAR_MODEL_INTRA_OP_THREADS": str(max(1, threads // n))} if n > 1 else {}
    members: list[Target] = []
    for i in range(1, n + 1):
        suffix = "" if i == 1 else f"-{i}"
        log_file = logs / f"sidecar-{spec.backend}{suffix}.log"
        sc = stack.enter_context(SidecarProcess(settings, backend=spec.backend, variant=variant, triton_url=triton_url,
                                                index_dir=index_dir, log_file=log_file, extra_env=env))
        _note(started, f"sidecar{suffix}", sc.pid)
        members.append(sidecar_target(spec.target, sc.grpc_target, sc.http_url, api_key=api_key, k=k,
                                      triton_stats_url=triton_url,
                                      triton_credentials=client_credentials(settings.triton)))
    return members[0] if n == 1 else PoolTarget(members)


def sidecar_target(kind: str, grpc_target: str, http_url: str, *, api_key: str | None, k: int = 10,
                   triton_stats_url: str | None = None, triton_credentials: ClientCredentials | None = None
                   ) -> Target:
    """The target of one sidecar for a target kind of SIDECAR_TARGETS (`triton_credentials`: a hardened
    Triton's, for its statistics)."""
    stats: dict[str, Any] = {"triton_stats_url": triton_stats_url, "triton_credentials": triton_credentials}
    if kind == "sidecar-search":
        return SidecarSearchTarget(grpc_target, api_key=api_key, k=k, **stats)
    if kind == "http":
        return HttpEmbedTarget(http_url, api_key=api_key, **stats)
    if kind == "sidecar-stream":
        return SidecarStreamTarget(grpc_target, api_key=api_key, **stats)
    return SidecarEmbedTarget(grpc_target, api_key=api_key, **stats)


def _note(pids: dict[str, int], name: str, pid: int | None) -> None:
    if pid is not None:
        pids[name] = pid
