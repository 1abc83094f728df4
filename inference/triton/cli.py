"""`embedcar triton repo|serve|build-engine|bench`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from inference.cli import model_overrides
from inference.errors import InvalidInput, ModelError, Unavailable
from inference.lifecycle import sigterm_as_interrupt
from inference.manifest import load_manifest
from inference.settings import Settings


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.load(overrides={
        "model": model_overrides(args),
        "triton": {
            "target": getattr(args, "target", None),
            "repo_dir": Path(args.out) if getattr(args, "out", None) else None,
            "grpc_port": getattr(args, "grpc_port", None),
            "http_port": getattr(args, "http_port", None),
            "metrics_port": getattr(args, "metrics_port", None),
            "max_queue_delay_us": getattr(args, "max_queue_delay_us", None),
            "cpu_instances": getattr(args, "instances", None),
        },
    })


def register(sub: Any) -> None:
    p = sub.add_parser("triton", help="Triton model repository, local server, TensorRT engine, benchmark")
    tsub = p.add_subparsers(dest="triton_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--models-dir", default=None, help="folder of prepared models (EMBEDCAR_MODEL_MODELS_DIR)")
        q.add_argument("--variant", default=None, help="ONNX variant: fp32 | int8 | fp16 (EMBEDCAR_MODEL_VARIANT)")

    repo = tsub.add_parser("repo", help="write the model repository (encoder, pooling, embedder ensemble)")
    common(repo)
    repo.add_argument("--target", choices=("cpu", "gpu"), default=None, help="EMBEDCAR_TRITON_TARGET (cpu)")
    repo.add_argument("--out", default=None, help="repository folder (EMBEDCAR_TRITON_REPO_DIR)")
    repo.add_argument("--project-root", type=Path, default=None,
                      help="where the project lives for the backend stub, e.g. /opt/embedcar in the container")
    repo.add_argument("--max-queue-delay-us", type=int, default=None, help="dynamic batching wait")
    repo.add_argument("--instances", type=int, default=None, help="CPU encoder instances (0 = cores / 2)")
    repo.set_defaults(func=_repo)

    serve = tsub.add_parser("serve", help="run the bundled tritonserver on the CPU repository until Ctrl-C")
    common(serve)
    serve.add_argument("--grpc-port", type=int, default=None, help="0 = free port (EMBEDCAR_TRITON_GRPC_PORT)")
    serve.add_argument("--http-port", type=int, default=None, help="0 = free port")
    serve.add_argument("--metrics-port", type=int, default=None, help="0 = free port")
    serve.add_argument("--max-queue-delay-us", type=int, default=None, help="dynamic batching wait")
    serve.add_argument("--instances", type=int, default=None, help="CPU encoder instances (0 = cores / 2)")
    serve.set_defaults(func=_serve)

    eng = tsub.add_parser("build-engine", help="build/reuse the TensorRT engine (needs a GPU and trtexec)")
    common(eng)
    eng.add_argument("--trtexec", default="trtexec")
    eng.add_argument("--install", type=Path, default=None, help="copy the engine here (repo/encoder/1/model.plan)")
    eng.set_defaults(func=_build_engine, variant="fp16")

    bench = tsub.add_parser("bench", help="single-query latency: Triton ensemble vs embedded vs raw ORT")
    common(bench)
    bench.add_argument("--url", default=None, help="a running Triton's gRPC address (default: start one)")
    bench.add_argument("--shapes", default="1x16,1x32,1x64", help="batch x tokens list")
    bench.add_argument("--reps", type=int, default=300)
    bench.add_argument("--warmup", type=int, default=30)
    bench.add_argument("--max-queue-delay-us", type=int, default=None, help="dynamic batching wait (own server)")
    bench.add_argument("--instances", type=int, default=None, help="CPU encoder instances (own server)")
    bench.add_argument("--compare-step", action="store_true",
                       help="also start a server with pooling as its own step (cpu_pooling=step) and time it alike")
    bench.add_argument("--trace", type=Path, default=None,
                       help="trace every request of the own server into this file and add per-phase P50/P95")
    bench.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    bench.set_defaults(func=_bench)


def _repo(args: argparse.Namespace) -> int:
    from inference.triton.repository import generate_repository

    s = _settings(args)
    model_dir = s.model.model_dir
    out = generate_repository(s, load_manifest(model_dir), model_dir, project_root=args.project_root)
    print(out)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from inference.triton.launcher import TritonServer

    s = _settings(args)
    t = s.triton
    server = TritonServer(s, grpc_port=t.grpc_port, http_port=t.http_port, metrics_port=t.metrics_port)
    with sigterm_as_interrupt():
        try:
            server.start()
            print(f"Triton ready: gRPC {server.grpc_url}  HTTP {server.http_url}  metrics {server.metrics_url}"
                  f"  (log {server.log_file}; Ctrl-C to stop)", flush=True)
            while server.running():
                time.sleep(0.5)
            print(f"tritonserver exited on its own; see {server.log_file}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            server.stop()


def _build_engine(args: argparse.Namespace) -> int:
    from inference.triton.trt_engine import EngineBuildError, build_engine, install

    s = _settings(args)
    manifest = load_manifest(s.model.model_dir)
    onnx = s.model.model_dir / manifest.variant(args.variant).file
    try:
        engine = build_engine(onnx, s.triton.engine_cache_dir, inputs=manifest.inputs, trtexec=args.trtexec)
    except EngineBuildError as exc:
        raise ModelError(str(exc)) from exc
    if args.install:
        install(engine, args.install)
    print(engine)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from inference.triton.bench import add_trace, parse_shapes, run, save_json
    from inference.triton.launcher import TritonServer, triton_unavailable_reason
    from inference.triton.trace import trace_args

    s = _settings(args)
    shapes = parse_shapes(args.shapes)
    servers: list[TritonServer] = []
    url = args.url
    others: dict[str, str] = {}
    try:
        if url is None or args.compare_step:
            reason = triton_unavailable_reason()
            if reason:
                raise Unavailable(reason)
        if url is None:
            trace = trace_args(args.trace.resolve()) if args.trace else ()
            servers.append(TritonServer(s, extra_args=trace).start())
            url = servers[-1].grpc_url
        elif args.trace:
            raise InvalidInput("--trace needs the bench's own server (leave out --url)")
        if args.compare_step:
            repo = s.triton.repo_dir
            step = s.with_section("triton", cpu_pooling="step", repo_dir=repo.with_name(repo.name + "-step"))
            servers.append(TritonServer(step).start())  # its own free ports
            others["triton two-step"] = servers[-1].grpc_url
        report = asyncio.run(run(s, url, shapes=shapes, reps=args.reps, warmup=args.warmup, others=others))
    finally:
        for server in servers:
            server.stop()
    if args.trace:
        add_trace(report, args.trace)  # Triton writes the trace file when it stops
    print(report.markdown())
    if args.json:
        save_json(report, args.json)
    return 0
