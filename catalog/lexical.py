"""The lexical product index (tantivy): BM25 over the product text, the last typed word a prefix.

One tantivy index in the version folder (`lexical/`), one document per product row:

    row                 u64 fast field: the product's row in products.parquet (= its FAISS id)
    text                the analysed words of the indexed text (BM25 with term frequencies)
    prefix              every prefix of every word up to PREFIX_MAX_CHARS (edge n-grams): a partial
                        word is one term, so it costs one posting list and gets its own BM25 weight
    attrs               the product's attributes (catalog/attributes.py), one raw term each: a typed
                        attribute is matched as one term, never by its words apart
    filter0, filter1... the version's filter fields (catalog/filters.py), trimmed, lowercased,
                        untokenized: filters as term queries (versions built before filter fields
                        name them department, aisle)

Words come from one tantivy TextAnalyzer run here in Python, for documents and queries alike, and
the fields use tantivy's built-in whitespace/raw tokenizers: reading the index needs no custom
tokenizer registered, and the query side cannot drift from the index side. Queries are built from
those tokens as term queries, never by tantivy's query parser, so operators, quotes, `field:`
syntax or a lone `*` in a shopper's text are only characters.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import tantivy

from catalog.attributes import Typed, Vocabulary
from catalog.filters import DEFAULT_FIELDS, Filters, value_key
from catalog.sources import Product
from inference.errors import Internal, ModelError
from inference.text import check_unicode

LEXICAL_DIR = "lexical"
ANALYZER = "simple,remove_long(40),lowercase,ascii_fold"  # recorded in the manifest
PREFIX_MAX_CHARS = 20  # longer typed prefixes are cut to this: 20 shared letters pick out one word
MAX_QUERY_WORDS = 32  # a 10,000-character text must not become a 2,000-clause query
ATTRS = "attrs"
_WRITER_HEAP = 64_000_000  # the writer flushes a segment whenever this fills

I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]


def _analyzer() -> tantivy.TextAnalyzer:
    return (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
            .filter(tantivy.Filter.remove_long(40))
            .filter(tantivy.Filter.lowercase())
            .filter(tantivy.Filter.ascii_fold())
            .build())


_ANALYZER = _analyzer()


def words(text: str) -> list[str]:
    """Lowercased, ASCII-folded alphanumeric words: `"Crème-Brûlée" 2%` -> creme, brulee, 2."""
    return _ANALYZER.analyze(text)


def edge_ngrams(ws: Sequence[str]) -> list[str]:
    """Every prefix (1..PREFIX_MAX_CHARS characters) of every word, each once."""
    return list(dict.fromkeys(w[:n] for w in ws for n in range(1, min(len(w), PREFIX_MAX_CHARS) + 1)))


@dataclass(frozen=True, slots=True)
class Terms:
    """What a query text searches: whole words, and the last word as a prefix while it is being typed."""

    words: tuple[str, ...]
    prefix: str | None

    @classmethod
    def of(cls, text: str) -> Terms:
        check_unicode(text, "query text")  # a lone surrogate cannot cross into tantivy
        ws = words(text)[:MAX_QUERY_WORDS]
        if not ws:
            return cls((), None)
        # A trailing space means the shopper finished the word: then every word is whole.
        if text[-1:].isspace():
            return cls(tuple(dict.fromkeys(ws)), None)
        return cls(tuple(dict.fromkeys(ws[:-1])), ws[-1][:PREFIX_MAX_CHARS])


def _filter_names(n: int) -> list[str]:
    """Tantivy's names for the filter fields: a column's own name may be anything a file allows."""
    return [f"filter{i}" for i in range(n)]


def _schema(filter_names: Sequence[str]) -> tantivy.Schema:
    sb = tantivy.SchemaBuilder()
    sb.add_unsigned_field("row", fast=True)
    sb.add_text_field("text", tokenizer_name="whitespace", index_option="freq")
    sb.add_text_field("prefix", tokenizer_name="whitespace", index_option="freq")
    sb.add_text_field(ATTRS, tokenizer_name="raw", index_option="basic")
    for name in filter_names:
        sb.add_text_field(name, tokenizer_name="raw", index_option="basic")
    return sb.build()


def build_lexical(path: Path, texts: Sequence[str], products: Sequence[Product],
                  filter_fields: Sequence[str] = (), attributes: Vocabulary | None = None) -> dict[str, Any]:
    """Write the lexical index of `products` (row i = texts[i], the same text FAISS embedded) into
    the empty folder `path`; returns its manifest entry. `attributes`: the version's vocabulary."""
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    names = _filter_names(len(filter_fields))
    index = tantivy.Index(_schema(names), path=str(path), reuse=False)
    writer = index.writer(heap_size=_WRITER_HEAP, num_threads=1)
    for row, (text, product) in enumerate(zip(texts, products, strict=True)):
        ws = words(text)
        doc = tantivy.Document()
        doc.add_unsigned("row", row)
        doc.add_text("text", " ".join(ws))
        doc.add_text("prefix", " ".join(edge_ngrams(ws)))
        for a in attributes.carried(ws) if attributes else ():
            doc.add_text(ATTRS, a)
        for name, field in zip(names, filter_fields, strict=True):
            if value := value_key(product.fields.get(field, "")):
                doc.add_text(name, value)
        writer.add_document(doc)
    writer.commit()
    writer.wait_merging_threads()
    for f in path.iterdir():  # tantivy writes meta.json 0600: readable by the sidecar's user like the rest
        f.chmod(0o644)
    return {"dir": LEXICAL_DIR, "docs": len(texts), "analyzer": ANALYZER, "prefix_max_chars": PREFIX_MAX_CHARS,
            "filter_fields": list(filter_fields), "attributes": sorted(attributes.attributes) if attributes else [],
            "tantivy": importlib.metadata.version("tantivy"),
            "build_seconds": round(time.perf_counter() - t0, 3)}


