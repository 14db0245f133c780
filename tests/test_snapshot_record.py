"""The snapshot record: its consistency checks, namespace encoding, and the hottest-that-fit selection."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from akv.core.eviction_policy import lfu_key, lru_key, slru_key
from akv.errors import InvalidInput
from akv.storage.snapshot_demo import demo_blocks
from akv.storage.snapshot_record import COLUMNS, SnapshotBlocks, decode_namespace, encode_namespace, hottest_that_fit

VOCAB = 1000


def _replace(blocks: SnapshotBlocks, **columns: np.ndarray) -> SnapshotBlocks:
    fields = {name: getattr(blocks, name) for name in COLUMNS}
    fields.update(columns)
    return SnapshotBlocks(block_size=blocks.block_size, namespaces=blocks.namespaces, **fields)


def test_demo_record_is_consistent() -> None:
    blocks = demo_blocks(200, block_size=4, vocab_size=VOCAB)
    assert blocks.check(VOCAB) is None
    assert (blocks.parent >= 0).any() and (blocks.parent == -1).any()


def _broken(blocks: SnapshotBlocks, what: str) -> SnapshotBlocks:
    child = int(np.flatnonzero(blocks.parent >= 0)[0])
    if what == "forward parent":
        parent = blocks.parent.copy()
        parent[child] = child
        return _replace(blocks, parent=parent)
    if what == "namespace row":
        namespace = blocks.namespace.copy()
        namespace[0] = len(blocks.namespaces)
        return _replace(blocks, namespace=namespace)
    if what == "namespace of parent":
        namespace = blocks.namespace.copy()
        namespace[child] = (namespace[child] + 1) % len(blocks.namespaces)
        return _replace(blocks, namespace=namespace)
    if what == "token id":
        tokens = blocks.tokens.copy()
        tokens[3, 1] = VOCAB
        return _replace(blocks, tokens=tokens)
    if what == "num_hits":
        return _replace(blocks, num_hits=np.full_like(blocks.num_hits, -1))
    if what == "medium":
        return _replace(blocks, medium=np.full_like(blocks.medium, 2))
    tokens = blocks.tokens.copy()  # "key": tokens changed, keys kept
    tokens[child, 0] = (tokens[child, 0] + 1) % VOCAB
    return _replace(blocks, tokens=tokens)


@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("forward parent", "parent"),
        ("namespace row", "namespace row"),
        ("namespace of parent", "parent's namespace"),
        ("token id", "token id"),
        ("num_hits", "negative num_hits"),
        ("medium", "medium"),
        ("key", "key does not match"),
    ],
)
def test_check_names_each_inconsistency(what: str, says: str) -> None:
    problem = _broken(demo_blocks(50, block_size=4, vocab_size=VOCAB), what).check(VOCAB)
    assert problem is not None and says in problem


def test_columns_of_wrong_dtype_or_shape_are_invalid_input() -> None:
    blocks = demo_blocks(5, block_size=4, vocab_size=VOCAB)
    with pytest.raises(InvalidInput, match="parent"):
        _replace(blocks, parent=blocks.parent.astype(np.int32))
    with pytest.raises(InvalidInput, match="tokens"):
        _replace(blocks, tokens=blocks.tokens[:, :3].copy())
    with pytest.raises(InvalidInput, match="namespace"):
        SnapshotBlocks(block_size=4, namespaces=(1.5,), **{name: getattr(blocks, name) for name in COLUMNS})


plain = st.recursive(
    st.none() | st.integers() | st.text() | st.binary(),
    lambda inner: st.tuples(inner) | st.tuples(inner, inner) | st.lists(inner, max_size=3).map(tuple),
    max_leaves=8,
)


@given(plain)
def test_namespace_encoding_round_trips_to_the_same_value(value: object) -> None:
    back = decode_namespace(encode_namespace(value))
    assert back == value and repr(back) == repr(value)  # repr: 1 and True, b"" and "" differ


@pytest.mark.parametrize("bad", [["i", "1.5"], ["x", 1], ["t", [["n"], "s"]], ["s"], [], "s", ["i", 5]])
def test_bad_namespace_encodings_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        decode_namespace(bad)


# ------------------------------------------------------------------ hottest that fit
def _oracle(blocks: SnapshotBlocks, max_blocks: int, key) -> set[int]:
    """Evict, one at a time, the coldest block that no kept block names as parent (O(n^2))."""
    kept = set(range(blocks.num_blocks))
    while len(kept) > max_blocks:
        parents = {int(blocks.parent[row]) for row in kept}
        leaves = [row for row in kept if row not in parents]
        kept.remove(min(leaves, key=lambda r: (key(int(blocks.num_hits[r]), int(blocks.last_release[r])), -r)))
    return kept


@st.composite
def records(draw: st.DrawFn, monotone: bool) -> SnapshotBlocks:
    n = draw(st.integers(0, 40))
    blocks = demo_blocks(n, block_size=2, vocab_size=50, seed=draw(st.integers(0, 2**32 - 1)))
    if monotone:
        return blocks  # demo_blocks makes no parent colder than a child
    hits = np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=np.int64)
    releases = np.array(draw(st.lists(st.integers(0, 10), min_size=n, max_size=n)), dtype=np.int64)
    return _replace(blocks, num_hits=hits, last_release=releases)


KEYS = st.sampled_from([lru_key, lfu_key, slru_key])


@given(records(monotone=False), st.integers(0, 45), KEYS)
def test_kept_set_is_ancestor_closed_fits_and_follows_leaf_eviction(blocks, max_blocks: int, key) -> None:
    rows, dropped = hottest_that_fit(blocks, max_blocks, key)
    note(f"rows={rows.tolist()} parents={blocks.parent.tolist()}")
    kept = set(rows.tolist())
    assert len(kept) == min(blocks.num_blocks, max_blocks) and dropped == blocks.num_blocks - len(kept)
    assert all(blocks.parent[row] < 0 or int(blocks.parent[row]) in kept for row in kept)
    assert (np.diff(rows) > 0).all()
    assert kept == _oracle(blocks, max_blocks, key)
    sub = blocks.take(rows)
    assert sub.check(50) is None  # parents renumbered, keys still chain


@given(records(monotone=True), st.integers(0, 45), KEYS)
def test_kept_set_is_the_top_of_the_saved_order_when_parents_are_hotter(blocks, max_blocks: int, key) -> None:
    rows, _ = hottest_that_fit(blocks, max_blocks, key)
    order = [(key(int(h), int(r)), -row) for row, (h, r) in enumerate(zip(blocks.num_hits, blocks.last_release))]
    top = {-neg for _, neg in heapq.nlargest(max_blocks, order)}
    assert set(rows.tolist()) == top


def test_selection_pins_an_exact_order() -> None:
    # chain 0 <- 1 <- 2 and a second root 3 <- 4; lru: smallest last_release goes first
    blocks = demo_blocks(5, block_size=2, vocab_size=50)
    parent = np.array([-1, 0, 1, -1, 3], dtype=np.int64)
    namespace = np.zeros(5, dtype=np.int32)
    fixed = _replace(blocks, parent=parent, namespace=namespace, keys=blocks.keys)
    fixed = _replace(fixed, keys=fixed.recompute_keys(), last_release=np.array([9, 8, 2, 7, 5], dtype=np.int64))
    rows, dropped = hottest_that_fit(fixed, 3, lru_key)
    assert rows.tolist() == [0, 1, 3] and dropped == 2  # 2 (release 2) then 4 (release 5)


def test_bad_max_blocks_and_rows_are_invalid_input() -> None:
    blocks = demo_blocks(10, block_size=2, vocab_size=50)
    with pytest.raises(InvalidInput):
        hottest_that_fit(blocks, -1)
    with pytest.raises(InvalidInput):
        hottest_that_fit(blocks, True)
    child = int(np.flatnonzero(blocks.parent >= 0)[0])
    with pytest.raises(InvalidInput, match="ancestor-closed"):
        blocks.take(np.array([child], dtype=np.int64))
    with pytest.raises(InvalidInput, match="increasing"):
        blocks.take(np.array([2, 1], dtype=np.int64))
