"""How `embedcar model prepare` checks a variant (inference/model_build.py builds them): the served
path's embeddings of mixed-length real texts, with the model's own prompts, against the reference a
user would compare with (sentence-transformers' `encode`, else PyTorch's hidden states through the
same head; an adopted ONNX graph against itself), batch independence, the int8 calibration feeds and
the golden file of reference embeddings.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inference import export, runtimes
from inference.buckets import buckets_for_max_length
from inference.head import Head
from inference.model_folder import ModelFolder
from inference.tokenizer import QueryTokenizer

Say = Callable[[str], None]

GOLDEN_TEXTS = (
    "best marathon training shoes for women",
    "running shoes",
    "organic gluten free pasta sauce under 5 dollars family size",
    "Greek yogurt",
    "crème fraîche 🍓 strawberries",
    "low sodium chicken broth for soup",
)


@dataclass(frozen=True, slots=True)
class PrepTokenizer:
    """What the served tokenizer needs, before a manifest exists."""

    file: Path
    max_length: int
    pad_id: int
    with_types: bool
    prompts: dict[str, str]
    prompt_lengths: dict[str, int]
    include_prompt: bool

    def for_role(self, role: str) -> QueryTokenizer:
        prompt = self.prompts.get(role, "")
        skip = 0 if self.include_prompt or not prompt else self.prompt_lengths[role]
        return QueryTokenizer(self.file, max_length=self.max_length, buckets=buckets_for_max_length(self.max_length),
                              pad_id=self.pad_id, with_token_type_ids=self.with_types, prompt=prompt, pool_skip=skip)


def served_embeddings(graph: runtimes.Graph, tok: PrepTokenizer, head: Head, role: str,
                      texts: tuple[str, ...]) -> npt.NDArray[np.float32]:
    """The served path's embeddings of `texts` as one padded batch: tokenizer (with the role's
    prompt) -> `graph` (a variant on the runtime that serves it) -> the head."""
    qt = tok.for_role(role)
    batch = qt.batch(qt.encode(list(texts)).ids)
    hidden = graph.hidden({k: v for k, v in batch.arrays().items() if k in graph.inputs})
    return head(hidden, batch.attention_mask, input_ids=batch.input_ids, skip=batch.pool_skip)


# Batch-mates for the batch check: a one-word text and a long one (a larger bucket, more padding).
BATCH_MATES = ("tea", "family size value pack of organic whole grain gluten free breakfast cereal with "
               "almonds and honey clusters, no artificial colours or flavours, 12 boxes of 14 ounces each")


def batch_drift(graph: runtimes.Graph, qt: QueryTokenizer, head: Head, texts: Sequence[str]) -> dict[str, float]:
    """Each text alone (exact length, no padding) against the same text in mixed batches padded to
    other lengths: the largest component difference of the unit vectors and the smallest cosine."""
    ids = qt.encode(list(texts)).ids

    def unit(rows: list[list[int]], length: int | None = None) -> npt.NDArray[np.float32]:
        batch = qt.batch(rows, length)
        hidden = graph.hidden({k: v for k, v in batch.arrays().items() if k in graph.inputs})
        emb = head(hidden, batch.attention_mask, input_ids=batch.input_ids, skip=batch.pool_skip)
        return np.asarray(emb / np.linalg.norm(emb, axis=1, keepdims=True), dtype=np.float32)

    alone = np.vstack([unit([x], len(x)) for x in ids])
    mates = qt.encode(list(BATCH_MATES)).ids
    together = unit(ids)  # one batch, padded to its longest's bucket
    mixed = unit([mates[1], *ids[::-1], mates[0]])[1:-1][::-1]  # reversed, a longer bucket
    diff = max(float(np.abs(together - alone).max()), float(np.abs(mixed - alone).max()))
    cos = min(float((together * alone).sum(axis=1).min()), float((mixed * alone).sum(axis=1).min()))
    return {"batch_max_abs": diff, "batch_min_cos": cos}


def calibration_feeds(tok: PrepTokenizer, inputs: tuple[str, ...], batch_size: int = 32) -> Iterator[export.Feed]:
    """The int8 calibration texts as the served path tokenizes them (each role with its prompt), in
    batches by length."""
    for role, texts in export.calibration_texts().items():
        qt = tok.for_role(role)
        ids = sorted(qt.encode(texts).ids, key=len)
        for i in range(0, len(ids), batch_size):
            yield {k: v for k, v in qt.batch(ids[i : i + batch_size]).arrays().items() if k in inputs}


@dataclass(slots=True)
class Checker:
    """Scores a variant's file against the references: PyTorch's hidden states (plain texts, one
    padded batch) and, per role, the embeddings a user would compare with (`ref_name`)."""

    tok: PrepTokenizer
    head: Head
    ref_hidden: Any
    feed: dict[str, Any]
    refs: dict[str, Any]
    ref_name: str
    texts: tuple[str, ...] = export.CHECK_TEXTS

    @classmethod
    def against_reference(cls, src: Path, folder: ModelFolder, model: Any, raw: Path, tok: PrepTokenizer,
                          head: Head, inputs: tuple[str, ...], say: Say) -> Checker:
        """`model`: the PyTorch model, None for an adopted ONNX graph `raw` (then its own reference)."""
        texts = export.CHECK_TEXTS
        if model is not None:
            ref_hidden, feed = export.torch_hidden(model, tok.file, texts, inputs, tok.max_length)
        else:
            plain = tok.for_role("none")
            feed = {k: v for k, v in plain.batch(plain.encode(list(texts)).ids).arrays().items() if k in inputs}
            ref_hidden = runtimes.hidden_once(raw, "fp32", feed)
        refs, ref_name = references(src, folder, model, raw, tok, head, texts, inputs, say)
        return cls(tok, head, ref_hidden, feed, refs, ref_name, texts)

    def __call__(self, path: Path, precision: str) -> dict[str, float]:
        got: dict[str, float] = {}
        if precision == "fp32":
            got["max_abs_diff"] = export.hidden_diff(path, self.ref_hidden, self.feed)
        graph = runtimes.open_graph(path, precision, 0)  # once for every role
        got["min_cos"] = min(float(export.cosines(served_embeddings(graph, self.tok, self.head, r, self.texts),
                                                  self.refs[r]).min()) for r in self.refs)
        if precision in ("fp32", "int8"):
            got.update(batch_drift(graph, self.tok.for_role("query"), self.head, self.texts))
        return got


def references(src: Path, folder: ModelFolder, model: Any, raw: Path, tok: PrepTokenizer, head: Head,
                texts: tuple[str, ...], inputs: tuple[str, ...], say: Say) -> tuple[dict[str, Any], str]:
    """Reference embeddings per role (the roles with a prompt, and the query role) and their name."""
    roles = sorted({"query", *folder.prompts})
    if model is None:
        graph = runtimes.open_graph(raw, "fp32", 0)
        return {r: served_embeddings(graph, tok, head, r, texts) for r in roles}, "the given ONNX graph"
    # sentence-transformers pools as its own files say: not the reference once --pooling overrides them.
    if folder.is_sentence_transformers and folder.pooling_from != "--pooling":
        st = {r: export.st_embeddings(src, texts, folder.prompts.get(r, "")) for r in roles}
        if all(v is not None for v in st.values()):
            return st, "sentence-transformers"
        say("sentence-transformers is not installed: checking against PyTorch + the model's head instead")
    refs = {}
    for r in roles:
        qt = tok.for_role(r)
        prompted = [qt.prompt + t for t in texts]
        hidden, feed = export.torch_hidden(model, tok.file, prompted, inputs, tok.max_length)
        refs[r] = head(hidden, feed["attention_mask"], input_ids=feed["input_ids"], skip=qt.pool_skip)
    return refs, "PyTorch"


def torch_figures(model_dir: Path, precision: str, tok: PrepTokenizer, refs: dict[str, Any],
                  texts: tuple[str, ...] = export.CHECK_TEXTS) -> dict[str, float]:
    """A torch-only model's check: the torch encoder (inference/torch_encoder.py, what the torch backend
    runs) on the CPU in `precision`, fed by the served tokenizer per role, against `refs` (`references`).
    `model_dir` holds the manifest and weights/ already."""
    import torch

    from inference.torch_encoder import load_encoder

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    enc = load_encoder(model_dir, device="cpu", dtype=dtypes[precision])
    cos = []
    for role, ref in refs.items():
        qt = tok.for_role(role)
        batch = qt.batch(qt.encode(list(texts)).ids)
        got = enc.encode(batch.input_ids, batch.attention_mask, batch.token_type_ids, skip=batch.pool_skip)
        cos.append(float(export.cosines(got, ref).min()))
    return {"min_cos": min(cos)}


def describe(figures: dict[str, float]) -> str:
    parts = []
    if "max_abs_diff" in figures:
        parts.append(f"max abs diff {figures['max_abs_diff']:.1e}")
    parts.append(f"min cos {figures['min_cos']:.6f}")
    if "batch_max_abs" in figures:
        parts.append(f"alone vs in a batch max abs {figures['batch_max_abs']:.1e}")
    return ", ".join(parts)


def write_golden(model: Any, tok: PrepTokenizer, head: Head, inputs: tuple[str, ...], path: Path) -> None:
    """Reference embeddings from PyTorch + the model's head, each query text alone."""
    qt = tok.for_role("query")
    rows = []
    for text in GOLDEN_TEXTS:
        hidden, feed = export.torch_hidden(model, tok.file, [qt.prompt + text], inputs, tok.max_length)
        emb = head(hidden, feed["attention_mask"], input_ids=feed["input_ids"], skip=qt.pool_skip)[0]
        rows.append({"text": text, "embedding": [round(float(x), 7) for x in emb]})
    path.write_text(json.dumps({
        "made_by": "embedcar model prepare: PyTorch (transformers, eager) last_hidden_state + the model's "
                   "head (its pooling, Dense layers, normalisation), each text alone",
        "texts": rows,
    }, indent=1))
