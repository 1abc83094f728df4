"""A synthetic catalog whose structure a random model cannot know: invented aisle names over
invented product nouns (the aisle's name never appears in its titles), brands and adjectives shared
by every aisle, some titles with an attribute. Tuning has to learn which nouns belong to which aisle
name; the held-out products show whether it did."""

from __future__ import annotations

import json
import random
from pathlib import Path

SYLLABLES = ("ka", "lo", "mi", "zu", "pe", "ri", "bo", "ta", "ne", "gu", "vi", "sho", "dra", "fle", "wum", "qui")
ATTRIBUTES = ("dairy free", "gluten free", "low sodium")


def _word(rng: random.Random, used: set[str]) -> str:
    while True:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3))))
        if w not in used:
            used.add(w)
            return w


def synthetic_catalog(path: Path, *, products: int = 480, aisles: int = 12, seed: int = 7) -> Path:
    """A JSONL catalog: id, title, aisle, department."""
    rng = random.Random(seed)
    used: set[str] = set()
    brands = [_word(rng, used).title() for _ in range(8)]
    adjectives = [_word(rng, used) for _ in range(6)]
    shelves = []
    for i in range(aisles):
        name = f"{_word(rng, used)} {_word(rng, used)}"
        nouns = [_word(rng, used) for _ in range(4)]
        shelves.append((name, f"dept{i % 4}", nouns))
    rows = []
    for pid in range(products):
        aisle, dept, nouns = shelves[pid % aisles]
        parts = [rng.choice(brands), rng.choice(adjectives)]
        if rng.random() < 0.2:
            parts.append(rng.choice(ATTRIBUTES))
        parts += [rng.choice(nouns), rng.choice(nouns)]
        rows.append({"id": f"p{pid}", "title": " ".join(parts), "aisle": aisle, "department": dept})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def catalog_words(path: Path) -> list[str]:
    """Every title and category of the catalog: what the tiny model's tokenizer is trained on."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [f"{r['title']} {r['aisle']} {r['department']}" for r in rows]
