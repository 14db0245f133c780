"""Block tables of one shard, kept as rows of one growable 2-D int32 array.

A model runner needs, every step, a padded ``[batch, max_blocks]`` int32
block table for the scheduled sequences. Keeping every sequence's table as a
row of one array makes that a single fancy-index gather (``array[rows, :w]``)
instead of a rebuild from per-sequence lists; appending a block is one element
write. Rows are recycled through a free list and zeroed when released, so the
padding past a row's length is always 0.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    """Rows of block ids, one per live sequence.

    Args:
        rows: Initial row capacity (sequences); doubles on demand.
        cols: Initial column capacity (blocks per sequence); doubles on demand.
    """

    __slots__ = ("_free_rows", "_next_row", "array")

    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        #: (row_capacity, col_capacity) int32; row r holds one sequence's block ids.
        self.array = np.zeros((rows, cols), dtype=np.int32)
        self._free_rows: list[int] = []
        self._next_row = 0

    def new_row(self) -> BlockTableRow:
        """An empty row for a new sequence."""
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = self._next_row
            self._next_row += 1
            if row >= self.array.shape[0]:
                self._resize(2 * self.array.shape[0], self.array.shape[1])
        return BlockTableRow(self, row)

    def release(self, row: BlockTableRow) -> None:
        """Zero ``row`` and recycle it."""
        self.array[row.row, : row.n] = 0
        row.n = 0
        self._free_rows.append(row.row)

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """Padded block tables of ``rows``: int32 ``(len(rows), width)``, a new array."""
        if width > self.array.shape[1]:
            out = np.zeros((len(rows), width), dtype=np.int32)
            out[:, : self.array.shape[1]] = self.array[rows]
            return out
        return self.array[rows, :width]

    def _ensure_cols(self, cols: int) -> None:
        if cols > self.array.shape[1]:
            self._resize(self.array.shape[0], max(cols, 2 * self.array.shape[1]))

    def _resize(self, rows: int, cols: int) -> None:
        grown = np.zeros((rows, cols), dtype=np.int32)
        r, c = self.array.shape
        grown[:r, :c] = self.array
        self.array = grown


class BlockTableRow:
    """One sequence's block table: block ids in logical order (a row of :class:`BlockTables`)."""

    __slots__ = ("n", "owner", "row")

    def __init__(self, owner: BlockTables, row: int) -> None:
        self.owner = owner
        self.row = row
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def view(self) -> np.ndarray:
        """The block ids, int32 ``(n,)``; a view valid until the next append."""
        return self.owner.array[self.row, : self.n]

    def tolist(self) -> list[int]:
        """The block ids as Python ints."""
        return self.owner.array[self.row, : self.n].tolist()

    def last(self) -> int:
        """The last block id. Raises IndexError when empty."""
        if not self.n:
            raise IndexError("empty block table")
        return int(self.owner.array[self.row, self.n - 1])

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
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
        n = self.n + k
        self.owner._ensure_cols(n)
        self.owner.array[self.row, self.n : n] = block_ids
        self.n = n

    def copy_to(self, other: BlockTableRow) -> None:
        """Make ``other`` (an empty row of the same owner) a copy of this row."""
        self.owner._ensure_cols(self.n)
        arr = self.owner.array
        arr[other.row, : self.n] = arr[self.row, : self.n]
        other.n = self.n
