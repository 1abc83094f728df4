"""Training pairs from the catalog alone (no labels): what a shopper would type -> a product.

Kinds, each weighted by the recipe (catalog/tuning/recipe.py):
- taxonomy:  a category value (aisle, department, category, ... with the parent before it) -> product
- head:      the title's last words without sizes ("frozen dessert sandwiches"): the noun a shopper types
- attribute: a dietary/attribute phrase of the title (dairy free, decaf, ...) + the head or the aisle.
             Aisle labels cannot see modifiers, so these pairs carry them ("dairy free ice cream sandwich")
- brand:     the brand field (where the rows have one) + the head
- prefix:    any of the above cut mid-word at 25-75 % of its characters -> the same product: typeahead
- title:     a title cut at 30-70 % of its characters -> the product (known-item typeahead)
With negatives (recipe.hard_negatives), each pair also names a product that must rank below its own:
for attribute pairs one of the same aisle without the attribute ("dairy free ice cream sandwich":
a dairy ice cream sandwich), for title cuts one of the same aisle whose title does not start with the
cut; every other kind gets one from another aisle, as the same aisle could be a right answer too (a
false negative teaches the model to push relevant products away).
The anchor repeats across products (many share an aisle): catalog/tuning/trainer.dataset keeps equal
texts out of one batch, where they would be false negatives for an in-batch loss.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from catalog.sources import Product, compose_text

TAXONOMY_FIELDS = ("department", "category", "subcategory", "aisle", "product_type", "type")
PLACEHOLDERS = {"", "missing", "other", "none", "n/a", "unknown"}
ATTRIBUTES = (
    "dairy free", "gluten free", "sugar free", "fat free", "nut free", "soy free", "egg free", "lactose free",
    "caffeine free", "alcohol free", "fragrance free", "grain free", "non dairy", "non gmo", "low sodium",
    "low fat", "low carb", "no salt added", "reduced sodium", "unsweetened", "unsalted", "decaf", "decaffeinated",
    "unscented", "vegan", "organic", "whole grain", "whole wheat", "sugar-free", "gluten-free", "dairy-free",
    "plant based", "keto", "kosher", "sugar free", "diet", "light", "lite", "spicy", "mild",
)
_ATTRIBUTE_RE = re.compile(r"\b(" + "|".join(sorted({re.escape(a) for a in ATTRIBUTES}, key=len, reverse=True))
                           + r")\b", re.IGNORECASE)
_SIZE_RE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:oz|fl oz|lb|lbs|ct|count|g|kg|ml|l|pk|pack|gallon|qt)\b\.?|\d+|[(),/&%-]",
                      re.IGNORECASE)
_WORD_RE = re.compile(r"[a-z][a-z']*")


@dataclass(frozen=True, slots=True)
class Pair:
    anchor: str  # what a shopper types
    positive: str  # the product's document text, as the catalog job embeds it
    kind: str
    product: str  # product id: the held-out split and the negatives need it
    negative: str = ""  # a product text that must rank below the positive (add_negatives)


def taxonomy_fields(products: Sequence[Product]) -> list[str]:
    """The category fields most rows carry (>= half), broadest first."""
    n = max(len(products), 1)
    return [f for f in TAXONOMY_FIELDS
            if sum(1 for p in products if p.fields.get(f, "").strip().lower() not in PLACEHOLDERS) * 2 >= n]


def head_words(title: str, n: int) -> str:
    """The last `n` words of the title without sizes, numbers and punctuation, lowercased."""
    words = _WORD_RE.findall(_SIZE_RE.sub(" ", title.lower()))
    return " ".join(words[-n:])


def attributes(title: str) -> list[str]:
    return sorted({m.group(1).lower().replace("-", " ") for m in _ATTRIBUTE_RE.finditer(title)})


def cut_mid_word(text: str, rng: random.Random, low: float, high: float) -> str | None:
    """`text` cut at a random share of its characters in [low, high], stripped; None when the cut
    would keep it whole or leave fewer than 2 characters."""
    n = math.ceil(len(text) * rng.uniform(low, high))
    out = text[:n].strip()
    return out if 2 <= len(out) < len(text.strip()) else None


def categories(p: Product, taxonomy: Sequence[str]) -> list[str]:
    """The product's category values, broadest first, lowercased, placeholders left out."""
    return [v.strip().lower() for f in taxonomy if (v := p.fields.get(f, "")).strip().lower() not in PLACEHOLDERS]


def aisle_of(p: Product, taxonomy: Sequence[str]) -> str:
    """The narrowest category value ("" where the product has none)."""
    values = categories(p, taxonomy)
    return values[-1] if values else ""


def _anchors(p: Product, taxonomy: Sequence[str], rng: random.Random) -> dict[str, list[str]]:
    title = p.fields.get("title", "")
    values = categories(p, taxonomy)
    out: dict[str, list[str]] = {"taxonomy": [], "head": [], "attribute": [], "brand": []}
    if values:
        out["taxonomy"].append(values[-1])  # the narrowest: the aisle
        if len(values) > 1:
            out["taxonomy"].append(" ".join(values[-2:]))  # parent + child
    head = head_words(title, rng.choice((1, 2, 2, 3)))
    if head and head != title.lower().strip():
        out["head"].append(head)
    for attr in attributes(title):
        noun = head_words(_ATTRIBUTE_RE.sub(" ", title), 2)
        if noun:
            out["attribute"].append(f"{attr} {noun}")
        if values:
            out["attribute"].append(f"{attr} {values[-1]}")
    if (brand := p.fields.get("brand", "").strip()) and head:
        out["brand"].append(f"{brand.lower()} {head}")
    return out


