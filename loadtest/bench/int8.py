"""int8 schemes compared in one run: latency, quality against fp32, and batch independence.

    .venv/bin/python -m loadtest.bench.int8 [--model-dir models/all-MiniLM-L6-v2] [--out var/bench/int8]
    .venv/bin/python -m loadtest.bench.int8 --write-calibration inference/int8_calibration.txt

Every candidate is built here from the prepared model's fp32 graph, so the comparison does not
depend on which scheme `model prepare` chose:
- dynamic: ORT dynamic quantization (per-tensor u8 activations, ranged per call) — the old default;
- static: the served scheme (inference/export.quantize_int8): the dynamic graph's kernels, inputs
  from layer norms smoothed (SmoothQuant), activation ranges calibrated once;
- static-qdq: ORT's quantize_static, QDQ, per-channel weights, MinMax on the same calibration texts.
fp32 is the reference. Latency: real short queries (8-16 tokens) at exact length, batch 1 and 32,
1 and 2 threads, variants alternated round by round, medians. Quality: each held-out text alone
against fp32 (min/mean cosine) and recall@10 of a catalog sample against fp32's top 10.
Batch independence: each held-out text alone vs inside a batch of 32 mixed texts padded to its longest.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from inference import export, runtimes
from inference.embedder import load_tokenizer
from inference.head import Head
from inference.manifest import Manifest, load_manifest
from inference.tokenizer import QueryTokenizer

Array = npt.NDArray[np.float32]
CANDIDATES = ("dynamic", "static", "static-qdq")
ROOT = Path(__file__).resolve().parents[2]


# --- texts ----------------------------------------------------------------------------------
def write_calibration(path: Path, tok: QueryTokenizer, *, seed: int = 7) -> None:
    """The calibration file export.quantize_int8 reads: catalog titles, title fragments (what a
    shopper types) and generated shopper queries, all from the grocery catalog, seeded."""
    from catalog.calibration import fragment
    from loadtest.queries import QueryMix, load_products

    rng = random.Random(seed)
    titles = [p.name for p in rng.sample(load_products(), 400)]
    frags = [f for t in titles[200:] if (f := fragment(t, rng))][:150]
    queries = QueryMix(tok, seed=seed, repeat_share=0.0, pool_size=1, min_tokens=6, max_tokens=24).take(150)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    lines = [f"# int8 activation calibration texts: q = shopper query, d = catalog title. Made by "
             f"`python -m loadtest.bench.int8 --write-calibration {shown}` (grocery catalog, seed {seed}).",
             *(f"d\t{t}" for t in titles[:200]), *(f"q\t{q}" for q in [*frags, *queries])]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def held_out(tok: QueryTokenizer, n_titles: int = 200) -> tuple[list[str], list[str]]:
    """(queries, titles) kept apart from the calibration file: the hand-written typist queries,
    generated queries of another seed, and other catalog titles."""
    from loadtest.queries import QueryMix, load_products

    calib = export.calibration_texts()
    seen = set(calib["query"]) | set(calib["document"])
    typist = [t.strip() for t in (Path(__file__).parent / "typist_queries.txt").read_text().splitlines()
              if t.strip() and not t.startswith("#")]
    mixed = QueryMix(tok, seed=99, repeat_share=0.0, pool_size=1, min_tokens=8, max_tokens=16).take(150)
    rng = random.Random(99)
    titles = [p.name for p in rng.sample(load_products(), n_titles * 2) if p.name not in seen][:n_titles]
    return [q for q in [*typist, *mixed] if q not in seen], titles


# --- candidates -----------------------------------------------------------------------------
def _feeds(model_dir: Path, m: Manifest, batch: int = 32) -> Iterator[export.Feed]:
    texts = export.calibration_texts()
    for role in ("query", "document"):
        tok = load_tokenizer(model_dir, m, role=role)
        ids = sorted(tok.encode(texts[role]).ids, key=len)
        for i in range(0, len(ids), batch):
            yield {k: v for k, v in tok.batch(ids[i : i + batch]).arrays().items() if k in m.inputs}


def build(name: str, fp32: Path, out: Path, model_dir: Path, m: Manifest) -> Path:
    path = out / f"model.{name}.onnx"
    if name == "dynamic":
        export.quantize_dynamic_int8(fp32, path)
    elif name == "static":
        export.quantize_int8(fp32, path, list(_feeds(model_dir, m)))
    elif name == "static-qdq":
        _static_qdq(fp32, path, model_dir, m)
    else:
        raise ValueError(name)
    return path


def _static_qdq(fp32: Path, out: Path, model_dir: Path, m: Manifest) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.it = _feeds(model_dir, m)

        def get_next(self) -> dict[str, Any] | None:
            return next(self.it, None)

    quantize_static(str(fp32), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    extra_options={"MatMulConstBOnly": True})


# --- measuring ------------------------------------------------------------------------------
class Runner:
    """One variant's graph at one thread count, with the model's head."""

    def __init__(self, path: Path, threads: int, head: Head, inputs: Sequence[str]) -> None:
        self.graph = runtimes.OrtGraph(path, threads)
        self.head = head
        self.inputs = inputs

    def embed(self, tok: QueryTokenizer, ids: Sequence[Sequence[int]], exact: bool = True) -> Array:
        batch = tok.batch(ids, max(len(x) for x in ids) if exact else None)
        hidden = self.graph.hidden({k: v for k, v in batch.arrays().items() if k in self.inputs})
        return self.head(hidden, batch.attention_mask, input_ids=batch.input_ids, skip=batch.pool_skip)

    def alone(self, tok: QueryTokenizer, ids: Sequence[Sequence[int]]) -> Array:
        return np.vstack([self.embed(tok, [x]) for x in ids])


def _unit(a: Array) -> Array:
    return np.asarray(a / np.linalg.norm(a, axis=1, keepdims=True), dtype=np.float32)


def batch_drift(r: Runner, tok: QueryTokenizer, ids: list[list[int]], ref: Array, seed: int = 3) -> dict[str, float]:
    """Each text alone vs in a batch of 32 random mates, padded to the batch's longest; and the
    in-batch vectors' smallest cosine to fp32's `ref` (what a batched query or product gets)."""
    alone = _unit(r.alone(tok, ids))
    rng = random.Random(seed)
    order = list(range(len(ids)))
    rng.shuffle(order)
    inside = np.empty_like(alone)
    for i in range(0, len(order), 32):
        part = order[i : i + 32]
        inside[part] = _unit(r.embed(tok, [ids[j] for j in part]))
    return {"batch_max_abs": float(np.abs(inside - alone).max()),
            "batch_min_cos": float((inside * alone).sum(axis=1).min()),
            "in_batch_min_cos": float(export.cosines(inside, ref).min())}


def recall_at_10(q: Array, docs: Array, q_ref: Array, docs_ref: Array) -> float:
    """Share of fp32's top 10 (its own vectors) that the variant's top 10 (its own vectors) keeps."""
    def top(a: Array, b: Array) -> npt.NDArray[np.int64]:
        return np.argsort(-(_unit(a) @ _unit(b).T), axis=1)[:, :10]

    got, want = top(q, docs), top(q_ref, docs_ref)
    return float(np.mean([len(set(g) & set(w)) / 10 for g, w in zip(got, want, strict=True)]))


def embed_catalog(r: Runner, tok: QueryTokenizer, ids: list[list[int]], batch: int = 64) -> Array:
    """The catalog job's way: batches of similar length, padded to their bucket."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    parts = [(order[i : i + batch], r.embed(tok, [ids[k] for k in order[i : i + batch]], exact=False))
             for i in range(0, len(order), batch)]
    out = np.empty((len(ids), parts[0][1].shape[1]), dtype=np.float32)
    for idx, emb in parts:
        out[idx] = emb
    return out


