"""Scale generator: realistic synthetic product titles in the millions, learnt from the real catalog.

Per aisle, a word-level Markov chain (order 1) over the real titles with their sizes taken out;
sizes ("12 oz", "6 ct") and pack counts come back as slots drawn from what that aisle's titles
use, and a flavour slot draws from words seen before "Flavor"/"Flavored". Deterministic by seed.
Every row carries `generated: "true"` so synthetic data is never mistaken for real data.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
import re
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from catalog.sources import Product, read_grocery
from inference.errors import InvalidInput

_START, _END = "\x02", "\x03"
_SIZE = re.compile(r"\b(\d+(?:\.\d+)?)\s?(oz|fl oz|fl\. oz|lb|lbs|ct|count|g|kg|ml|l|liter|gallon|qt|pk|pack)\b",
                   re.IGNORECASE)
_PACK = re.compile(r"\b(\d+)\s?(pack|pk|ct|count)\b", re.IGNORECASE)
_FLAVOR = re.compile(r"([A-Za-z]+)\s+Flavou?r(?:ed)?\b")
MAX_WORDS = 12
_COLUMNS = ("id", "title", "aisle", "department", "generated")


class _Chain:
    """Next-word sampler: state -> (words, cumulative weights)."""

    def __init__(self, sequences: Sequence[Sequence[str]]) -> None:
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        for words in sequences:
            for a, b in itertools.pairwise([_START, *words, _END]):
                counts[a][b] += 1
        self.table: dict[str, tuple[list[str], list[int]]] = {}
        for state, c in counts.items():
            words = sorted(c)  # sorted: the same seed gives the same titles on every machine
            self.table[state] = (words, list(itertools.accumulate(c[w] for w in words)))

    def walk(self, rng: random.Random) -> list[str]:
        out: list[str] = []
        state = _START
        while len(out) < MAX_WORDS:
            words, cum = self.table[state]
            state = words[bisect.bisect_right(cum, rng.random() * cum[-1])]
            if state == _END:
                break
            out.append(state)
        return out


@dataclass(slots=True)
class _AisleModel:
    aisle: str
    department: str
    chain: _Chain
    sizes: list[str]  # size strings seen in this aisle ("12 oz")
    size_rate: float  # share of titles with a size
    flavours: list[str]
    real: set[str]


class TitleGenerator:
    def __init__(self, products: Sequence[Product]) -> None:
        by_aisle: dict[str, list[Product]] = defaultdict(list)
        for p in products:
            if p.fields.get("title"):
                by_aisle[p.fields.get("aisle", "")].append(p)
        if not by_aisle:
            raise InvalidInput("the generator needs products with titles to learn from")
        self.models: list[_AisleModel] = []
        weights: list[int] = []
        for aisle in sorted(by_aisle):
            items = by_aisle[aisle]
            titles = [p.fields["title"] for p in items]
            sizes = [m.group(0) for t in titles for m in _SIZE.finditer(t)]
            seqs = [w for t in titles if (w := _SIZE.sub(" ", t).split())]
            # Flavours of this aisle only: "Catnip Flavor" belongs to pet food, not to pasta.
            flavours = sorted({m.group(1) for t in titles for m in _FLAVOR.finditer(t)
                               if m.group(1).lower() not in ("natural", "artificial", "no", "with")})
            self.models.append(_AisleModel(
                aisle=aisle, department=items[0].fields.get("department", ""), chain=_Chain(seqs),
                sizes=sizes, size_rate=sum(1 for t in titles if _SIZE.search(t)) / len(titles),
                flavours=flavours, real=set(titles)))
            weights.append(len(items))
        self.cum = list(itertools.accumulate(weights))

    @classmethod
    def from_grocery(cls) -> TitleGenerator:
        return cls(read_grocery().products)

    def rows(self, n: int, *, seed: int = 0, start: int = 0) -> Iterator[dict[str, str]]:
        """`n` synthetic products; the same seed and start give the same rows."""
        if n < 0:
            raise InvalidInput(f"cannot generate {n} rows")
        rng = random.Random(seed)
        for i in range(start, start + n):
            m = self.models[bisect.bisect_right(self.cum, rng.random() * self.cum[-1])]
            title = self._title(m, rng)
            yield {"id": f"gen-{seed}-{i:09d}", "title": title, "aisle": m.aisle, "department": m.department,
                   "generated": "true"}

    def _title(self, m: _AisleModel, rng: random.Random) -> str:
        words: list[str] = []
        for _ in range(5):  # a walk that reproduces a real title is retried: we want new products
            words = m.chain.walk(rng)
            if " ".join(words) not in m.real:
                break
        if m.flavours and rng.random() < 0.05:
            words = [*words, rng.choice(m.flavours), "Flavor"]
        if m.sizes and rng.random() < m.size_rate:
            words.append(rng.choice(m.sizes))
        elif rng.random() < 0.03:
            words.append(f"{rng.choice((2, 4, 6, 8, 12, 24))} Pack")
        return " ".join(words) or m.aisle.title()


def write_rows(rows: Iterator[dict[str, str]], out: Path, *, batch: int = 100_000) -> int:
    """Write generated rows as .jsonl or .parquet (streamed); returns the row count."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    n = 0
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer: Any = None
        try:
            while chunk := list(itertools.islice(rows, batch)):
                table = pa.Table.from_pylist(chunk)
                writer = writer or pq.ParquetWriter(tmp, table.schema)
                writer.write_table(table)
                n += len(chunk)
        finally:
            if writer is not None:
                writer.close()
        if writer is None:  # no rows: still a valid (empty) file
            pq.write_table(pa.table({k: pa.array([], pa.string()) for k in _COLUMNS}), tmp)
    elif out.suffix in (".jsonl", ".ndjson"):
        with tmp.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
    else:
        raise InvalidInput(f"{out}: write .jsonl or .parquet")
    tmp.replace(out)
    return n
