"""Per-sequence rows of one shard: block tables and token counts as growable numpy arrays.

A model runner needs, every step, a padded ``[batch, max_blocks]`` int32
block table for the scheduled sequences. Keeping every sequence's table as a
row of one array makes that a single fancy-index gather (``array[rows, :w]``)
instead of a rebuild from per-sequence lists; appending a block is one element
write. Beside the table, per-row vectors hold what a decode step reads and
writes for every sequence (blocks held, tokens, tokens committed, whether the
tail block may be shared), so a whole batch is updated with a few vectorized
operations and no per-sequence Python work (the layout of vLLM v1's
``InputBatch``/``BlockTable``: ``vllm/v1/worker/block_table.py``). Rows are
recycled through a free list and zeroed when handed out again (one row at a
time, at admission, rather than every freed row in the freeing step), so the
padding past a live row's length is always the pad value; a free row's
contents are stale.

A runner that keeps its own copy of the tables (vLLM's model runner keeps a
``BlockTable`` and applies each step's new block ids) asks for the step's
changes instead of the whole padded table (:meth:`BlockTables.updates`): the
entries of the columns the step's tokens fall in, and the whole row of a
sequence the runner may not hold yet (:attr:`BlockTables.stale`: a row just
handed out, or one a step changed without returning metadata).

The pad value is the null block id (the manager's ``null_block_id``, which is
``num_blocks``: one block past the usable ones, never allocated), vLLM's
convention of padding block tables with a reserved null block: a kernel that
reads or writes a padded entry touches only that block.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    """Rows of block ids and per-row counters, one row per live sequence.

    Args:
        rows: Initial row capacity (sequences); doubles on demand.
        cols: Initial column capacity (blocks per sequence); doubles on demand.
        pad: Block id of every entry past a row's length (the null block id;
            0 by default, for standalone use).

    Attributes:
        array: int32 ``(row_capacity, col_capacity)``; row ``r`` holds one
            sequence's block ids in logical order, padded with ``pad``.
        pad: The padding block id.
        lens: int64 ``(row_capacity,)`` blocks held by each row.
        num_tokens: int64 ``(row_capacity,)`` tokens in each row's history.
        num_computed: int64 ``(row_capacity,)`` tokens whose K/V the runner committed.
        shared_tail: bool ``(row_capacity,)``: the row's last block may also be
            held by another row (set by a fork, cleared once the row writes a
            block of its own); a decode step checks the refcount only there.
        max_tokens: int64 ``(row_capacity,)``: tokens the row's reservation
            covers (prompt plus ``max_new_tokens``), 0 without a reservation
            (see :mod:`akv.core.reservation`).
        cow_reserved: bool ``(row_capacity,)``: one block is earmarked for the
            copy-on-write copy of the row's shared partial tail (set by a fork
            of a reserved row, cleared once the row writes its tail).
        stale: bool ``(row_capacity,)``: a runner that mirrors the tables may
            not hold this row's current entries (set when the row is handed
            out and when a step changes it without returning metadata; cleared
            once :meth:`updates` returned the whole row).
    """

    __slots__ = (
        "_cols",
        "_free_rows",
        "_next_row",
        "array",
        "cow_reserved",
        "lens",
        "max_tokens",
        "num_computed",
        "num_tokens",
        "pad",
        "shared_tail",
        "stale",
    )

    def __init__(self, rows: int = 64, cols: int = 64, pad: int = 0) -> None:
        self.pad = pad
        self.array = np.full((rows, cols), pad, dtype=np.int32)
        self.lens = np.zeros(rows, dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.shared_tail = np.zeros(rows, dtype=bool)
        self.max_tokens = np.zeros(rows, dtype=np.int64)
        self.cow_reserved = np.zeros(rows, dtype=bool)
        self.stale = np.zeros(rows, dtype=bool)
        self._free_rows: list[int] = []
        self._next_row = 0
        self._cols = np.arange(cols)  # column indices, for masks in release_many

    def new_row(self) -> BlockTableRow:
        """An empty row for a new sequence (all counters 0)."""
        if self._free_rows:
            row = self._free_rows.pop()
            n = int(self.lens[row])  # stale contents of a released row (see release_many)
            if n:
                self.array[row, :n] = self.pad
                self.lens[row] = 0
            self.num_tokens[row] = 0
            self.num_computed[row] = 0
            self.shared_tail[row] = False
            self.max_tokens[row] = 0
            self.cow_reserved[row] = False
        else:
            row = self._next_row
            self._next_row += 1
            if row >= self.array.shape[0]:
                self._resize(2 * self.array.shape[0], self.array.shape[1])
        self.stale[row] = True
        return BlockTableRow(self, row)

    def release_many(self, rows: list[int]) -> np.ndarray:
        """Recycle ``rows`` (distinct, live); return the block ids they held.

        The rows keep their stale contents until :meth:`new_row` hands them
        out again and pads them (fewer array writes in a step that frees
        many sequences).

        Returns:
            int32 ``(sum of the rows' lengths,)``: each row's block ids deepest
            (last) first, row after row in the given order: the order in which
            :meth:`~akv.core.block_pool.BlockPool.decref` should release them.
        """
        if len(rows) <= _SLICED_ROWS_MAX:
            # A reversed slice per row and one concatenate: fewer numpy calls
            # than the masked gather below for a step's few finished sequences
            # (13 rows: 39 -> 33 us per call, paired, in the peer harness).
            arr = self.array
            lens = self.lens[rows].tolist()
            ids = np.concatenate([arr[row, n - 1 :: -1] if n else arr[row, :0] for row, n in zip(rows, lens)])
        else:
            r = np.array(rows, dtype=np.intp)
            lens = self.lens[r]
            width = int(lens.max())
            # Column j of the reversed row is column width-1-j: held iff j >= width - len.
            ids = (
                self.array[r, width - 1 :: -1][self._cols[:width] >= (width - lens)[:, None]]
                if width
                else np.zeros(0, dtype=np.int32)
            )
        self._free_rows.extend(rows)
        return ids

    def last_block(self, row: int) -> int:
        """The last block id of ``row`` (which must hold at least one)."""
        return int(self.array[row, self.lens[row] - 1])

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """Block tables of ``rows`` padded with :attr:`pad`: int32 ``(len(rows), width)``, a new array."""
        if width > self.array.shape[1]:
            out = np.full((len(rows), width), self.pad, dtype=np.int32)
            out[:, : self.array.shape[1]] = self.array[rows]
            return out
        return self.array[rows, :width]

    def updates(self, rows: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
        """The entries a runner's mirror of the tables needs for ``rows``: ``(index, column, block id)`` triples.

        For each ``rows[i]``, columns ``first[i] .. last[i]`` (the columns
        this step's tokens fall in), or its whole table ``0 .. lens - 1`` if
        the row is :attr:`stale` (which this clears): written into a copy
        that held the row's entries as of the last update, they make it equal
        to the row's current entries (columns past them are the runner's
        padding).

        Args:
            rows: intp ``(batch,)`` distinct live rows.
            first: int ``(batch,)`` first column of each row's entries.
            last: int ``(batch,)`` last column of each row's entries (``>= first``).

        Returns:
            int32 ``(num_entries, 3)``: row index ``i`` into ``rows``, column,
            block id; rows in order, columns ascending. O(batch + num_entries).
        """
        batch = len(rows)
        stale = self.stale[rows]
        if np.count_nonzero(stale):
            first = np.where(stale, 0, first)
            last = np.where(stale, self.lens[rows] - 1, last)
            self.stale[rows] = False
        counts = last - first + 1
        total = int(counts.sum())
        out = np.empty((total, 3), dtype=np.int32)
        if total == batch:  # one entry per row: a decode step's
            index, cols = np.arange(batch), first
        else:
            index = np.repeat(np.arange(batch), counts)
            starts = np.zeros(batch, dtype=np.int64)
            np.cumsum(counts[:-1], out=starts[1:])
            cols = first[index] + (np.arange(total) - starts[index])
        out[:, 0] = index
        out[:, 1] = cols
        out[:, 2] = self.array[rows[index], cols]
        return out

    def ensure_cols(self, cols: int) -> None:
        """Grow the column capacity to at least ``cols`` blocks."""
        if cols > self.array.shape[1]:
            self._resize(self.array.shape[0], max(cols, 2 * self.array.shape[1]))

    def _resize(self, rows: int, cols: int) -> None:
        grown = np.full((rows, cols), self.pad, dtype=np.int32)
        r, c = self.array.shape
        grown[:r, :c] = self.array
        self.array = grown
        self._cols = np.arange(cols)
        if rows > r:
            for name in ("lens", "num_tokens", "num_computed", "shared_tail", "max_tokens", "cow_reserved", "stale"):
                old = getattr(self, name)
                new = np.zeros(rows, dtype=old.dtype)
                new[:r] = old
                setattr(self, name, new)


class BlockTableRow:
    """One sequence's block table: block ids in logical order (a row of :class:`BlockTables`)."""

    __slots__ = ("owner", "row")

    def __init__(self, owner: BlockTables, row: int) -> None:
        self.owner = owner
        self.row = row

    @property
    def n(self) -> int:
        """Blocks in the row."""
        return int(self.owner.lens[self.row])

    def __len__(self) -> int:
        return int(self.owner.lens[self.row])

    def view(self) -> np.ndarray:
        """The block ids, int32 ``(n,)``; a view valid until the next append."""
        return self.owner.array[self.row, : self.owner.lens[self.row]]

    def tolist(self) -> list[int]:
        """The block ids as Python ints."""
        return self.owner.array[self.row, : self.owner.lens[self.row]].tolist()

    def last(self) -> int:
        """The last block id. Raises IndexError when empty."""
        if not self.owner.lens[self.row]:
            raise IndexError("empty block table")
        return self.owner.last_block(self.row)

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.owner.lens[self.row]:
            raise IndexError(i)
        return int(self.owner.array[self.row, i])

    def set(self, i: int, block_id: int) -> None:
        """Replace entry ``i`` (copy-on-write swaps the tail block)."""
        self.owner.array[self.row, i] = block_id

    def extend(self, block_ids) -> None:
        """Append block ids."""
        k = len(block_ids)
        if not k:
            return
        owner, r = self.owner, self.row
        start = int(owner.lens[r])
        n = start + k
        owner.ensure_cols(n)
        owner.array[r, start:n] = block_ids
        owner.lens[r] = n

    def copy_to(self, other: BlockTableRow) -> None:
        """Make ``other`` (an empty row of the same owner) a copy of this row: blocks and counters.

        The reservation (``max_tokens``, ``cow_reserved``) is not copied: a
        fork's child is an ordinary sequence.
        """
        owner, src, dst = self.owner, self.row, other.row
        n = owner.lens[src]
        owner.array[dst, :n] = owner.array[src, :n]
        owner.lens[dst] = n
        owner.num_tokens[dst] = owner.num_tokens[src]
        owner.num_computed[dst] = owner.num_computed[src]


#: Up to this many rows, :meth:`BlockTables.release_many` slices row by row
#: (per-row Python beats a fixed set of numpy calls on a few rows).
_SLICED_ROWS_MAX = 32