@dataclass(frozen=True, slots=True)
class LexicalHits:
    rows: I64  # best first
    scores: F32  # BM25
    complete: frozenset[int]  # rows of the best k that match every word and the prefix
    terms: int = 0  # words and prefix searched: with 1, every hit matches every word (the fusion's one-word tier)
    attributes: tuple[str, ...] = ()  # the attributes typed in full: every hit carries them


class LexicalIndex:
    """One version's lexical index, read-only; thread-safe (tantivy searchers are)."""

    def __init__(self, index: tantivy.Index, docs: int, filter_fields: Sequence[str] | None = None,
                 vocabulary: Vocabulary | None = None) -> None:
        self._schema = index.schema
        self._searcher = index.searcher()
        self.docs = docs
        self.vocabulary = vocabulary or Vocabulary(())  # empty: built before attributes
        self._carriers: dict[str, frozenset[int]] = {}
        # column -> tantivy field; None: built before filter fields, which named the fields themselves
        fields = DEFAULT_FIELDS if filter_fields is None else filter_fields
        names = DEFAULT_FIELDS if filter_fields is None else _filter_names(len(fields))
        self._filters = dict(zip(fields, names, strict=True))

    @classmethod
    def open(cls, version_dir: Path, entry: dict[str, Any]) -> LexicalIndex:
        path = version_dir / str(entry.get("dir", LEXICAL_DIR))
        if entry.get("analyzer") != ANALYZER or entry.get("prefix_max_chars") != PREFIX_MAX_CHARS:
            raise ModelError(f"lexical index of {version_dir.name} was analysed as {entry.get('analyzer')!r} "
                             f"(prefixes of {entry.get('prefix_max_chars')}), this code queries as {ANALYZER!r} "
                             f"({PREFIX_MAX_CHARS}): rebuild it with `embedcar catalog build`")
        try:
            index = tantivy.Index.open(str(path))
            # The version is immutable: no reload policy, so no watcher thread per loaded version.
            index.config_reader(reload_policy="manual")
            out = cls(index, int(entry.get("docs", -1)), entry.get("filter_fields"),
                      Vocabulary(entry.get("attributes") or ()))
        except (OSError, ValueError) as exc:
            raise ModelError(f"lexical index of {version_dir.name} is unreadable: {exc}") from exc
        if out._searcher.num_docs != out.docs:
            raise ModelError(f"lexical index of {version_dir.name} holds {out._searcher.num_docs} documents, "
                             f"its manifest says {out.docs}")
        return out

    def typed(self, terms: Terms) -> Typed:
        """The attributes `terms` type in full, and the words left to match as words."""
        return self.vocabulary.typed(terms.words, terms.prefix) if self.vocabulary else Typed((), terms.words,
                                                                                               terms.prefix)

    def queries(self, terms: Terms, filters: Filters = ()) -> tuple[tantivy.Query, tantivy.Query | None] | None:
        """(any word: BM25 over the words with the prefix as one more term; every word: the same
        clauses all required, None when there is one), filtered; filters must match and do not score.
        A typed attribute is required by both, as one term: its words are not searched apart.
        None when the text has nothing to search."""
        term = tantivy.Query.term_query
        typed = self.typed(terms)
        clauses = [term(self._schema, "text", w) for w in typed.words]
        if typed.prefix is not None:
            clauses.append(term(self._schema, "prefix", typed.prefix))
        attrs = [term(self._schema, ATTRS, a) for a in typed.attributes]
        if not clauses and not attrs:
            return None
        musts = [(tantivy.Occur.Must, tantivy.Query.const_score_query(term(self._schema, self._filters[f], v), 0.0))
                 for f, v in filters]
        musts += [(tantivy.Occur.Must, a) for a in attrs]
        if not clauses:  # only attributes typed: the products carrying them all
            return tantivy.Query.boolean_query(musts), None

        def filtered(q: tantivy.Query) -> tantivy.Query:
            return tantivy.Query.boolean_query([(tantivy.Occur.Must, q), *musts]) if musts else q

        any_word = filtered(tantivy.Query.boolean_query([(tantivy.Occur.Should, c) for c in clauses]))
        if len(clauses) == 1:
            return any_word, None
        return any_word, filtered(tantivy.Query.boolean_query([(tantivy.Occur.Must, c) for c in clauses]))

    def search(self, text: str, k: int, *, filters: Filters = ()) -> LexicalHits:
        """The best `k` products for one query text by BM25, which of the best `k` matching every word
        there are and how many words (the prefix one) were searched, for the fusion; empty when the
        text has no word (punctuation only, say)."""
        terms = Terms.of(text)
        qs = self.queries(terms, filters)
        if qs is None or k < 1:
            return LexicalHits(np.zeros(0, np.int64), np.zeros(0, np.float32), frozenset())
        any_word, every_word = qs
        rows, scores = self._top(any_word, k)
        complete = frozenset(rows.tolist()) if every_word is None else frozenset(self._top(every_word, k)[0].tolist())
        typed = self.typed(terms)
        searched = len(typed.words) + len(typed.attributes) + (typed.prefix is not None)
        return LexicalHits(rows, scores, complete, searched, typed.attributes)

    def carrying(self, attributes: Sequence[str]) -> frozenset[int] | None:
        """The rows carrying every one of `attributes`; None for none typed."""
        if not attributes:
            return None
        return frozenset.intersection(*(self.carriers(a) for a in attributes))

    def carriers(self, attribute: str) -> frozenset[int]:
        """The rows carrying `attribute` (cached: the fusion asks for the same few again and again)."""
        hit = self._carriers.get(attribute)
        if hit is None:
            q = tantivy.Query.term_query(self._schema, ATTRS, attribute)
            hit = self._carriers[attribute] = frozenset(self._top(q, max(self.docs, 1))[0].tolist())
        return hit

    def _top(self, q: tantivy.Query, k: int) -> tuple[I64, F32]:
        try:
            found = self._searcher.search(q, k, count=False).hits
            rows = self._searcher.fast_field_values("row", [addr for _s, addr in found]) if found else []
        except (ValueError, RuntimeError) as exc:
            raise Internal(f"lexical search failed: {exc}") from exc
        return np.asarray(rows, dtype=np.int64), np.asarray([s for s, _a in found], dtype=np.float32)
