"""`embedcar model tune`: registered under `embedcar model` through the `embedcar.model_commands`
entry point group (inference/ cannot import this layer). Imports torch only when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from catalog.settings import CatalogSettings
from catalog.tuning.recipe import LOSSES, Recipe, parse_mix
from inference.errors import InvalidInput
from inference.flags import add_flags, flag_overrides
from inference.settings import ModelSettings

_DEFAULT = Recipe()


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read {text!r} as a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is out of range: more than 0")
        return value
    return parse


def _dims(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--matryoshka takes dimensions like 384,256,128; got {text!r}") from None
    if any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError("--matryoshka dimensions are at least 1")
    return dims


def register(msub: Any) -> None:
    p = msub.add_parser(
        "tune", help="fine-tune a prepared model on your catalog (and query logs), gate it on held-out data, "
                     "publish it as a prepared model",
        description="Pairs from the catalog (categories, product nouns, attributes, half-typed queries) and from "
                    "--pairs (query -> product id, with clicks/orders) train the model with sentence-transformers; "
                    "held-out products and queries score base and tuned at 25/50/75/100 % of each query; a tuned "
                    "model worse than its base anywhere is not published. Resumable: run the same command again. "
                    "docs/models.md, 'Tune it to your catalog'.")
    add_flags(p, "model", ModelSettings, "models_dir", "name")
    p.add_argument("--catalog", required=True, metavar="INDEX_DIR|SOURCE",
                   help="an index root (its newest version's products), `grocery`, or a .jsonl/.csv/.parquet file")
    p.add_argument("--as", dest="tuned_name", required=True, metavar="NAME",
                   help="name of the tuned model (the same as --model: tuned in place, the base kept for rollback)")
    p.add_argument("--pairs", type=Path, default=None, metavar="FILE",
                   help="query log: query + product_id per row, optional clicks/orders/weight (JSONL, CSV, Parquet)")
    how_long = p.add_mutually_exclusive_group(required=True)
    p.add_argument("--judgements", type=Path, default=None, metavar="FILE",
                   help="labelled queries (query + product_id or category per row) the gate also scores, never "
                   "trained on; 'grocery': the demo catalog's shopper queries labelled by aisle")
    how_long.add_argument("--minutes", type=_positive(float), default=None,
                          help="minutes of training: the budget bounds the training alone. Scoring base and tuned "
                               "on the held-out sets, exporting and checking the tuned model, and --rollout's index "
                               "build come on top; the run prints its estimate of the whole as it starts")
    how_long.add_argument("--steps", type=_positive(int), default=None, help="training steps (batches)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the pairs and training (default 0)")
    p.add_argument("--force", action="store_true", help="publish even if the held-out gate fails (recorded)")
    p.add_argument("--rollout", type=Path, default=None, metavar="INDEX_DIR",
                   help="then build an index version with the tuned model in this index root")
    p.add_argument("--id-field", default="id", help="the catalog file's product id column")
    add_flags(p, "catalog", CatalogSettings, "text_fields", "index_root")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    r = p.add_argument_group("recipe (defaults: the measured winners)")
    r.add_argument("--mix", default="", metavar="KIND=W,...",
                   help="pairs per product by kind: " + ", ".join(f"{k}={v:g}" for k, v in _DEFAULT.mix.items()))
    r.add_argument("--learning-rate", type=_positive(float), default=_DEFAULT.learning_rate,
                   help=f"(default {_DEFAULT.learning_rate:g})")
    r.add_argument("--batch-size", type=_positive(int), default=_DEFAULT.batch_size,
                   help=f"pairs per step (default {_DEFAULT.batch_size})")
    r.add_argument("--max-seq-length", type=_positive(int), default=_DEFAULT.max_seq_length,
                   help=f"tokens per text in training (default {_DEFAULT.max_seq_length})")
    r.add_argument("--loss", choices=LOSSES, default=_DEFAULT.loss,
                   help="mnrl: MultipleNegativesRankingLoss; cached: its cached form (big batches in little memory)")
    r.add_argument("--matryoshka", type=_dims, default=(), metavar="D,D,...",
                   help="also train truncated dimensions (MatryoshkaLoss), for a smaller index")
    r.add_argument("--hard-negatives", action=argparse.BooleanOptionalAction, default=_DEFAULT.hard_negatives,
                   help="a negative product per pair: the same aisle without the attribute / another title for "
                        "attribute and title pairs, another aisle otherwise")
    r.add_argument("--word-negatives", action=argparse.BooleanOptionalAction, default=_DEFAULT.word_negatives,
                   help="with hard negatives: for aisle, noun and brand pairs, another aisle's product whose title "
                   "holds the typed words")
    r.add_argument("--freeze-layers", type=int, default=0, metavar="N", help="keep the lower N layers as they are")
    r.add_argument("--held-share", type=float, default=_DEFAULT.held_share,
                   help=f"share of products and logged queries held out (default {_DEFAULT.held_share:g})")
    r.add_argument("--distractors", type=int, default=_DEFAULT.distractors,
                   help=f"trained-on products held-out known items are searched among (default {_DEFAULT.distractors})")
    r.add_argument("--tolerance", type=float, default=_DEFAULT.tolerance,
                   help=f"how much worse than the base a held-out figure may be (default {_DEFAULT.tolerance:g})")
    r.add_argument("--mixes", default=",".join(f"{m:g}" for m in _DEFAULT.mixes),
                   help="shares of the tuning kept, base + a*(tuned - base), each scored on the gate; the best that "
                   "passes is published (default %(default)s; 1 = the tuned model as trained)")
    p.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    from catalog.settings import Settings
    from catalog.tuning.tune import Request, tune

    settings = Settings.load(overrides=flag_overrides(args))
    recipe = Recipe(mix=parse_mix(args.mix), learning_rate=args.learning_rate, batch_size=args.batch_size,
                    max_seq_length=args.max_seq_length, loss=args.loss, matryoshka=args.matryoshka,
                    hard_negatives=args.hard_negatives, word_negatives=args.word_negatives,
                    freeze_layers=args.freeze_layers,
                    held_share=args.held_share, distractors=args.distractors, tolerance=args.tolerance,
                    mixes=_mixes(args.mixes))
    req = Request(base=settings.model.name, catalog=args.catalog, name=args.tuned_name, recipe=recipe,
                  pairs=args.pairs, judgements=args.judgements, minutes=args.minutes, steps=args.steps,
                  seed=args.seed, force=args.force,
                  rollout=args.rollout, id_field=args.id_field, progress=not args.no_progress)
    tune(settings, req, say=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


def _mixes(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(m) for m in text.split(",") if m.strip())
    except ValueError:
        raise InvalidInput(f"--mixes takes numbers in (0, 1] separated by commas, got {text!r}") from None
