"""Text checks shared by every entry point: decoding, validation, normalisation for cache keys."""

from __future__ import annotations

import functools
import itertools
import re
import unicodedata
from collections.abc import Sequence

from inference.errors import InvalidInput

_SPACE = re.compile(r"\s+")


# The most one character can grow under NFKC (U+FDFA, 18 characters; UAX #15, "Stream-Safe").
NFKC_MAX_GROWTH = 18
# Past `limit`, NFKC runs on pieces of about this many characters: each call writes at most ~18k
# characters (~1 ms, holding the GIL) and the work stops once the result is long enough.
_PIECE = 1024
# What is kept beyond `limit`: the last characters of a cut text may differ from the whole text's
# (a final sigma lowercases by what follows it); a tokenizer that cuts at `limit` never reads them.
_SLACK = 16


# Stream-Safe Text Format (UAX #15, section 13): no real text holds more than 30 non-starters (canonical
# combining class != 0) in a row. NFKC puts a run in canonical order by insertion sort, quadratic in its
# length and holding the GIL (10,000 marks of alternating classes: ~100 ms), so a run is cut to this first.
MAX_MARK_RUN = 30


def _non_starters_only() -> list[int]:
    """Code points whose NFKD is non-starters only: the combining marks, and a few compatibility
    characters (U+FF9E to U+3099, U+0F73 to two marks). A run of these is one run for NFKC's sort; any
    other character's NFKD starts with a starter, which ends the run (and brings at most 3 non-starters
    after it). None is at or above U+20000 (tests/test_text_limits.py checks it for this Python's
    Unicode). ~30 ms, once, at import: not on a request's path."""
    chars = [chr(cp) for cp in range(0x20000)]
    out = set(itertools.compress(chars, map(unicodedata.combining, chars)))
    for ch in itertools.compress(chars, map(unicodedata.decomposition, chars)):
        if ch not in out and all(map(unicodedata.combining, unicodedata.normalize("NFKD", ch))):
            out.add(ch)
    return sorted(map(ord, out))


def _char_class(cps: list[int]) -> str:
    """The inside of a regex [...] holding exactly `cps` (sorted; none is a character [...] treats
    specially: they are all past U+02FF)."""
    ranges: list[list[int]] = []
    for cp in cps:
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    return "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in ranges)


NON_STARTERS = frozenset(_non_starters_only())
_ASTRAL = sorted(cp for cp in NON_STARTERS if cp >= 0x10000)
# Two scans because sre tests a character against a class's astral ranges one by one after its BMP
# bitmap: the exact class costs ~0.1 µs a character. The first (the BMP bitmap, then one range from
# the first astral mark to the last: no emoji, no CJK extension) costs ~10 ns and finds nothing in
# real text.
_MAYBE_LONG_RUN = re.compile(f"[{_char_class(sorted(cp for cp in NON_STARTERS if cp < 0x10000))}"
                             f"{chr(_ASTRAL[0])}-{chr(_ASTRAL[-1])}]{{{MAX_MARK_RUN + 1}}}")
_NON_STARTER = f"[{_char_class(sorted(NON_STARTERS))}]"
_LONG_RUN = re.compile(f"({_NON_STARTER}{{{MAX_MARK_RUN}}}){_NON_STARTER}+")


def cap_mark_runs(text: str) -> str:
    """`text` with each run of non-starters cut to its first MAX_MARK_RUN, in linear time.

    Stream-Safe inserts U+034F after every 30th instead; dropping the rest keeps every language
    (Vietnamese, Devanagari, vocalised Arabic and Hebrew stack a few marks) and Zalgo text of normal
    size as it was, and what a query holding thousands of marks loses is noise (or an attack)."""
    if len(text) <= MAX_MARK_RUN or not _MAYBE_LONG_RUN.search(text):
        return text
    return _LONG_RUN.sub(r"\1", text)


def normalize(text: str, *, lowercase: bool, limit: int | None = None) -> str:
    """Cut runs of combining marks (cap_mark_runs), NFKC, collapse whitespace, strip; lowercase when
    the tokenizer is uncased anyway.

    Two texts with the same normalised form tokenize identically, so this is a safe cache key.
    `limit`: the most characters the reader of the result uses (the tokenizer's cut,
    QueryTokenizer.max_text_chars): a text that may normalise to more is normalised only until the
    result holds over `limit` characters, so NFKC's growth cannot multiply the work; the result's
    first `limit` characters are the whole text's, and it is still longer than `limit` where the
    whole one is (the tokenizer flags it `truncated` as before).
    """
    # ASCII: NFKC leaves it as it is and str.split() splits on exactly what \s+ matches, so the
    # same result in ~2 µs instead of ~7 (this runs on every request, hits included).
    if text.isascii():
        out = " ".join(text.split())
    else:
        text = cap_mark_runs(text)  # before anything reads it: the sort below, _normalize_prefix's scan
        if limit is None or len(text) * NFKC_MAX_GROWTH <= limit:
            out = _SPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip()
        else:
            out = _normalize_prefix(text, limit + _SLACK)
    return out.lower() if lowercase else out