def draw(weight: float, rng: random.Random) -> int:
    """How many pairs of a kind with this weight: floor(weight), plus one with its fraction's chance."""
    whole = int(weight)
    return whole + (1 if rng.random() < weight - whole else 0)


def catalog_pairs(products: Sequence[Product], text_fields: Sequence[str], mix: Mapping[str, float], *,
                  seed: int) -> list[Pair]:
    """Pairs of every kind for each product, `mix[kind]` of them on average (deterministic by seed)."""
    rng = random.Random(seed)
    taxonomy = taxonomy_fields(products)
    pairs: list[Pair] = []
    for p in products:
        doc = compose_text(p.fields, text_fields)
        if not doc:
            continue
        anchors = _anchors(p, taxonomy, rng)
        for kind, options in anchors.items():
            for _ in range(draw(mix.get(kind, 0.0), rng) if options else 0):
                pairs.append(Pair(rng.choice(options), doc, kind, p.id))
        typed = [a for options in anchors.values() for a in options]
        for _ in range(draw(mix.get("prefix", 0.0), rng) if typed else 0):
            if (cut := cut_mid_word(rng.choice(typed), rng, 0.25, 0.75)) is not None:
                pairs.append(Pair(cut, doc, "prefix", p.id))
        title = p.fields.get("title", "")
        for _ in range(draw(mix.get("title", 0.0), rng) if title else 0):
            if (cut := cut_mid_word(title, rng, 0.3, 0.7)) is not None:
                pairs.append(Pair(cut, doc, "title", p.id))
    rng.shuffle(pairs)
    return pairs


WORDY = ("taxonomy", "head", "brand")  # kinds whose negative may share the anchor's words (word_negatives)


def add_negatives(pairs: Sequence[Pair], products: Sequence[Product], text_fields: Sequence[str], *,
                  seed: int, words: bool = False) -> list[Pair]:
    """Each pair with a negative product text (see the module's docstring); deterministic by seed.

    `words`: for taxonomy, head and brand pairs, prefer another aisle's product whose title holds
    every word of the anchor without ending with them ("greek yogurt" -> a greek yogurt ranch
    dressing): what a word match finds but a shopper typing the anchor did not mean."""
    rng = random.Random(seed)
    taxonomy = taxonomy_fields(products)
    by_id = {p.id: p for p in products}
    shelves: dict[str, list[Product]] = {}
    for p in products:
        shelves.setdefault(aisle_of(p, taxonomy), []).append(p)
    everyone = list(products)
    with_word: dict[str, set[int]] = {}
    if words:
        for i, p in enumerate(products):
            for w in set(_WORD_RE.findall(p.fields.get("title", "").lower())):
                with_word.setdefault(w, set()).add(i)

    out = []
    for pair in pairs:
        own = by_id.get(pair.product)
        aisle = aisle_of(own, taxonomy) if own is not None else ""
        shelf = shelves.get(aisle, everyone)
        neg: Product | None = None
        for _ in range(8 if aisle and pair.kind in ("attribute", "title") else 0):
            q = rng.choice(shelf)
            title = q.fields.get("title", "")
            if q.id == pair.product:
                continue
            if pair.kind == "attribute" and not set(attributes(pair.anchor)) <= set(attributes(title)):
                neg = q
                break
            if pair.kind == "title" and not title.casefold().startswith(pair.anchor.casefold()):
                neg = q
                break
        if neg is None and words and aisle and pair.kind in WORDY:
            neg = _sharing_words(pair.anchor, aisle, products, with_word, taxonomy, rng)
        for _ in range(8 if neg is None else 0):  # another aisle's product: never a right answer in disguise
            q = rng.choice(everyone)
            if aisle_of(q, taxonomy) != aisle:
                neg = q
                break
        text = compose_text(neg.fields, text_fields) if neg is not None else ""
        if text and text != pair.positive:
            out.append(dataclasses.replace(pair, negative=text))
    return out


def _sharing_words(anchor: str, aisle: str, products: Sequence[Product], with_word: dict[str, set[int]],
                   taxonomy: Sequence[str], rng: random.Random) -> Product | None:
    """A product of another aisle whose title holds every word of `anchor` but does not end with them
    (that would be the same thing shelved elsewhere: "organic bread crumbs"), or None."""
    words = _WORD_RE.findall(anchor.lower())
    if not words:
        return None
    rows = set.intersection(*(with_word.get(w, set()) for w in words))
    noun = " ".join(words)
    others = sorted(i for i in rows if aisle_of(products[i], taxonomy) != aisle
                    and head_words(products[i].fields.get("title", ""), len(words)) != noun)
    return products[rng.choice(others)] if others else None
