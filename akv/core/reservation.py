"""Reservations: room held at admission so that a sequence's decode never runs out of blocks.

An admission with ``Admit(max_new_tokens=N)`` takes the blocks of its prompt
now and *earmarks* the blocks its next ``N`` tokens will need,
``ceil((len(prompt) + N) / block_size) - ceil(len(prompt) / block_size)``,
from the shard's free blocks. Accounting (one shard):

- Earmarked blocks stay ``FREE`` in the :class:`~akv.core.block_pool.BlockPool`
  (on its free queue), so ``free + active + cached + in_flight == num_blocks``
  still holds; ``reserved <= free`` always. They are not *available*: other
  sequences' appends and admissions may take only ``free - reserved`` free
  blocks (plus evictable ones), and the eviction loop counts them as taken.
- A reserved sequence's own appends take their blocks from its earmark first;
  its earmark shrinks as its block table grows. Past ``len(prompt) + N``
  tokens its earmark is 0 and it is an ordinary sequence.
- ``free`` and ``preempt`` release the earmark with the blocks (a preempted
  sequence re-admitted with ``max_new_tokens`` reserves anew).
- ``fork``: a child does not inherit a reservation (it is ordinary; its
  decode can wait with ``wait_for_room``). The parent's next write into a
  partial tail block it now shares needs a copy-on-write copy, one block
  more than its earmark holds, so the fork earmarks that block too (once,
  however many children). When the shard cannot give that block, even
  after evicting, the fork raises
  :class:`~akv.errors.PoolExhausted` and nothing is applied. The extra
  block is used by the copy, or released when the parent's tail turns out
  unshared (the children wrote or left first) at its next write.

So a reserved row ``r`` holds, at every quiescent point,
``max(0, ceil(max_tokens[r] / block_size) - lens[r]) + cow_reserved[r]``
earmarked blocks, and the shard's ``num_reserved`` is their sum over live
rows (checked by :meth:`~akv.core.shard_state.ShardState.check`).

Pure functions over :class:`~akv.core.block_table.BlockTables`; no asyncio, no torch.
"""

from __future__ import annotations

import numpy as np

from akv.core.block_table import BlockTables


def reserved_blocks(tables: BlockTables, rows: np.ndarray, block_size: int) -> np.ndarray:
    """Blocks earmarked for each of ``rows``.

    Args:
        tables: The shard's block tables.
        rows: intp ``(n,)`` live rows.
        block_size: Tokens per block.

    Returns:
        int64 ``(n,)``: ``max(0, ceil(max_tokens / block_size) - lens) + cow_reserved``.
    """
    cover = -(-tables.max_tokens[rows] // block_size)
    return np.maximum(cover - tables.lens[rows], 0) + tables.cow_reserved[rows]


def row_reserved(tables: BlockTables, row: int, block_size: int) -> int:
    """Blocks earmarked for one row (see :func:`reserved_blocks`), as a Python int."""
    cover = -(-int(tables.max_tokens[row]) // block_size)
    return max(0, cover - int(tables.lens[row])) + bool(tables.cow_reserved[row])


def admission_reserve(num_prompt_tokens: int, max_new_tokens: int | None, block_size: int) -> int:
    """Blocks an admission earmarks beyond its prompt's blocks (0 without a reservation).

    Args:
        num_prompt_tokens: Prompt length (tokens, >= 1).
        max_new_tokens: Tokens to reserve room for after the prompt, or None.
        block_size: Tokens per block.

    Returns:
        ``ceil((num_prompt_tokens + max_new_tokens) / block_size) - ceil(num_prompt_tokens / block_size)``.
    """
    if not max_new_tokens:
        return 0
    return -(-(num_prompt_tokens + max_new_tokens) // block_size) - -(-num_prompt_tokens // block_size)


def fork_earmarks(tables: BlockTables, parent_rows: list[int], block_size: int) -> list[int]:
    """The distinct parent rows a step's forks must earmark a copy-on-write block for.

    A parent needs one when it is reserved and still within its reservation
    (``num_tokens < max_tokens``), its tail block is partial (the next write
    goes into it, now shared) and no such block is earmarked yet.

    Args:
        tables: The shard's block tables.
        parent_rows: Rows of the step's fork parents, in order (repeats allowed).
        block_size: Tokens per block.

    Returns:
        The rows, first occurrence order.
    """
    out: list[int] = []
    for row in dict.fromkeys(parent_rows):
        n = int(tables.num_tokens[row])
        if tables.max_tokens[row] > n and n % block_size and not tables.cow_reserved[row]:
            out.append(row)
    return out
