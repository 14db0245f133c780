"""KeyIndex: a shard's block ids to content keys, exactly chain_keys along a prompt; all or nothing on errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from akv.core.block_key import block_key, chain_keys
from akv.errors import InvalidInput
from akv.events import BlockRemoved, BlockStored, CachedKey, KeyIndex

BS = 4


def rows(tokens: list[int]) -> np.ndarray:
    return np.array(tokens, dtype=np.int32).reshape(-1, BS)


@given(
    prompt=st.lists(st.integers(0, 2**31 - 1), min_size=BS, max_size=6 * BS),
    split=st.integers(0, 6),
    namespace=st.one_of(st.none(), st.text(max_size=3), st.integers(), st.tuples(st.text(max_size=2), st.integers())),
    first=st.integers(0, 100),
)
def test_keys_are_chain_keys_of_the_prompt_however_the_blocks_are_published(prompt, split, namespace, first) -> None:
    """A prompt published in two calls (a prefill, then the rest) gets exactly ``chain_keys``."""
    n = len(prompt) // BS
    split = min(split, n)
    index = KeyIndex(16, BS, first_block_id=first)
    ids = [first + 15 - i for i in range(n)]  # any block ids: the key depends on the chain, not the id
    tokens = rows(prompt[: n * BS])
    parents = [None, *ids[:-1]]
    keys = index.stored(ids[:split], parents[:split], tokens[:split], [namespace] * split)
    keys += index.stored(ids[split:], parents[split:], tokens[split:], [namespace] * (n - split))
    assert keys == chain_keys(prompt, BS, namespace)
    assert [index.key(b) for b in ids] == keys
    assert len(index) == n
    assert list(index.cached()) == sorted(
        ((keys[i], keys[i - 1] if i else None, namespace, ids[i]) for i in range(n)), key=lambda c: c[3]
    )


def test_stored_events_group_each_chain_run_and_removed_events_name_the_keys() -> None:
    index = KeyIndex(16, BS)
    a, b = list(range(1, 13)), [*range(1, 9), 50, 51, 52, 53]  # b shares a's first two blocks
    ka, kb = chain_keys(a, BS, "ns"), chain_keys(b, BS, "ns")
    events = index.stored_events([0, 1, 2, 5, 7], [None, 0, 1, 1, None], rows(a + b[8:] + [9, 9, 9, 9]), ["ns"] * 5)
    assert events == [
        BlockStored(
            block_hashes=ka, parent_block_hash=None, token_ids=a, block_size=BS, medium="device", namespace="ns"
        ),
        BlockStored(
            block_hashes=[kb[2]],
            parent_block_hash=ka[1],
            token_ids=b[8:],
            block_size=BS,
            medium="device",
            namespace="ns",
        ),
        BlockStored(
            block_hashes=[block_key(None, [9] * 4, "ns")],
            parent_block_hash=None,
            token_ids=[9] * 4,
            block_size=BS,
            medium="device",
            namespace="ns",
        ),
    ]
    assert index.removed_events([5, 2], medium="host") == [BlockRemoved(block_hashes=[kb[2], ka[2]], medium="host")]
    assert index.removed_events([]) == []
    assert index.cached_keys() == [
        CachedKey(block_hash=ka[0], parent_block_hash=None, namespace="ns", medium="device"),
        CachedKey(block_hash=ka[1], parent_block_hash=ka[0], namespace="ns", medium="device"),
        CachedKey(block_hash=block_key(None, [9] * 4, "ns"), parent_block_hash=None, namespace="ns", medium="device"),
    ]
    assert index.clear() == 3 and len(index) == 0 and list(index.cached()) == []


def state(index: KeyIndex) -> list:
    return list(index.cached())


@pytest.mark.parametrize(
    ("ids", "parents", "tokens", "namespaces"),
    [
        ([3, 3], [None, None], rows([1] * 8), [None, None]),  # listed twice
        ([1, 2], [None, 9], rows([1] * 8), [None, None]),  # parent neither stored nor earlier
        ([1, 2], [2, None], rows([1] * 8), [None, None]),  # parent listed later
        ([1, 0], [None, None], rows([1] * 8), [None, None]),  # block 0 already stored
        ([16], [None], rows([1] * 4), [None]),  # not a block of the shard
        ([-1], [None], rows([1] * 4), [None]),
        ([1, 2], [None], rows([1] * 8), [None, None]),  # lengths differ
        ([1], [None], rows([1] * 8), [None]),  # rows shape
        ([1], [None], [[1, 2, 3, 4]], [None]),  # not an array
        ([1], [None], np.full((1, 4), 2**31, dtype=np.int64), [None]),
        ([1], [None], np.ones((1, 4)), [None]),  # floats
        ([1], [None], rows([1] * 4), [1.5]),  # not a plain namespace
        ([True], [None], rows([1] * 4), [None]),
        ("ab", [None, None], rows([1] * 8), [None, None]),
    ],
)
def test_bad_stored_calls_are_refused_and_index_nothing(ids, parents, tokens, namespaces) -> None:
    index = KeyIndex(16, BS)
    index.stored([0], [None], rows([5] * 4), ["ns"])
    before = state(index)
    with pytest.raises(InvalidInput):
        index.stored(ids, parents, tokens, namespaces)
    assert state(index) == before


def test_bad_removed_calls_are_refused_and_forget_nothing() -> None:
    index = KeyIndex(16, BS)
    index.stored([0, 1], [None, 0], rows([5] * 8), [None, None])
    before = state(index)
    for bad in ([1, 2], [1, 1], [16], [0.0], None):
        with pytest.raises(InvalidInput):
            index.removed(bad)
        assert state(index) == before
    for medium in ("", None):
        with pytest.raises(InvalidInput):
            index.removed_events([1], medium=medium)
        with pytest.raises(InvalidInput):
            index.stored_events([2], [1], rows([5] * 4), [None], medium=medium)
        assert state(index) == before
    with pytest.raises(InvalidInput):
        index.key(2)
    assert index.removed(np.array([1, 0])) == [index_key for index_key, *_ in reversed(before)]


def test_constructor_refuses_bad_sizes() -> None:
    for kwargs in (
        {"num_blocks": 0, "block_size": 4},
        {"num_blocks": 4, "block_size": 0},
        {"num_blocks": 4, "block_size": 4, "first_block_id": -1},
    ):
        with pytest.raises(InvalidInput):
            KeyIndex(**kwargs)
