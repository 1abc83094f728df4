"""Text checks shared by every entry point: decoding, validation, normalisation for cache keys."""

from __future__ import annotations

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


def normalize(text: str, *, lowercase: bool) -> str:
    """NFKC, collapse whitespace, strip; lowercase when the tokenizer is uncased anyway.

    Two texts with the same normalised form tokenize identically, so this is a safe cache key.
    """
    # ASCII: NFKC leaves it as it is and str.split() splits on exactly what \s+ matches, so the
    # same result in ~2 µs instead of ~7 (this runs on every request, hits included).
    out = " ".join(text.split()) if text.isascii() else _SPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip()
    return out.lower() if lowercase else out


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