def _normalize_prefix(text: str, want: int) -> str:
    """normalize()'s NFKC and whitespace steps on as much of `text` as gives `want` characters.

    Pieces end where a new NFKC segment starts (`_starts_segment`), so NFKC of the pieces joined is
    NFKC of the text they cover: the result is the whole text's result cut to `want` characters."""
    pieces: list[str] = []
    got, start, n = 0, 0, len(text)
    while start < n and got < want:
        # As many characters as should give what is missing at the growth seen so far (one at first).
        growth = max(1.0, got / start) if start else 1.0
        end = min(n, start + min(_PIECE, int((want - got) / growth) + 1))
        while end < n and not _starts_segment(text[end]):
            end += 1
        piece = _SPACE.sub(" ", unicodedata.normalize("NFKC", text[start:end]))
        pieces.append(piece)
        got += len(piece) - 1  # -1: a space on either side of a joint may merge with the next piece's
        start = end
    out = _SPACE.sub(" ", "".join(pieces)).strip()
    return out if start == n else out[:want]


def _starts_segment(ch: str) -> bool:
    """NFKC(a + b) == NFKC(a) + NFKC(b) for any b starting with `ch`: `ch` decomposes to a starter
    (canonical combining class 0: nothing is reordered across it) that composes with nothing
    before it (UAX #15's boundary: ccc 0 and NFKC_Quick_Check Yes)."""
    if ch < "\x80":
        return True
    first = unicodedata.normalize("NFKD", ch)[0]
    return unicodedata.combining(first) == 0 and first not in _second_of_a_pair()


@functools.cache
def _second_of_a_pair() -> frozenset[str]:
    """Starters that compose with the character before them: the second of a canonical pair, and
    Hangul's medial vowel and final consonant jamo (composed by rule, not listed). ~25 ms, once,
    and only for a long non-ASCII text. Canonical decompositions end at U+2FA1D, the last CJK
    compatibility ideograph (tests/test_text_limits.py checks it for this Python's Unicode)."""
    out = {chr(c) for c in (*range(0x1161, 0x1176), *range(0x11A8, 0x11C3))}
    for cp in range(0x30000):
        d = unicodedata.decomposition(chr(cp))
        if d and d[0] != "<":
            pair = d.split()
            if len(pair) == 2 and unicodedata.combining(second := chr(int(pair[1], 16))) == 0:
                out.add(second)
    return frozenset(out)


def normalize_texts(texts: Sequence[str], *, lowercase: bool, limit: int | None, max_total: int) -> list[str]:
    """normalize() of each text; InvalidInput once the results hold over `max_total` characters,
    checked as they are made so the work stops there."""
    out: list[str] = []
    total = 0
    for i, t in enumerate(texts):
        norm = normalize(t, lowercase=lowercase, limit=limit)
        total += len(norm)
        if total > max_total:
            raise InvalidInput(f"the texts have over {max_total} characters after Unicode normalisation "
                               f"(reached at text {i}): send fewer or shorter texts")
        out.append(norm)
    return out


def check_unicode(text: str, what: str) -> None:
    """InvalidInput if `text` holds a lone surrogate (U+D800..U+DFFF).

    JSON escapes (`"\\ud800"`) can carry one into a str; it is not Unicode text, cannot be UTF-8
    encoded for the tokenizer or a gRPC call, and would otherwise surface as an internal error.
    """
    if text.isascii():  # the usual case, and a C-speed scan
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} holds a lone surrogate (U+{ord(text[exc.start]):04X} at character "
                           f"{exc.start}): not valid Unicode text") from exc


def check_texts(texts: Sequence[object], *, max_batch: int) -> list[str]:
    """An embedding call's texts: a non-empty batch of non-blank Unicode strings, at most `max_batch`."""
    if len(texts) == 0:
        raise InvalidInput("empty batch: send at least one text")
    if len(texts) > max_batch:
        raise InvalidInput(f"batch of {len(texts)} texts is over the maximum of {max_batch}")
    out: list[str] = []
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidInput(f"text {i} is a {type(t).__name__}, not a string")
        if not t.strip():
            raise InvalidInput(f"text {i} is empty or whitespace only")
        check_unicode(t, f"text {i}")
        out.append(t)
    return out
