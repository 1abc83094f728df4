"""`embedcar triton repo|serve|build-engine` (the Triton benchmark: `embedcar bench triton`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from inference.errors import ModelError
from inference.flags import add_flags, flag_overrides
from inference.lifecycle import sigterm_as_interrupt
from inference.manifest import load_manifest
from inference.settings import ModelSettings, Settings, TritonSettings

# repository.ENCODERS, not imported here: every `embedcar` command would load tritonclient to start.
ENCODERS = ("onnx", "tensorrt", "torch")


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.load(overrides=flag_overrides(args))


def register(sub: Any) -> None:
    p = sub.add_parser("triton", help="Triton model repository, local server, TensorRT engine")
    tsub = p.add_subparsers(dest="triton_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        add_flags(q, "model", ModelSettings, "models_dir", "variant")

    def served(q: argparse.ArgumentParser) -> None:
        q.add_argument("--models", action="append", default=None, metavar="NAME[,NAME...]",
                       help="the models to serve from one repository, each as its own versioned ensemble "
                       "(embedder.<model>.<hash>), e.g. two models, or two versions' folders during a rollout "
                       "(repeatable; default: model.name)")

    repo = tsub.add_parser("repo", help="write the model repository: per model version, encoder, pooling and "
                           "its ensemble embedder.<model>.<hash>")
    common(repo)
    served(repo)
    add_flags(repo, "triton", TritonSettings, "target", "repo_dir", "max_queue_delay_us", "instances")
    repo.add_argument("--project-root", type=Path, default=None,
                      help="where the project lives for the backend stub, e.g. /opt/embedcar in the container")
    repo.add_argument("--encoder", choices=ENCODERS, default=None,
                      help="what runs the transformer: the target's own by default (cpu: onnx, gpu: tensorrt), or "
                      "torch on either: the model's PyTorch weights in a Python-backend model (a GPU without TensorRT)")
    repo.set_defaults(func=_repo)

    serve = tsub.add_parser("serve", help="run the bundled tritonserver on the CPU repository (--encoder torch: "
                            "the --target one) until Ctrl-C")
    common(serve)
    served(serve)
    add_flags(serve, "triton", TritonSettings, "grpc_port", "http_port", "metrics_port", "max_queue_delay_us",
              "instances", "host", "tls_dir", "target")
    serve.add_argument("--encoder", choices=("onnx", "torch"), default=None,
                       help="onnx (default): ONNX Runtime on the CPU, whatever --target says; torch: the model's "
                       "PyTorch weights, on this machine's GPUs with --target gpu, else on the CPU")
    serve.set_defaults(func=_serve)

    certs = tsub.add_parser("certs", help="a private CA, the two API keys and, per host and per client of a "
                            "hardened Triton pool, its triton.tls_dir (keys written 0600; an existing CA and keys "
                            "are kept)")
    certs.add_argument("--hosts", required=True, help="Triton host names or addresses, comma-separated (each "
                       "certificate also names localhost and 127.0.0.1)")
    certs.add_argument("--clients", default="sidecar",
                       help="client certificate names for mutual TLS, comma-separated (default: sidecar)")
    certs.add_argument("--out", type=Path, default=Path("var/secrets/triton"),
                       help="output folder: the CA and keys, and OUT/NAME for each host and client")
    certs.set_defaults(func=_certs)

    eng = tsub.add_parser("build-engine", help="build/reuse the TensorRT engine (needs a GPU and trtexec)")
    common(eng)
    eng.add_argument("--trtexec", default="trtexec")
    eng.add_argument("--install", type=Path, default=None, help="copy the engine here (repo/encoder/1/model.plan)")
    eng.set_defaults(func=_build_engine, variant="fp16")


def _model_names(args: argparse.Namespace, s: Settings) -> list[str]:
    names = [n.strip() for raw in (args.models or ()) for n in raw.split(",") if n.strip()]
    return names or [s.model.name]


def _repo(args: argparse.Namespace) -> int:
    from inference.triton.repository import RepoModel, generate_models

    s = _settings(args)
    models = []
    for name in _model_names(args, s):
        model_dir = s.model.models_dir / name
        manifest = load_manifest(model_dir)
        models.append(RepoModel(manifest, model_dir, s.model.variant or manifest.default_variant))
    out = generate_models(s, models, project_root=args.project_root, encoder=args.encoder)
    for m in models:
        print(f"{m.names.ensemble}  ({m.names.variant_id})")
    print(out)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from inference.triton.launcher import TritonServer

    s = _settings(args)
    t = s.triton
    # Only the torch encoder takes triton.target here: a TensorRT repository needs its engines first.
    torch = args.encoder == "torch"
    server = TritonServer(s, models=_model_names(args, s), grpc_port=t.grpc_port, http_port=t.http_port,
                          metrics_port=t.metrics_port, encoder=args.encoder, target=t.target if torch else "cpu")
    with sigterm_as_interrupt():
        try:
            server.start()
            print(f"Triton ready: gRPC {server.grpc_url}  HTTP {server.http_url}  metrics {server.metrics_url}"
                  f"  serving {', '.join(server.ensembles)}  (log {server.log_file}; Ctrl-C to stop)", flush=True)
            while server.running():
                time.sleep(0.5)
            print(f"tritonserver exited on its own; see {server.log_file}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            server.stop()


def _certs(args: argparse.Namespace) -> int:
    from inference.triton.certs import make_pool_certs

    def names(raw: str) -> list[str]:
        return [n.strip() for n in raw.split(",") if n.strip()]

    files = make_pool_certs(args.out, names(args.hosts), names(args.clients))
    print(f"CA: {files.ca_cert}")
    print(f"keys: {files.client_key} (sidecars, catalog job), {files.operator_key} (operator), 0600")
    for kind, made in (("host", files.hosts), ("client", files.clients)):
        for name in made:
            print(f"{kind} {name}: EMBEDCAR_TRITON_TLS_DIR={files.dirs[name]}")
    return 0


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
