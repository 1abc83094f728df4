"""Build (or reuse) the TensorRT engine of the FP16 ONNX encoder with trtexec.

The engine is cached under a key of ONNX checksum + TensorRT version + GPU name: a restart
reuses it, a model, TensorRT or GPU change rebuilds it (an engine is only valid for the exact
TensorRT build and GPU it was made on). Nothing is built at inference time.

Standard library only, so the Triton container's entrypoint can run this file as a script. Every
encoder of a GPU repository (one per model version, named encoder.<model>.<hash>) from the list the
repository generator wrote beside them (ENGINES: encoder folder, model folder, ONNX file, inputs):
    python3 trt_engine.py --repo /repo --models-dir /models --cache-dir /engines
or one engine, installed where it is told:
    python3 trt_engine.py --onnx /models/.../model.fp16.onnx --cache-dir /engines \
        --install /repo/encoder.<model>.<hash>/1/model.plan
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
PLAN = "model.plan"
ENGINES_FILE = "ENGINES"  # written by inference/triton/repository.py (this file imports nothing of ours)


class EngineBuildError(RuntimeError):
    """trtexec is missing or failed (mapped to ModelError by the CLI)."""


@dataclass(frozen=True, slots=True)
class Profile:
    """One optimisation profile: (batch, sequence) at min / opt / max."""

    min: tuple[int, int] = (1, 16)
    opt: tuple[int, int] = (8, 32)  # typeahead traffic: a few short queries per batch
    max: tuple[int, int] = (256, 512)

    def shapes(self, inputs: Sequence[str], which: str) -> str:
        b, n = getattr(self, which)
        return ",".join(f"{name}:{b}x{n}" for name in inputs)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "unknown"


def cache_key(onnx_sha256: str, trt_version: str, gpu_name: str, profile: Profile = Profile()) -> str:
    shape = hashlib.sha256(repr((profile.min, profile.opt, profile.max)).encode()).hexdigest()[:8]
    return f"{onnx_sha256[:16]}-trt{_slug(trt_version)}-{_slug(gpu_name)}-{shape}"


def tensorrt_version(trtexec: str = "trtexec") -> str:
    """From the tensorrt module if present, else from trtexec's banner ("[TensorRT v100300]")."""
    try:
        import tensorrt  # type: ignore[import-not-found]

        return str(tensorrt.__version__)
    except ImportError:
        pass
    try:
        out = subprocess.run([trtexec], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineBuildError(f"cannot run {trtexec}: {exc}") from exc
    m = re.search(r"TensorRT v(\d+)", out.stdout + out.stderr)
    if not m:
        raise EngineBuildError(f"cannot read the TensorRT version from {trtexec}'s output")
    return m.group(1)


def gpu_name(index: int = 0) -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", f"--id={index}"],
                             capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise EngineBuildError(f"no NVIDIA GPU visible (nvidia-smi failed: {exc})") from exc
    return out.stdout.strip().splitlines()[0]


def trtexec_command(onnx: Path, engine: Path, *, inputs: Sequence[str] = DEFAULT_INPUTS,
                    profile: Profile = Profile(), trtexec: str = "trtexec", fp16: bool = True) -> list[str]:
    cmd = [
        trtexec, f"--onnx={onnx}", f"--saveEngine={engine}",
        f"--minShapes={profile.shapes(inputs, 'min')}",
        f"--optShapes={profile.shapes(inputs, 'opt')}",
        f"--maxShapes={profile.shapes(inputs, 'max')}",
        "--skipInference",  # build only; timing happens in the benchmark
    ]
    if fp16:
        cmd.append("--fp16")
    return cmd


def build_engine(onnx: Path, cache_dir: Path, *, inputs: Sequence[str] = DEFAULT_INPUTS,
                 profile: Profile = Profile(), trtexec: str = "trtexec", gpu: str | None = None,
                 trt_version: str | None = None, log: bool = True) -> Path:
    """The cached engine for this ONNX/TensorRT/GPU, built with trtexec when missing."""
    if not onnx.exists():
        raise EngineBuildError(f"no ONNX model at {onnx}")
    key = cache_key(sha256_file(onnx), trt_version or tensorrt_version(trtexec), gpu or gpu_name(), profile)
    engine = cache_dir / key / PLAN
    if engine.exists() and engine.stat().st_size > 0:
        if log:
            print(f"trt_engine: reusing {engine}", file=sys.stderr)
        return engine
    engine.parent.mkdir(parents=True, exist_ok=True)
    tmp = engine.with_name(f".{PLAN}.{os.getpid()}")
    cmd = trtexec_command(onnx, tmp, inputs=inputs, profile=profile, trtexec=trtexec)
    if log:
        print(f"trt_engine: building {engine} (minutes)\n  {' '.join(cmd)}", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise EngineBuildError(f"cannot run {trtexec}: {exc}") from exc
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise EngineBuildError(f"trtexec failed ({proc.returncode}):\n{tail}")
    tmp.replace(engine)  # atomic: a concurrent reader never sees half an engine
    (engine.parent / "build.txt").write_text(" ".join(cmd) + "\n")
    return engine


def install(engine: Path, target: Path) -> None:
    """Copy the engine to where Triton's repository expects it (atomic replace)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.copyfile(engine, tmp)
    tmp.replace(target)


@dataclass(frozen=True, slots=True)
class RepoEngine:
    """One encoder of a GPU repository: where its plan goes and the ONNX it is built from."""

    encoder: str
    model: str
    onnx_file: str
    inputs: tuple[str, ...]


def repository_engines(repo: Path) -> list[RepoEngine]:
    """The encoders a GPU repository lists (its ENGINES file); an error naming the file if it has none."""
    path = repo / ENGINES_FILE
    try:
        lines = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise EngineBuildError(f"no {path}: generate the GPU repository first (embedcar triton repo --target gpu)") \
            from exc
    bad = [line for line in lines if len(line) != 4]
    if bad or not lines:
        raise EngineBuildError(f"{path} does not list encoders as 'encoder, model, onnx file, inputs' lines")
    return [RepoEngine(enc, model, onnx, tuple(inputs.split(","))) for enc, model, onnx, inputs in lines]


def install_repository(repo: Path, models_dir: Path, cache_dir: Path, *, trtexec: str = "trtexec",
                       gpu: str | None = None, trt_version: str | None = None) -> list[Path]:
    """Build (or reuse) and install the plan of every encoder the repository lists."""
    out = []
    for e in repository_engines(repo):
        engine = build_engine(models_dir / e.model / e.onnx_file, cache_dir, inputs=e.inputs, trtexec=trtexec,
                              gpu=gpu, trt_version=trt_version, log=False)
        install(engine, repo / e.encoder / "1" / PLAN)
        out.append(engine)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--repo", type=Path, default=None, help="a GPU repository: build and install every encoder "
                   "it lists (with --models-dir)")
    p.add_argument("--models-dir", type=Path, default=None, help="the prepared models' folder (with --repo)")
    p.add_argument("--onnx", type=Path, default=None, help="one ONNX encoder (instead of --repo)")
    p.add_argument("--cache-dir", type=Path, required=True)
    p.add_argument("--install", type=Path, default=None,
                   help="copy the engine here (repo/encoder.<model>.<hash>/1/model.plan)")
    p.add_argument("--inputs", default=",".join(DEFAULT_INPUTS))
    p.add_argument("--trtexec", default=shutil.which("trtexec") or "/usr/src/tensorrt/bin/trtexec")
    args = p.parse_args(argv)
    if (args.repo is None) == (args.onnx is None) or (args.repo is not None and args.models_dir is None):
        p.error("give --repo with --models-dir, or --onnx")
    try:
        if args.repo is not None:
            engines = install_repository(args.repo, args.models_dir, args.cache_dir, trtexec=args.trtexec)
        else:
            engines = [build_engine(args.onnx, args.cache_dir, inputs=args.inputs.split(","), trtexec=args.trtexec)]
            if args.install:
                install(engines[0], args.install)
    except EngineBuildError as exc:
        print(f"trt_engine: {exc}", file=sys.stderr)
        return 2
    for engine in engines:
        print(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