def time_round(fn: Callable[[], object], reps: int) -> float:
    """Median ms of `reps` calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def run(model_dir: Path, out: Path, *, candidates: Sequence[str], rounds: int, reps: int, products: int,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    m = load_manifest(model_dir)
    head = Head.from_manifest(model_dir, m)
    qtok, dtok = load_tokenizer(model_dir, m, role="query"), load_tokenizer(model_dir, m, role="document")
    out.mkdir(parents=True, exist_ok=True)
    fp32 = model_dir / m.variant("fp32").file
    paths: dict[str, Path] = {"fp32": fp32}
    built: dict[str, Any] = {"fp32": {"seconds": 0.0}}
    for name in candidates:
        t0 = time.perf_counter()
        try:
            paths[name] = build(name, fp32, out, model_dir, m)
            built[name] = {"seconds": round(time.perf_counter() - t0, 1)}
            say(f"built {name} in {built[name]['seconds']} s")
        except Exception as exc:  # a scheme ORT cannot apply to this graph is a row, not a crash
            built[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            say(f"{name}: cannot build ({built[name]['error']})")
    names = list(paths)

    queries, titles = held_out(qtok)
    q_ids, t_ids = qtok.encode(queries).ids, dtok.encode(titles).ids
    short = [x for x in q_ids if 8 <= len(x) <= 16]
    results: dict[str, dict[str, Any]] = {n: dict(built[n]) for n in names}

    # Quality and batch independence, at 2 threads.
    two = {n: Runner(paths[n], 2, head, m.inputs) for n in names}
    ref_q, ref_t = two["fp32"].alone(qtok, q_ids), two["fp32"].alone(dtok, t_ids)
    from loadtest.queries import load_products

    rng = random.Random(11)
    cat_ids = dtok.encode([p.name for p in rng.sample(load_products(), products)]).ids
    cat: dict[str, Array] = {}
    for n in names:
        r = two[n]
        cos = np.concatenate([export.cosines(r.alone(qtok, q_ids), ref_q), export.cosines(r.alone(dtok, t_ids), ref_t)])
        results[n].update(min_cos=float(cos.min()), mean_cos=float(cos.mean()), held=int(cos.size))
        results[n].update(batch_drift(r, qtok, q_ids, ref_q))
        t0 = time.perf_counter()
        cat[n] = embed_catalog(r, dtok, cat_ids)
        results[n]["catalog_s"] = round(time.perf_counter() - t0, 1)
        results[n]["recall_at_10"] = recall_at_10(r.alone(qtok, q_ids), cat[n], ref_q, cat["fp32"])
        say(f"{n}: min cos {results[n]['min_cos']:.4f}, batch max abs {results[n]['batch_max_abs']:.1e}, "
            f"recall@10 {results[n]['recall_at_10']:.3f}")

    # Latency: variants alternated within each round, the order rotated from round to round.
    batch1 = [[x] for x in short[:reps]]
    batch32 = short[:32]
    runners = {(n, t): (two[n] if t == 2 else Runner(paths[n], t, head, m.inputs)) for n in names for t in (1, 2)}
    samples: dict[str, list[float]] = {}
    for rnd in range(rounds):
        for k in range(len(names)):
            n = names[(k + rnd) % len(names)]
            for t in (1, 2):
                r = runners[(n, t)]
                queue = iter(batch1 * 1000)

                def one(r: Runner = r, queue: Iterator[list[list[int]]] = queue) -> object:
                    return r.embed(qtok, next(queue))

                def many(r: Runner = r) -> object:
                    return r.embed(qtok, batch32)

                samples.setdefault(f"{n}|{t}|1", []).append(time_round(one, reps))
                samples.setdefault(f"{n}|{t}|32", []).append(time_round(many, max(5, reps // 10)))
    for key, vals in samples.items():
        name, threads, b = key.split("|")
        results[name][f"ms_b{b}_t{threads}"] = float(np.median(vals))
    return {"date": dt.date.today().isoformat(), "commit": _commit(), "machine": _machine(),
            "model": m.name, "fp32_file": fp32.name, "rounds": rounds, "reps": reps, "products": products,
            "held": {"queries": len(queries), "titles": len(titles), "short_queries": len(short)},
            "variants": results}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> str:
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"{report['date']}, commit `{report['commit']}`, {report['machine']}; held-out: "
             f"{report['held']['queries']} queries + {report['held']['titles']} titles; recall@10 over "
             f"{report['products']} catalog titles; latency: medians of {report['rounds']} alternating rounds "
             f"({report['reps']} batch-1 calls of {report['held']['short_queries']} real 8-16-token queries; "
             "batch 32 padded to its longest).",
             "",
             "| variant | b1 1 thr ms | b1 2 thr ms | b32 1 thr ms | b32 2 thr ms | min cos alone | mean cos alone | "
             "min cos in a batch | recall@10 | alone vs batch: max abs | min cos |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, r in report["variants"].items():
        if "error" in r:
            lines.append(f"| {n} | not built: {r['error'][:120]} |" + " |" * 9)
            continue
        lines.append(f"| {n} | {r['ms_b1_t1']:.2f} | {r['ms_b1_t2']:.2f} | {r['ms_b32_t1']:.1f} | {r['ms_b32_t2']:.1f} "
                     f"| {r['min_cos']:.4f} | {r['mean_cos']:.5f} | {r['in_batch_min_cos']:.4f} "
                     f"| {r['recall_at_10']:.3f} | "
                     f"{r['batch_max_abs']:.1e} | {r['batch_min_cos']:.6f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.int8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=ROOT / "models" / "all-MiniLM-L6-v2")
    p.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "int8")
    p.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated: " + ", ".join(CANDIDATES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=60, help="batch-1 calls per round and variant (batch 32: reps/10)")
    p.add_argument("--products", type=int, default=5000, help="catalog titles for recall@10")
    p.add_argument("--write-calibration", type=Path, default=None, metavar="FILE",
                   help="write the calibration texts file and exit")
    args = p.parse_args(argv)
    if args.write_calibration is not None:
        m = load_manifest(args.model_dir)
        write_calibration(args.write_calibration.resolve(), load_tokenizer(args.model_dir, m))
        return 0
    report = run(args.model_dir, args.out, candidates=[c for c in args.candidates.split(",") if c],
                 rounds=args.rounds, reps=args.reps, products=args.products)
    (args.out / "int8.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (args.out / "int8.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
