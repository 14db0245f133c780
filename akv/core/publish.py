"""Publishing committed full blocks to the prefix tree (part of :class:`~akv.core.shard_state.ShardState`).

A step queues the blocks its commits (and ``prefill_done`` admissions) have
filled in a :class:`PendingPublish` and inserts them together, in queue order,
before the next tree match that could hit them.
"""

from __future__ import annotations

import numpy as np

from akv.core.checks import Checked
from akv.core.sequence import Sequence
from akv.core.step import StepOutcome


class PendingPublish:
    """Committed full blocks queued for the prefix tree, inserted together by ``ShardState._publish``.

    Attributes:
        entries: ``(sequence, first block index, block ids)`` per queued
            insert, in queue order: the multi-block inserts, then the
            one-block ones.
        inserts: ``(namespace key, parent block id | None, tokens, block ids)``
            arguments of :meth:`~akv.core.radix_tree.RadixTree.insert`, one
            per multi-block entry.
        singles: ``(namespace key, parent block id | None, token bytes, block id)``
            items of one :meth:`~akv.core.radix_tree.RadixTree.insert_blocks`
            call, one per one-block entry.
    """

    __slots__ = ("entries", "inserts", "singles")

    def __init__(self) -> None:
        self.entries: list = []
        self.inserts: list = []
        self.singles: list = []

    def clear(self) -> None:
        """Forget the queued inserts (they were applied)."""
        self.entries.clear()
        self.inserts.clear()
        self.singles.clear()


class ShardPublishing:
    """Commit and publish; a mixin of :class:`~akv.core.shard_state.ShardState` (uses its attributes)."""

    __slots__ = ()

    def _commit(self, commits, checked: Checked, publishing: PendingPublish) -> None:
        """Add committed token counts (vectorized); queue the publishing of newly full blocks."""
        rows, add, new = checked.commit_rows, checked.commit_counts, checked.commit_totals
        self.tables.num_computed[rows] = new
        if not self.enable_prefix_cache:
            return
        bs, seqs, ids = self.block_size, self.sequences, None
        single: list[tuple[Sequence, int, int]] = []  # (sequence, its row, index of its one newly full block)
        # A row filled a block iff its new total's offset in its block is below what it added.
        for i in ((new % bs) < add).nonzero()[0].tolist():
            if ids is None:
                ids = list(commits)
            seq = seqs[ids[i]]
            full = new.item(i) // bs
            if seq.publish_stopped or full <= seq.num_published:
                continue
            if full == seq.num_published + 1:  # the decode case: one block just filled
                single.append((seq, rows.item(i), full - 1))
            else:
                self._queue_publish(seq, publishing)
        if single:
            self._queue_publish_single(single, publishing)

    def _queue_publish_single(self, single: list, publishing: PendingPublish) -> None:
        """Queue the publishing of each sequence's one newly full block, for one tree call.

        ``single`` holds ``(sequence, row, column)`` per block. A decode step
        fills about batch / block_size blocks: up to :data:`_SCALAR_SINGLES`
        of them are read with scalar reads of the table and one ``tobytes``
        each (a gather costs half a dozen numpy calls, 1-2 us each), more with
        one gather of their ids and parents and one of their tokens.
        """
        table, tokens, base = self.tables.array, self.block_tokens, self.pool.first_block_id
        shard = self.shard_index
        items, entries = publishing.singles, publishing.entries
        if len(single) <= _SCALAR_SINGLES:
            for seq, row, col in single:
                block = table.item(row, col)
                parent = table.item(row, col - 1) if col else None
                items.append(((shard, seq.namespace), parent, tokens[block - base].tobytes(), block))
                entries.append((seq, col, [block]))
            return
        r = np.fromiter((row for _, row, _ in single), dtype=np.intp, count=len(single))
        cols = np.fromiter((col for _, _, col in single), dtype=np.intp, count=len(single))
        blocks = table[r, cols]
        parents = table[r, np.maximum(cols - 1, 0)].tolist()
        raw = tokens[blocks.astype(np.intp) - base].tobytes()
        width = 4 * self.block_size
        for j, ((seq, _, col), block) in enumerate(zip(single, blocks.tolist())):
            items.append(((shard, seq.namespace), parents[j] if col else None, raw[j * width : (j + 1) * width], block))
            entries.append((seq, col, [block]))

    def _queue_publish(self, seq: Sequence, publishing: PendingPublish) -> None:
        """Queue the publishing of ``seq``'s committed full blocks not published yet (one tree insert).

        The tokens are gathered from :attr:`block_tokens` (the blocks' own
        rows, written at admission and on every append) in one numpy index.
        """
        if not self.enable_prefix_cache or seq.publish_stopped:
            return
        bs = self.block_size
        full = min(seq.num_computed // bs, len(seq.block_ids))
        start = seq.num_published
        if full <= start:
            return
        parent = seq.block_ids[start - 1] if start else None
        view = seq.block_ids.view()[start:full]
        tokens = self.block_tokens[view.astype(np.intp) - self.pool.first_block_id]
        ids = view.tolist()
        publishing.inserts.append((self.namespace_key(seq.namespace), parent, tokens, ids))
        publishing.entries.append((seq, start, ids))

    def _publish(self, publishing: PendingPublish, out: StepOutcome) -> None:
        """Insert the queued blocks into the tree, in queue order; record how far each sequence got; clear the queue.

        The blocks new in the tree are appended to ``out.stored_block_ids``
        (a queued block may be in the tree already: a fork's parent published it).
        """
        tree = self.tree
        size = len(tree)
        results = [tree.insert(ns, parent, tokens, ids) for ns, parent, tokens, ids in publishing.inserts]
        if publishing.singles:
            results.extend(tree.insert_blocks(publishing.singles))
        marked: list[int] = []
        for (seq, start, ids), done in zip(publishing.entries, results):
            if done:
                marked.extend(ids[:done])
            seq.num_published = start + done
            if done < len(ids):
                seq.publish_stopped = True
        publishing.clear()
        if marked:
            if len(tree) - size < len(marked):  # some were in the tree already, or queued twice
                is_published = self.pool.is_published
                marked = [b for b in dict.fromkeys(marked) if not is_published(b)]
            out.stored_block_ids.extend(marked)
            self.pool.mark_published(marked)


#: Up to this many newly full blocks of a step, their keys are read with scalar reads (see
#: ``ShardPublishing._queue_publish_single``).
_SCALAR_SINGLES = 8
