"""sentence-transformers' trainer, set up as a long job: progress, checkpoints, resume, a time budget.

The model, loss and data come from the recipe; `SentenceTransformerTrainer` does the loop (AdamW,
linear decay after warm-up) over batches laid out
here (no text twice in a batch). A checkpoint is written every
`save_steps` (weights, optimizer, scheduler, RNG states, the trainer's position in the data), so a
killed run resumed from its last checkpoint continues to the same weights as one never stopped.
On a GPU the trainer's own device choice applies, with bf16 (or fp16) autocast; on a CPU torch
uses every core it is given.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sentence_transformers.sampler import DefaultBatchSampler
from transformers import TrainerCallback

from catalog.tuning.recipe import Recipe
from inference.errors import InvalidInput, ModelError

log = logging.getLogger(__name__)
ELAPSED_FILE = "elapsed.json"  # training seconds spent before the checkpoint: the budget spans resumes


@dataclass(frozen=True, slots=True)
class Trained:
    steps: int
    seconds: float
    loss: float | None
    stopped_by_budget: bool


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(folder: Path, recipe: Recipe, *, where: str) -> Any:
    from sentence_transformers import SentenceTransformer

    try:
        model = SentenceTransformer(str(folder), device=where, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load {folder} with sentence-transformers: {str(exc).splitlines()[0]}") from exc
    if recipe.freeze_layers:
        _freeze(model, recipe.freeze_layers)
    return model


def _freeze(model: Any, layers: int) -> None:
    """Embeddings and the lower `layers` encoder layers keep their weights: fewer gradients to compute."""
    auto = model[0].auto_model
    blocks = getattr(getattr(auto, "encoder", None), "layer", None) or getattr(auto, "layers", None)
    embeddings = getattr(auto, "embeddings", None)
    if blocks is None or embeddings is None:
        raise InvalidInput(f"--freeze-layers: the {type(auto).__name__} has no embeddings/encoder layers to freeze")
    if layers >= len(blocks):
        raise InvalidInput(f"--freeze-layers {layers}: the model has {len(blocks)} layers; freeze fewer")
    for module in (embeddings, *blocks[:layers]):
        for param in module.parameters():
            param.requires_grad_(False)


def make_loss(model: Any, recipe: Recipe) -> Any:
    from sentence_transformers import losses

    loss: Any
    if recipe.loss == "cached":
        loss = losses.CachedMultipleNegativesRankingLoss(model, scale=recipe.scale,
                                                         mini_batch_size=recipe.mini_batch_size)
    else:
        loss = losses.MultipleNegativesRankingLoss(model, scale=recipe.scale)
    if recipe.matryoshka:
        loss = losses.MatryoshkaLoss(model, loss, matryoshka_dims=list(recipe.matryoshka))
    return loss


def dataset(columns: Mapping[str, Sequence[str]], *, batch_size: int, steps: int, seed: int) -> Any:
    """The rows in the exact order training reads them: `steps` batches, each without a repeated
    text (in-batch negatives: a repeated anchor or product would be a false negative), drawn from
    shuffled passes over the pairs. Fixing the order here, rather than in a shuffling sampler, is
    what lets a resumed run read the same batches as an uninterrupted one."""
    from datasets import Dataset

    names = list(columns)
    rows = list(zip(*(columns[n] for n in names), strict=True))
    if not rows:
        raise InvalidInput("no training pairs")
    rng = random.Random(seed)
    need = steps * batch_size
    order: list[int] = []
    for _pass in range(1000):
        pending = list(range(len(rows)))
        rng.shuffle(pending)
        stream = iter(pending)
        deferred: collections.deque[int] = collections.deque()  # clashed with a batch: tried first next time
        while len(order) < need:
            batch: list[int] = []
            seen: set[str] = set()
            retry: list[int] = []
            # a bounded look at the deferred rows: a text shared by thousands (an aisle name) waits its turn
            for _ in range(min(len(deferred), 4 * batch_size)):
                i = deferred.popleft()
                (retry if seen & set(rows[i]) or len(batch) == batch_size else batch).append(i)
                if batch and batch[-1] == i:
                    seen.update(rows[i])
            while len(batch) < batch_size and (i := next(stream, -1)) >= 0:
                if seen & set(rows[i]):
                    retry.append(i)
                else:
                    batch.append(i)
                    seen.update(rows[i])
            deferred.extendleft(reversed(retry))
            if len(batch) < batch_size:
                break  # this pass is used up; its remainder starts the next pass's batches no sooner
            order += batch
        if len(order) >= need:
            break
    else:
        raise InvalidInput(f"cannot fill {steps} batches of {batch_size} distinct texts from {len(rows)} pairs: "
                           "use a smaller --batch-size")
    return Dataset.from_dict({n: [rows[i][k] for i in order] for k, n in enumerate(names)})


class InOrder(DefaultBatchSampler):
    """Reads the dataset's rows in their order, `batch_size` at a time (the order is `dataset`'s).
    At module level: the trainer pickles its arguments, this class with them."""

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.sampler)  # type: ignore[arg-type]  # the dataset itself
        for start in range(0, n - n % self.batch_size, self.batch_size):
            yield list(range(start, start + self.batch_size))

    def __len__(self) -> int:
        return len(self.sampler) // int(self.batch_size)  # type: ignore[arg-type]


def role_prompts(model: Any) -> tuple[str, str]:
    """The model's (query, document) prompts, "" where it has none: trained and scored as served."""
    p = getattr(model, "prompts", {}) or {}
    return p.get("query", ""), p.get("document", p.get("passage", ""))


