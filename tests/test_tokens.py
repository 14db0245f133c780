"""as_token_array: the one place caller token ids are validated, asserted exactly."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from akv.core.tokens import as_token_array
from akv.errors import InvalidTokens

VOCAB = 1000


class _Index:
    """An integer-like object: has ``__index__`` (as numpy and torch integer scalars do)."""

    def __init__(self, value: int, fail: bool = False) -> None:
        self.value, self.fail = value, fail

    def __index__(self) -> int:
        if self.fail:
            raise ValueError("boom")
        return self.value

    def __repr__(self) -> str:
        return "<bad index>" if self.fail else f"<{self.value}>"


@pytest.mark.parametrize("value", [0, 1, 5])
def test_integer_scalars_with_index_are_accepted_whatever_their_value(value) -> None:
    for scalar in (_Index(value), np.array(value), torch.tensor(value), np.int64(value)):
        assert as_token_array([scalar, 3], VOCAB).tolist() == [value, 3]
        # ... and on the checking path (another element is bad), only the bad one is named
        with pytest.raises(InvalidTokens, match=re.escape("token 2 is 2.5 (float), not an int")):
            as_token_array([scalar, 3, 2.5], VOCAB)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([5, True, 7], "token 1 is True (bool), not an int"),
        ((0, 3, False), "token 2 is False (bool), not an int"),
        ([1, np.True_], "token 1 is np.True_ (bool), not an int"),
        ([4, 2.0], "token 1 is 2.0 (float), not an int"),
        ([4, "2"], "token 1 is '2' (str), not an int"),
        ([4, None], "token 1 is None (NoneType), not an int"),
        ([4, 2**70], "token 1 is 1180591620717411303424, outside [0, 1000)"),
        ([5, 2**70, True], "token 1 is 1180591620717411303424, outside"),
        ([np.uint64(2**64 - 1), 3], "token 0 is 18446744073709551615, outside"),
        ([5, _Index(7, fail=True)], "token 1 is <bad index> (_Index), not an int"),
        ([4, -1], "token 1 is -1, outside"),
        ([4, VOCAB], f"token 1 is {VOCAB}, outside"),
    ],
)
def test_bad_lists_name_the_first_bad_position(tokens, message) -> None:
    with pytest.raises(InvalidTokens, match=re.escape(message)):
        as_token_array(tokens, VOCAB, what="prompt")


@given(st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1).map(np.int32)), min_size=1, max_size=50))
def test_lists_of_python_and_numpy_ints_convert_exactly(tokens) -> None:
    for given_tokens in (tokens, tuple(tokens)):
        arr = as_token_array(given_tokens, VOCAB)
        assert arr.dtype == np.int32 and arr.tolist() == [int(t) for t in tokens]


@given(st.lists(st.integers(0, 1), min_size=1, max_size=20), st.data())
def test_a_bool_among_zeros_and_ones_is_found(tokens, data) -> None:
    i = data.draw(st.integers(0, len(tokens) - 1))
    mixed = [*tokens[:i], bool(tokens[i]), *tokens[i + 1 :]]
    with pytest.raises(InvalidTokens, match=f"token {i} is (True|False) \\(bool\\)"):
        as_token_array(mixed, VOCAB)
