"""Swap preemption: a sequence's blocks move to the host tier and back (part of :class:`~akv.core.shard_state.ShardState`).

A scheduler that preempts a running sequence can *swap it out* instead of
freeing it (vLLM v0's swap preemption): every block of its table is copied to
a host-tier slot that the swapped-out sequence holds (host state ``active``),
and its device blocks are released as a free would release them (published
ones stay cached; private ones become free once the copy has read them). Its
token history, counts and reservation are kept with it. *Swapping in*
allocates fresh device blocks for all of them at once, or raises
:class:`~akv.errors.PoolExhausted` and changes nothing; the copies bring the
K/V back, the host slots are freed once read, and the sequence continues
with exactly the history it had. It is not in the prefix cache again until
it commits more tokens (its blocks duplicate cached ones or are re-published
then, as for any sequence).

While swapped out, a sequence is not live: steps that name it raise
:class:`~akv.errors.UnknownSequence`; ``free`` releases its host slots.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from akv.core.admission import PendingHits
from akv.core.reservation import admission_reserve
from akv.core.sequence import Sequence
from akv.core.step import StepOutcome
from akv.errors import DuplicateSequence, InvalidInput, PoolExhausted, UnknownSequence


@dataclass(slots=True)
class SwappedSequence:
    """A sequence swapped out to the host tier.

    Attributes:
        seq_id: Its id.
        namespace: Its prefix-cache namespace.
        host_ids: The host ids holding its blocks, in logical order.
        tokens: int32 ``(num_tokens,)``: its token history.
        num_computed: Tokens whose K/V were committed.
        num_prompt_tokens: Its prompt length at admission.
        num_cached_tokens: Prompt tokens its admission got from the cache.
        parent_id: The sequence it was forked from, or None.
        max_tokens: Tokens its reservation covered (0: none).
        ready: The copies to the host have completed (it may be swapped in).
    """

    seq_id: Hashable
    namespace: Hashable
    host_ids: list[int]
    tokens: np.ndarray
    num_computed: int
    num_prompt_tokens: int
    num_cached_tokens: int
    parent_id: Hashable | None
    max_tokens: int
    ready: bool


class ShardSwaps:
    """Swap-out and swap-in; a mixin of :class:`~akv.core.shard_state.ShardState` (uses its attributes)."""

    __slots__ = ()

    def swap_out(self, seq_id: Hashable, out: StepOutcome) -> int:
        """Copy every block of live ``seq_id`` to the host tier and release its device blocks.

        Host room is made by dropping cached host blocks in the host
        policy's order. The copies are ``out.swap_outs`` (device block,
        host id) pairs; with pending copies the sequence may be swapped in
        once :meth:`~akv.core.tiers.ShardTiers.transfer_done` reported them.

        Returns:
            The number of blocks swapped out.

        Raises:
            UnknownSequence: ``seq_id`` is not live in this shard.
            InvalidInput: The shard has no host tier.
            PoolExhausted: The host tier cannot hold its blocks (numbers in
                host blocks); nothing is swapped (cached host blocks
                dropped for room stay dropped).
        """
        if seq_id in self.swapped:
            raise UnknownSequence(seq_id, "swapped out already (swap it in first)")
        seq = self.get(seq_id)
        host = self.host
        if host is None:
            raise InvalidInput(f"cannot swap out {seq_id!r}: the manager has no host tier (KVCacheConfig.host_blocks)")
        blocks = seq.block_ids.tolist()
        n = len(blocks)
        if n > host.num_free + host.num_cached:
            raise PoolExhausted(n, host.num_free, host.num_cached, tier="host")
        slots = self._host_room(n, frozenset(), out)
        if len(slots) < n:
            host.decref(slots, distinct=True)
            raise PoolExhausted(n, host.num_free, 0, tier="host")
        row = seq.row
        t = self.tables
        rec = SwappedSequence(
            seq_id=seq_id,
            namespace=seq.namespace,
            host_ids=slots,
            tokens=self.token_ids(seq).copy(),
            num_computed=seq.num_computed,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            parent_id=seq.parent_id,
            max_tokens=int(t.max_tokens[row]),
            ready=self.sync_copies,
        )
        if not self.sync_copies:
            tr = self._transfer(out)
            self.pool.pin_for_copy(blocks)
            host.pin_for_copy(slots)
            tr.device_pins += blocks
            tr.host_pins += slots
            tr.swap_out = seq_id
        out.swap_outs += zip(blocks, slots)
        del self.sequences[seq_id]
        del self.rows[seq_id]
        self._release_rows([row])
        self.swapped[seq_id] = rec
        self.counters.swapped_out += 1
        return n

    def _swap_out_done(self, seq_id: Hashable, ok: bool) -> None:
        """The swap-out copies of ``seq_id`` ran (it may be swapped in) or failed (its host slots go back)."""
        rec = self.swapped.get(seq_id)
        if rec is None:
            return  # freed while the copies ran
        if ok:
            rec.ready = True
        else:
            del self.swapped[seq_id]
            self.host.decref(rec.host_ids, distinct=True)

    def swap_in(self, seq_id: Hashable, out: StepOutcome) -> int:
        """Bring swapped-out ``seq_id`` back: fresh device blocks for all its blocks, or nothing.

        Room is made as for an admission (evicting or demoting cached device
        blocks). The copies are ``out.swap_ins`` (host id, device block)
        pairs; the runner must wait for them before reading the blocks.

        Returns:
            The number of blocks swapped in.

        Raises:
            InvalidInput: The shard has no host tier.
            UnknownSequence: ``seq_id`` is not swapped out in this shard.
            DuplicateSequence: ``seq_id`` is live.
            InvalidInput: Its swap-out copies have not completed yet.
            PoolExhausted: The device blocks are not there even after
                eviction; it stays swapped out and nothing else changes but
                the evictions.
            RequestTooLarge: It holds more blocks than the shard.
        """
        if self.host is None:
            raise InvalidInput(f"cannot swap in {seq_id!r}: the manager has no host tier (KVCacheConfig.host_blocks)")
        if seq_id in self.sequences:
            raise DuplicateSequence(seq_id, " (it is live, not swapped out)")
        rec = self.swapped.get(seq_id)
        if rec is None:
            raise UnknownSequence(seq_id)
        if not rec.ready:
            raise InvalidInput(f"sequence {seq_id!r} is still being swapped out; await swap_out first")
        n, num_tokens, bs = len(rec.host_ids), len(rec.tokens), self.block_size
        more = rec.max_tokens - num_tokens if rec.max_tokens > num_tokens else None
        reserve = admission_reserve(num_tokens, more, bs)
        err = self._make_room(n + reserve, n + reserve, PendingHits(), out)
        if err is not None:
            raise err
        blocks = self.pool.allocate(n)
        if self.released:
            self._note_reused(out)  # its own copies run after that batch: waiting for them is enough
        seq = Sequence(seq_id, rec.namespace, rec.num_prompt_tokens, self.tables.new_row())
        seq.block_ids.extend(blocks)
        seq.num_cached_tokens = rec.num_cached_tokens
        seq.parent_id = rec.parent_id
        row = seq.row
        self._write_tokens(row, 0, rec.tokens)
        self.tables.num_tokens[row] = num_tokens
        self.tables.num_computed[row] = rec.num_computed
        if reserve or more:
            self.tables.max_tokens[row] = rec.max_tokens
            self.num_reserved += reserve
            self.num_reserved_seqs += 1
        self.table_refs += n
        self.counters.blocks_allocated += n
        host = self.host
        if not self.sync_copies:
            host.pin_for_copy(rec.host_ids)
            self.pool.pin_for_copy(blocks)  # freed before the copy ran: in flight, never reused under it
            tr = self._transfer(out)
            tr.host_pins += rec.host_ids
            tr.held_pins += blocks
        host.decref(rec.host_ids, distinct=True)
        out.swap_ins += zip(rec.host_ids, blocks)
        del self.swapped[seq_id]
        self.sequences[seq_id] = seq
        self.rows[seq_id] = row
        self.counters.swapped_in += 1
        return n

    def _free_swapped(self, seq_ids, out: StepOutcome) -> None:
        """Free the swapped-out sequences among ``seq_ids``: their host slots go back (once read, if copying)."""
        for seq_id in seq_ids:
            rec = self.swapped.pop(seq_id, None)
            if rec is not None:
                self.host.decref(rec.host_ids, distinct=True)
                out.freed.append(seq_id)
                self.counters.sequences_freed += 1