def prompts_for(model: Any, columns: Sequence[str]) -> dict[str, str] | None:
    """The query prompt on the anchors, the document prompt on products."""
    query, doc = role_prompts(model)
    if not query and not doc:
        return None
    return {c: (query if c == "anchor" else doc) for c in columns}


def step_seconds(model: Any, loss: Any, data: Any, recipe: Recipe, *, steps: int = 3) -> float:
    """One training step's time (forward + backward of one batch), measured on the data itself;
    weights are not changed (no optimizer step). Sets how many steps fit a --minutes budget."""
    import torch

    batch = data.select(range(min(recipe.batch_size, len(data))))
    cols = list(batch.column_names)
    times = []
    model.train()
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        features = [model.tokenize(batch[c]) for c in cols]
        features = [{k: v.to(model.device) for k, v in f.items()} for f in features]
        value = loss(features, None)
        value.backward()
        times.append(time.perf_counter() - t0)
    for param in model.parameters():
        param.grad = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(times[1:])


def _last_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint: ours is the last file written to one (a run killed while
    saving leaves a partial folder, which is skipped)."""
    found = [p for p in out.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and (p / ELAPSED_FILE).is_file()]
    return max(found, key=lambda p: int(p.name.split("-")[-1]), default=None)


def train(model: Any, loss: Any, data: Any, recipe: Recipe, *, out: Path, max_steps: int, seed: int,
          save_steps: int, budget_s: float | None, progress: bool = True) -> Trained:
    """Train to `max_steps` (or until `budget_s` of training time, summed over resumes), resuming
    from the newest checkpoint in `out` when there is one."""
    import torch
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    gpu = torch.cuda.is_available()
    args = SentenceTransformerTrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=recipe.batch_size,
        learning_rate=recipe.learning_rate, warmup_ratio=recipe.warmup_ratio, lr_scheduler_type="linear",
        seed=seed, data_seed=seed, save_strategy="steps", save_steps=save_steps, save_total_limit=2,
        logging_steps=max(1, min(10, save_steps)), report_to="none", disable_tqdm=True,
        batch_sampler=InOrder, dataloader_num_workers=0, use_cpu=not gpu,
        bf16=gpu and torch.cuda.is_bf16_supported(), fp16=gpu and not torch.cuda.is_bf16_supported(),
        prompts=prompts_for(model, data.column_names), save_only_model=False)
    resume = _last_checkpoint(out)
    before = _elapsed(resume)
    callback = _Progress(max_steps, budget_s, before, progress)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss, callbacks=[callback])
    # Our bar says what the trainer's printed dicts and model-card examples would (and less noisily).
    from sentence_transformers.model_card import ModelCardCallback
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # type: ignore[no-untyped-call]
    trainer.remove_callback(ModelCardCallback)  # type: ignore[no-untyped-call]
    t0 = time.monotonic()
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        callback.close()
    seconds = before + time.monotonic() - t0
    return Trained(trainer.state.global_step, seconds, callback.loss, callback.stopped)


def progress(out: Path) -> tuple[int, float]:
    """Steps and training seconds done before this run, from the newest checkpoint in `out` (0, 0.0 without)."""
    last = _last_checkpoint(out) if out.is_dir() else None
    return (int(last.name.split("-")[-1]) if last is not None else 0), _elapsed(last)


def _elapsed(checkpoint: Path | None) -> float:
    if checkpoint is None or not (checkpoint / ELAPSED_FILE).exists():
        return 0.0
    return float(json.loads((checkpoint / ELAPSED_FILE).read_text())["seconds"])


class _Progress(TrainerCallback):
    """A tqdm bar (steps, loss, ETA), the time budget, and the training time kept with each checkpoint."""

    def __init__(self, total: int, budget_s: float | None, before: float, show: bool) -> None:
        self.total, self.budget_s, self.before, self.show = total, budget_s, before, show
        self.started = time.monotonic()
        self.bar: Any = None
        self.loss: float | None = None
        self.stopped = False

    def spent(self) -> float:
        return self.before + time.monotonic() - self.started

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        from tqdm import tqdm

        self.started = time.monotonic()
        self.bar = tqdm(total=self.total, initial=state.global_step, desc="tuning", unit="step",
                        disable=not self.show, dynamic_ncols=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
        if self.budget_s is not None and self.spent() >= self.budget_s and state.global_step < self.total:
            self.stopped = True
            control.should_training_stop = True
            control.should_save = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{self.loss:.4f}")

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if ckpt.is_dir():
            (ckpt / ELAPSED_FILE).write_text(json.dumps({"seconds": self.spent()}))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
