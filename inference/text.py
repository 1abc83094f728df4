"""Text checks shared by every entry point: decoding, validation, normalisation for cache keys."""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence

from inference.errors import InvalidInput

_SPACE = re.compile(r"\s+")


def decode_utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"text is not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from exc


# The most one character can grow under NFKC (U+FDFA, 18 characters; UAX #15, "Stream-Safe").
NFKC_MAX_GROWTH = 18
# Past `limit`, NFKC runs on pieces of about this many characters: each call writes at most ~18k
# characters (~1 ms, holding the GIL) and the work stops once the result is long enough.
_PIECE = 1024
# What is kept beyond `limit`: the last characters of a cut text may differ from the whole text's
# (a final sigma lowercases by what follows it); a tokenizer that cuts at `limit` never reads them.
_SLACK = 16


def normalize(text: str, *, lowercase: bool, limit: int | None = None) -> str:
    """NFKC, collapse whitespace, strip; lowercase when the tokenizer is uncased anyway.

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
    elif limit is None or len(text) * NFKC_MAX_GROWTH <= limit:
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
