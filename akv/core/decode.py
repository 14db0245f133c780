"""Appending tokens: the vectorized decode path, copy-on-write and step metadata (part of :class:`~akv.core.shard_state.ShardState`).

A batch of one-token appends whose new blocks and copies fit in the free
blocks takes :meth:`ShardAppends._decode`: a few numpy operations over the
batch's rows. :meth:`ShardAppends._fill_metadata` builds the block tables,
context lengths and slot mapping of the scheduled rows.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from akv.core.reservation import row_reserved
from akv.core.step import StepOutcome, empty_metadata

#: Up to this many rows spanning several blocks, :meth:`ShardAppends._slots` takes each row's
#: slots in one broadcast; more go in one pass over all tokens.
_LONG_ROWS_MAX = 4


class ShardAppends:
    """Appends and metadata; a mixin of :class:`~akv.core.shard_state.ShardState` (uses its attributes)."""

    __slots__ = ()

    def _append(self, req, checked, protected, out: StepOutcome, sched_ids: list, sched: list) -> tuple | None:
        """Append phase: the vectorized decode path when it applies, else :meth:`_append_general`.

        A batch of one-token appends whose new blocks do not fit in the free
        blocks evicts the shortfall in one pass (instead of per sequence on
        the general path) and takes the vectorized path after all.

        Returns:
            What :meth:`_decode` returns for the batch, or None when the
            general path appended (its rows are added to ``sched_ids`` and
            ``sched``; rejected appends to ``out.rejected``).
        """
        decoded = None
        if checked.single_appends:
            decoded = self._decode(req.appends, out, req.commits, checked.commit_rows)
            if decoded is None and self._decode_shortfall <= self._evictable(protected.blocks()):
                self._evict(self._decode_shortfall, protected.blocks(), out)
                decoded = self._decode(req.appends, out, req.commits, checked.commit_rows)
        if decoded is None:
            self._append_general(req.appends, protected, out, sched_ids, sched)
        if not req.want_metadata:  # changed, not returned: a runner's mirror needs these rows whole next time
            self.tables.stale[decoded[1] if decoded is not None else [r for r, _, _ in sched]] = True
        return decoded

    def _append_general(self, appends, protected, out: StepOutcome, sched_ids: list, sched: list) -> None:
        """Append each sequence's tokens in order, evicting or rejecting per sequence (all-or-nothing each)."""
        bs, seqs, pool, tables = self.block_size, self.sequences, self.pool, self.tables
        for seq_id, tokens in appends.items():
            seq = seqs[seq_id]
            blocks = seq.block_ids
            row = blocks.row
            start = int(tables.num_tokens[row])
            single = type(tokens) is int
            k = 1 if single else len(tokens)
            tail = start % bs != 0 and pool.refcount(blocks.last()) > 1
            total = (start + k + bs - 1) // bs
            need = total - len(blocks) + tail
            own = row_reserved(tables, row, bs) if self.num_reserved_seqs else 0
            if need > pool.num_free - self.num_reserved + own or total > pool.num_blocks:
                err = self._make_room(need, total, protected, out, own)
                if err is not None:
                    out.rejected[seq_id] = err
                    continue
            if tail:
                self._copy_on_write(seq_id, row, out)
                need -= 1
            if need:
                blocks.extend(pool.allocate(need))
                self.table_refs += need
                self.counters.blocks_allocated += need
            tables.shared_tail[row] = False
            if own:
                tables.cow_reserved[row] = False
                self.num_reserved += row_reserved(tables, row, bs) - own
            self._write_tokens(row, start, np.array([tokens], dtype=np.int32) if single else tokens)
            tables.num_tokens[row] = start + k
            sched_ids.append(seq_id)
            sched.append((row, start, k))

    def _decode(
        self, appends, out: StepOutcome, commits=None, commit_rows: np.ndarray | None = None
    ) -> tuple[list, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The vectorized decode path: one ``int`` token for each sequence of ``appends``.

        Returns ``(seq_ids, rows, num_tokens, slots, columns, block_ids)`` (int
        arrays of shape ``(batch,)``; each row's new token is at position
        ``num_tokens[i] - 1``, in block ``block_ids[i]``, column ``columns[i]`` of its row), or None without changing anything when the batch's new
        blocks and copies do not fit in the free blocks (the shortfall is left
        in ``_decode_shortfall``; the step then evicts it in one pass, or the
        general path evicts or rejects per sequence).

        ``commits`` and ``commit_rows`` (the step's validated commits and their
        rows) save looking the rows up again when the appends start with the
        same sequences in the same order, as a decode loop's do.
        """
        values = appends.values()
        bs, pool, tables = self.block_size, self.pool, self.tables
        n = len(appends)
        ids = list(appends)
        rows = self._batch_rows(ids, commits, commit_rows)
        pos = tables.num_tokens[rows]
        cols, offsets = np.divmod(pos, bs)
        new_block = offsets == 0
        # Shared tails come only from forks (``_fork`` counts them): with none in the table, skip the per-row flags.
        any_shared = bool(self.counters.forks) and bool(np.count_nonzero(tables.shared_tail))
        maybe_shared = np.flatnonzero(tables.shared_tail[rows] & ~new_block).tolist() if any_shared else []
        num_new = int(np.count_nonzero(new_block))
        released = 0  # earmarked blocks this batch takes or gives back
        if self.num_reserved_seqs:
            # A row allocates at most one block (a new block or a copy); a row
            # with an earmark takes it from there, the others from the free
            # blocks no reservation holds. Afterwards every row's copy earmark
            # is gone (used or, its tail written in place, given back) and each
            # new block of a row with earmarked blocks came out of them.
            ahead = np.maximum(-(-tables.max_tokens[rows] // bs) - tables.lens[rows], 0) > 0
            cow = tables.cow_reserved[rows]
            released = int(np.count_nonzero(new_block & ahead)) + int(np.count_nonzero(cow))
            short = self._decode_short(
                rows,
                [i for i in maybe_shared if not cow[i]],
                int(np.count_nonzero(new_block & ~ahead)),
                pool.num_free - self.num_reserved,
            )
        elif num_new + len(maybe_shared) <= pool.num_free:  # at most one copy per flagged row
            short = 0
        else:
            short = self._decode_short(rows, maybe_shared, num_new, pool.num_free)
        if short:
            self._decode_shortfall = short
            return None
        for i in maybe_shared:  # in order: the last holder of a shared tail writes in place
            r = int(rows[i])
            if pool.refcount(tables.last_block(r)) > 1:
                self._copy_on_write(ids[i], r, out)
        if num_new:
            grow = rows[new_block]
            new_cols = cols[new_block]  # a row's new block is its next column: new_cols == lens[grow]
            tables.ensure_cols(int(new_cols[-1] if num_new == 1 else np.maximum.reduce(new_cols)) + 1)
            tables.array[grow, new_cols] = pool.allocate(num_new)
            tables.lens[grow] = new_cols + 1
            self.table_refs += num_new
            self.counters.blocks_allocated += num_new
        if any_shared:
            tables.shared_tail[rows] = False
        if released:
            tables.cow_reserved[rows] = False
            self.num_reserved -= released
        block_ids = tables.array[rows, cols]
        slots = np.multiply(block_ids, bs, dtype=np.int64)
        slots += offsets
        flat = slots - self._first_slot if self._first_slot else slots
        self._flat_tokens[flat] = np.fromiter(values, dtype=np.int64, count=n)
        tables.num_tokens[rows] = after = pos + 1
        return ids, rows, after, slots, cols, block_ids

    def _batch_rows(self, ids: list, commits, commit_rows: np.ndarray | None) -> np.ndarray:
        """intp ``(len(ids),)`` rows of ``ids``, reusing ``commit_rows`` when the commits' ids lead ``ids`` in order."""
        n = len(ids)
        k = len(commits) if commit_rows is not None else 0
        if k and k <= n and ids[:k] == list(commits):  # a decode loop commits and appends the same rows
            if k == n:
                return commit_rows
            rest = np.fromiter(map(self.rows.__getitem__, ids[k:]), dtype=np.intp, count=n - k)
            return np.concatenate((commit_rows, rest))
        return np.fromiter(map(self.rows.__getitem__, ids), dtype=np.intp, count=n)

    def _decode_short(self, rows: np.ndarray, shared: list[int], num_new: int, free: int) -> int:
        """Blocks a decode batch lacks: ``num_new`` new blocks plus the copies of ``shared`` rows, against ``free``."""
        if num_new + len(shared) <= free:  # at most one copy per flagged row
            return 0
        # Exact copies: rows copy in order while their tail is still shared,
        # so a tail held R times by k rows of the batch is copied min(k, R - 1) times.
        pool, tables = self.pool, self.tables
        holders: dict[int, int] = {}
        for i in shared:
            b = tables.last_block(int(rows[i]))
            holders[b] = holders.get(b, 0) + 1
        copies = sum(min(k, pool.refcount(b) - 1) for b, k in holders.items())
        return max(0, num_new + copies - free)

    def _copy_on_write(self, seq_id: Hashable, row: int, out: StepOutcome) -> None:
        """Give ``row`` a private copy of its shared partial tail block (K/V copy queued in ``out``)."""
        pool, tables = self.pool, self.tables
        col = int(tables.lens[row]) - 1
        old = int(tables.array[row, col])
        (new,) = pool.allocate(1)
        tables.array[row, col] = new
        pool.pin_for_copy((old, new))  # neither may be reused before the copy ran
        pool.decref((old,))
        base = pool.first_block_id
        self.block_tokens[new - base] = self.block_tokens[old - base]
        out.copies.append((old, new))
        out.copy_seq_ids.append(seq_id)
        self.counters.cow_copies += 1
        self.counters.blocks_allocated += 1

    def _write_tokens(self, row: int, start: int, tokens: np.ndarray) -> None:
        """Store ``tokens`` at positions ``start..`` of ``row`` (its blocks must exist)."""
        k = len(tokens)
        if not k:
            return
        bs = self.block_size
        if start % bs == 0:  # an admission after its prefix hits: whole blocks, then a partial one
            full, rem = divmod(k, bs)
            first = start // bs
            offsets = self.tables.array[row, first : first + full + (rem > 0)] - self.pool.first_block_id
            if full:
                self.block_tokens[offsets[:full]] = tokens[: full * bs].reshape(full, bs)
            if rem:
                self.block_tokens[offsets[full], :rem] = tokens[full * bs :]
            return
        pos = np.arange(start, start + k)
        slots = self.tables.array[row, pos // bs].astype(np.int64) * bs + pos % bs
        self._flat_tokens[slots - self._first_slot] = tokens

    def _fill_metadata(
        self, out: StepOutcome, decoded, sched: list[tuple[int, int, int]], updates: bool = False
    ) -> None:
        """Block tables (or their updates), context lengths and slot mapping of the scheduled rows, vectorized.

        ``slot = block_table[row, pos // block_size] * block_size + pos % block_size``
        for every new token, computed for the whole batch at once (the decode
        path has computed its slots already). With ``updates`` the padded
        tables are not gathered: ``out.block_table_updates`` gets the entries
        of the columns the new tokens fall in, and the whole table of the
        :attr:`~akv.core.block_table.BlockTables.stale` rows
        (:meth:`~akv.core.block_table.BlockTables.updates`).
        """
        bs, tables = self.block_size, self.tables
        if decoded is not None and not sched:  # a pure decode step
            _, rows, after, slots, cols, block_ids = decoded
            batch = len(rows)
            if not updates:
                out.block_tables = tables.gather(rows, int(tables.lens[rows].max()))
            elif np.count_nonzero(tables.stale[rows]):  # (count_nonzero: 0.2 us, .any(): 1.1 us)
                out.block_table_updates = tables.updates(rows, cols, cols)
            else:  # one entry per row, all known: the column and block of its new token
                out.block_table_updates = entries = np.empty((batch, 3), dtype=np.int32)
                entries[:, 0] = np.arange(batch)
                entries[:, 1] = cols
                entries[:, 2] = block_ids
            out.context_lens = after.astype(np.int32)
            out.query_start_loc = np.arange(batch + 1, dtype=np.int32)
            out.slot_mapping = slots
            return
        extra = np.array(sched, dtype=np.int64).reshape(-1, 3)
        if decoded is not None:
            drows, dpos = decoded[1], decoded[2] - 1
            rows = np.concatenate([drows, extra[:, 0]])
            starts = np.concatenate([dpos, extra[:, 1]])
            lens = np.concatenate([np.ones(len(drows), dtype=np.int64), extra[:, 2]])
        else:
            rows, starts, lens = extra[:, 0], extra[:, 1], extra[:, 2]
        batch = len(rows)
        if not batch:
            out.block_tables, out.context_lens, out.query_start_loc, out.slot_mapping = empty_metadata()
            if updates:
                out.block_tables, out.block_table_updates = None, np.zeros((0, 3), dtype=np.int32)
            return
        qsl = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        if updates:
            out.block_table_updates = tables.updates(rows, starts // bs, (starts + lens - 1) // bs)
        else:
            out.block_tables = tables.gather(rows, int(tables.lens[rows].max()))
        out.context_lens = (starts + lens).astype(np.int32)
        out.query_start_loc = qsl.astype(np.int32)
        out.slot_mapping = self._slots(rows, starts, lens, qsl)

    def _slots(self, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, qsl: np.ndarray) -> np.ndarray:
        """Slot mapping of the new tokens of ``rows``: int64 ``(qsl[-1],)``, row after row.

        ``lens[i]`` tokens of ``rows[i]`` from position ``starts[i]``, written at
        ``qsl[i]``. Rows of a few tokens are done together, one gather for all
        their tokens; a row spanning several blocks (a prefill) takes its
        blocks' slots in one broadcast per row, so its cost per token is one
        write, not a dozen numpy passes over ``(tokens,)`` index arrays. More
        than :data:`_LONG_ROWS_MAX` such rows (many short prefills) go in the
        one pass over all tokens instead: a Python step per row would cost more.
        O(tokens + blocks).
        """
        bs, table = self.block_size, self.tables.array
        total = int(qsl[-1])
        if total == len(rows):  # one new token per row
            return table[rows, starts // bs].astype(np.int64) * bs + starts % bs
        long = lens >= 2 * bs
        if np.count_nonzero(long) > _LONG_ROWS_MAX:  # one pass over every token
            row_of = np.repeat(np.arange(len(rows)), lens)
            pos = starts[row_of] + (np.arange(total) - qsl[row_of])
            return table[rows[row_of], pos // bs].astype(np.int64) * bs + pos % bs
        slots = np.empty(total, dtype=np.int64)
        short = np.flatnonzero(~long)
        if len(short):
            n = lens[short]
            row_of = np.repeat(short, n)
            within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            pos = starts[row_of] + within
            slots[qsl[row_of] + within] = table[rows[row_of], pos // bs].astype(np.int64) * bs + pos % bs
        span = np.arange(bs)
        for i in np.flatnonzero(long).tolist():
            start, k, at = int(starts[i]), int(lens[i]), int(qsl[i])
            first = start // bs
            blocks = table[rows[i], first : (start + k - 1) // bs + 1].astype(np.int64) * bs
            lo = start - first * bs
            slots[at : at + k] = (blocks[:, None] + span).reshape(-1)[lo : lo + k]
        return slots
