from __future__ import annotations

import pytest

from inference.errors import InvalidInput
from inference.text import check_texts, decode_utf8, normalize


def test_normalize_nfkc_whitespace_case() -> None:
    assert normalize("  Ｒunning\t\n SHOES ", lowercase=True) == "running shoes"
    assert normalize("ﬁne  Café", lowercase=False) == "fine Café"


def test_decode_rejects_invalid_utf8() -> None:
    assert decode_utf8("café".encode()) == "café"
    with pytest.raises(InvalidInput, match="not valid UTF-8"):
        decode_utf8(b"caf\xe9")


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ([], "empty batch"),
        ([""], "text 0 is empty"),
        (["ok", "  \t"], "text 1 is empty"),
        (["ok", 3], "text 1 is a int"),
        (["x"] * 5, "over the maximum of 4"),
    ],
)
def test_bad_batches_get_clear_errors(texts: list[object], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        check_texts(texts, max_batch=4)
