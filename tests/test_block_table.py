"""BlockTables: released rows give their blocks deepest first and come back padded with the null block."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.core import block_table
from akv.core.block_table import BlockTables
from akv.core.shard_state import ShardState

NULL = 10_001  # a pad id outside the drawn block ids


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(1, 10_000), max_size=40), min_size=1, max_size=40),
    data=st.data(),
    sliced_max=st.sampled_from([0, block_table._SLICED_ROWS_MAX]),
)
def test_release_many_returns_each_row_deepest_first(rows, data, sliced_max: int) -> None:
    saved, block_table._SLICED_ROWS_MAX = block_table._SLICED_ROWS_MAX, sliced_max
    try:
        tables = BlockTables(rows=2, cols=2, pad=NULL)  # small, so that rows and columns grow
        handles = []
        for blocks in rows:
            row = tables.new_row()
            row.extend(blocks)
            handles.append(row)
        chosen = data.draw(st.lists(st.sampled_from(range(len(rows))), min_size=1, unique=True), label="freed")
        ids = tables.release_many([handles[i].row for i in chosen])
    finally:
        block_table._SLICED_ROWS_MAX = saved
    assert ids.dtype == np.int32
    assert ids.tolist() == [b for i in chosen for b in reversed(rows[i])]
    # A recycled row starts empty: no stale blocks or counters.
    for _ in chosen:
        row = tables.new_row()
        assert len(row) == 0 and row.tolist() == []
        assert (tables.array[row.row] == NULL).all()
        assert tables.num_tokens[row.row] == tables.num_computed[row.row] == 0
        assert not tables.shared_tail[row.row]


def test_recycled_row_counters_are_zeroed() -> None:
    tables = BlockTables()
    row = tables.new_row()
    row.extend([5, 6, 7])
    tables.num_tokens[row.row] = 40
    tables.num_computed[row.row] = 33
    tables.shared_tail[row.row] = True
    assert tables.release_many([row.row]).tolist() == [7, 6, 5]
    again = tables.new_row()
    assert again.row == row.row
    assert (len(again), tables.num_tokens[again.row], tables.num_computed[again.row]) == (0, 0, 0)
    assert not tables.shared_tail[again.row]
    assert not tables.array[again.row].any()


def test_gather_pads_every_row_with_the_pad_id_also_past_the_column_capacity() -> None:
    tables = BlockTables(rows=1, cols=2, pad=NULL)
    a, b, c = tables.new_row(), tables.new_row(), tables.new_row()  # rows grow
    a.extend([1, 2, 3])  # columns grow
    c.extend([4])
    rows = np.array([a.row, b.row, c.row])
    assert tables.gather(rows, 3).tolist() == [[1, 2, 3], [NULL] * 3, [4, NULL, NULL]]
    wide = tables.gather(rows, tables.array.shape[1] + 2)
    assert wide[:, 3:].tolist() == [[NULL] * (wide.shape[1] - 3)] * 3
    tables.release_many([a.row])
    d = tables.new_row()
    assert d.row == a.row and tables.gather(np.array([d.row]), 4).tolist() == [[NULL] * 4]


@pytest.mark.parametrize("sliced_max", [0, 32])
def test_release_many_of_empty_rows(monkeypatch, sliced_max: int) -> None:
    monkeypatch.setattr(block_table, "_SLICED_ROWS_MAX", sliced_max)
    tables = BlockTables()
    a, b = tables.new_row(), tables.new_row()
    assert tables.release_many([a.row, b.row]).tolist() == []


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(0, 3), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_writing_tokens_at_a_block_boundary_equals_the_slot_formula(bs, first_block, k, seed) -> None:
    """The block-wise write (an admission after its prefix hits) puts every token where
    ``slot = block_table[row, pos // bs] * bs + pos % bs`` says, in a shard whose ids do not start at 0."""
    state = ShardState(0, range(50, 50 + 64), bs)
    row = state.tables.new_row().row
    blocks = np.random.default_rng(seed).permutation(np.arange(50, 50 + 64))[: first_block + -(-k // bs)]
    state.tables.ensure_cols(len(blocks))
    state.tables.array[row, : len(blocks)] = blocks
    tokens = np.random.default_rng(seed + 1).integers(0, 1000, k).astype(np.int32)
    start = first_block * bs
    state._write_tokens(row, start, tokens)
    flat = state.block_tokens.reshape(-1)
    pos = np.arange(start, start + k)
    slots = blocks[pos // bs].astype(np.int64) * bs + pos % bs - 50 * bs
    assert flat[slots].tolist() == tokens.tolist()
    written = np.zeros(flat.shape, dtype=bool)
    written[slots] = True
    assert not flat[~written].any()  # nothing else touched
