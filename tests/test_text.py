from __future__ import annotations

import re
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference.errors import InvalidInput
from inference.text import check_texts, normalize


def test_normalize_nfkc_whitespace_case() -> None:
    assert normalize("  Ｒunning\t\n SHOES ", lowercase=True) == "running shoes"
    assert normalize("ﬁne  Café", lowercase=False) == "fine Café"


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ([], "empty batch"),
        ([""], "text 0 is empty"),
        (["ok", "  \t"], "text 1 is empty"),
        (["ok", 3], "text 1 is a int"),
        (["x"] * 5, "over the maximum of 4"),
        (["ok", "caf\u00e9 \ud800"], "text 1 holds a lone surrogate .U.D800 at character 5"),
        (["\udfff"], "text 0 holds a lone surrogate"),
    ],
)
def test_bad_batches_get_clear_errors(texts: list[object], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        check_texts(texts, max_batch=4)


@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=60))
def test_ascii_fast_path_equals_the_general_rule(text: str) -> None:
    # normalize() skips NFKC and the regex for ASCII; the result must be what the general rule gives,
    # control characters and the ASCII separators (\x1c-\x1f) included.
    for lowercase in (True, False):
        general = re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip()
        assert normalize(text, lowercase=lowercase) == (general.lower() if lowercase else general)
