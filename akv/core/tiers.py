"""The host tier of a shard: demotion, promotion and their pending copies (part of :class:`~akv.core.shard_state.ShardState`).

A shard with a host tier owns a second :class:`~akv.core.block_pool.BlockPool`
over its host ids (``host_base + slot``, see :mod:`akv.core.radix_tiers`),
with the same eviction policy. Per host id the pool's states mean: ``free``;
``cached`` (in the prefix tree on the host, in the host eviction order);
``active`` (held by a swapped-out sequence, :mod:`akv.core.swap`);
``in_flight`` (a copy to or from it is pending, or it is being evicted).

**Demotion.** When eviction picks cached device blocks, each *device leaf*
(no device block below it in the tree) takes a host id instead of leaving
the tree: its node keeps it, only its id changes. The host tier makes room
by dropping its own leaves in its policy order. Blocks that cannot move
(no host room) are dropped as without a tier. There are two kinds:

- *on demand* (a step needs the device block now): the device block is free
  at once and the step's copy batch copies it out before anything else, so
  a runner that waits for the step's copies (as it must before writing new
  blocks) writes it only after the copy read it. A block the step does not
  take after all (an admission refused after part of its room was made, or
  more evicted than allocated) stays free with its copy pending; the step
  that hands it out later records that transfer
  (``StepOutcome.wait_transfer``, :meth:`ShardTiers._note_reused`), and its
  runner waits for that copy too: copies run in submission order, so the
  pool shard actor gives a step without copies of its own the ticket of
  that batch;
- *held* (the eviction loop and ``evict()``): the device block stays in
  flight until the copy has completed, and only then becomes free; if the
  copy fails, the block is put back where it was, cached on the device. A
  step short of room takes such blocks as on-demand ones
  (:meth:`ShardTiers._reclaim_held`).

Either way the host block is *unready* (never matched) until the copy has
completed.

**Promotion.** A prefix match continues through host blocks (device hits
come first: device blocks are ancestor-closed). An admission allocates fresh
device blocks for its host hits, and the tree moves those blocks back to the
new device ids; the host ids are freed once the copy has read them. The new
device blocks are unready until the copy has completed, so another prompt
never reads them early. A promoted block leaves the host tier (no second
copy is kept).

**Transfers.** With real storage every batch of moves is a
:class:`TierTransfer` the pool shard actor submits with the step's copies and
reports back with :meth:`ShardTiers.transfer_done`. In metadata mode
(``sync_copies``) copies are instant: moves complete where they happen and no
transfer is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from akv.core.block_pool import CACHED, FREE
from akv.core.step import StepOutcome


@dataclass(slots=True)
class TierTransfer:
    """Blocks that wait for one batch of copies (device <-> host) to complete.

    Attributes:
        host_pins: Host ids pinned until the copies ran (demotion targets,
            promotion and swap-in sources).
        device_pins: Device blocks pinned until then (held demotions and
            swap-out sources).
        unready: Tree ids not matched until then.
        held: ``(device block, host id)`` of held demotions, put back on the
            device if the copy fails.
        released: Device blocks demoted on demand (free at once, read by
            these copies): while the transfer is pending, a step that hands
            one out must wait for it.
        held_pins: Device blocks a sequence holds that these copies write
            or read (promotion and swap-in destinations, blocks demoted on
            demand and handed out again), pinned so that one freed before
            the copies ran stays in flight instead of being reused under them.
        swap_out: The sequence whose swap-out this batch copies, if any.
    """

    host_pins: list[int] = field(default_factory=list)
    device_pins: list[int] = field(default_factory=list)
    unready: list[int] = field(default_factory=list)
    held: list[tuple[int, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    held_pins: list[int] = field(default_factory=list)
    swap_out: object = None


class ShardTiers:
    """Demotion, promotion and pending transfers; a mixin of :class:`~akv.core.shard_state.ShardState`."""

    __slots__ = ()

    # ------------------------------------------------------------ transfers
    def _transfer(self, out: StepOutcome) -> TierTransfer:
        """The open transfer of ``out`` (created on first use)."""
        tid = out.transfer
        if tid is None:
            tid = out.transfer = self._next_transfer
            self._next_transfer += 1
            self._transfers[tid] = TierTransfer()
        return self._transfers[tid]

    def transfer_done(self, tid: int, ok: bool = True) -> tuple[list[tuple[int, int]], list[int]]:
        """The copies of transfer ``tid`` ran (``ok``) or failed: release its pins, make its blocks matchable.

        On failure, held demotions go back to the device (cached there, as
        before the demotion) where their host block is still in the tree,
        parents first; one whose parent moved to the host meanwhile has no
        place on the device (device blocks are ancestor-closed) and its host
        copy is not valid, so it leaves the tree with its subtree (host
        blocks only). A swap-out's host blocks are freed and the sequence is
        lost (a failed copy breaks the stream worker, which fails the
        manager); blocks whose content the failed copy should have written
        stay unready.

        Returns:
            ``(put_back, dropped)``: ``(host id, device block)`` of each held
            demotion put back on the device, in order, and the host ids that
            left the tree (both empty when ``ok``). Cache events describe them
            (:meth:`~akv.events.shard_events.ShardEvents.put_back`).

        Raises:
            KeyError: ``tid`` is not a pending transfer of this shard.
        """
        t = self._transfers.pop(tid)
        pool, host, tree = self.pool, self.host, self.tree
        put_back: list[tuple[int, int]] = []
        dropped: list[int] = []
        if ok:
            self.unready.difference_update(t.unready)
        else:
            for dev, hid in reversed(t.held):  # demoted deepest first: parents first
                if hid not in tree:
                    continue
                parent, _ = tree.parent_of(hid)
                if parent is not None and parent >= self.host_base:
                    removed, _ = tree.remove_leaves(tree.subtree(hid))
                    host.unpublish(removed)  # in flight ones are freed once unpinned
                    self.unready.difference_update(removed)
                    dropped += removed
                    continue
                tree.relocate([hid], [dev])
                host.unpublish([hid])
                pool.mark_published([dev])
                self.unready.discard(hid)
                self.counters.demoted_blocks -= 1
                put_back.append((hid, dev))
        released = self.released
        if t.released and released:  # the blocks no step handed out again (those left ``released`` then)
            if len(released) < len(t.released):
                for b in [b for b, owner in released.items() if owner == tid]:
                    del released[b]
            else:
                for b in t.released:
                    if released.get(b) == tid:
                        del released[b]
        if t.swap_out is not None:
            self._swap_out_done(t.swap_out, ok)
        if t.device_pins:
            pool.unpin_copied(t.device_pins)
        if t.held_pins:
            self._unpin_held(t.held_pins)
        if t.host_pins:
            host.unpin_copied(t.host_pins)
        return put_back, dropped

    def _unpin_held(self, block_ids: list[int]) -> None:
        """Release the pins of blocks sequences held; those cached now enter the eviction order below their ancestors.

        A sequence freed while a copy still pinned some of its blocks put
        the others in the eviction order then; the pinned ones enter it only
        now, after their cached ancestors, which would then come up for
        eviction first and be refused as non-leaves (a whole chain a batch at
        a time). So the chains above them enter again too, deepest first
        (:meth:`~akv.core.radix_tree.RadixTree.ancestry`): as if the
        sequences were freed now.
        """
        pool = self.pool
        entered = pool.unpin_copied(block_ids)
        if entered:
            chain = self.tree.ancestry(entered)
            ids = np.array(chain, dtype=np.int64)
            pool.requeue(ids[pool.states(ids) == CACHED].tolist())

    def _note_reused(self, out: StepOutcome) -> None:
        """Record in ``out.wait_transfer`` the newest earlier transfer still reading a block ``out``'s step handed out.

        A block demoted on demand is free at once; while its copy to the
        host is pending, the step that takes it must not let its runner write
        it first, and it is pinned to that transfer (``held_pins``): freed
        again before the copy ran (its request cancelled), it stays in flight
        instead of going to a third owner whose runner has nothing to wait
        for. Call once the step has allocated everything it will.
        O(blocks demoted on demand whose copies are pending).
        """
        released, pool = self.released, self.pool
        if not released:
            return
        ids = np.fromiter(released, dtype=np.int64, count=len(released))
        reused = pool.states(ids) != FREE
        if not reused.any():
            return
        tids = np.fromiter(released.values(), dtype=np.int64, count=len(released))[reused]
        ids = ids[reused]
        reused = ids.tolist()
        if len(reused) == len(released):
            released.clear()
        else:
            for b in reused:
                del released[b]
        for tid in np.unique(tids).tolist():
            self._transfers[tid].held_pins += ids[tids == tid].tolist()
        pool.pin_for_copy(reused)  # freed before the copy ran: in flight, not free under it
        newest = int(tids.max())
        if newest != out.transfer:
            out.wait_transfer = newest if out.wait_transfer is None else max(newest, out.wait_transfer)

    def _reclaimable(self) -> int:
        """Device blocks of held demotions whose copies are pending: a step short of room may take them (O(transfers))."""
        return sum(len(t.held) for t in self._transfers.values()) if self._transfers else 0

    def _reclaim_held(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` device blocks of pending held demotions, oldest transfer first.

        A held demotion keeps its device block in flight until its copy ran
        (the eviction loop's headroom). A step that needs the block now takes
        it as a demotion on demand does: free at once, recorded in
        ``released`` so that the step handing it out waits for that copy
        (:meth:`_note_reused`). Its host block stays unready until then; if
        the copy fails it is not put back (a failed copy fails the manager).

        Returns:
            The blocks freed.
        """
        freed = 0
        for tid in sorted(self._transfers):
            if freed >= num_blocks:
                break
            t = self._transfers[tid]
            if not t.held:
                continue
            k = min(num_blocks - freed, len(t.held))
            devs = [d for d, _ in t.held[:k]]
            del t.held[:k]
            taken = set(devs)
            t.device_pins = [b for b in t.device_pins if b not in taken]
            self.pool.unpin_copied(devs)  # unpublished and unreferenced: free now
            t.released += devs
            self.released.update(dict.fromkeys(devs, tid))
            freed += k
        return freed

    @property
    def num_pending_transfers(self) -> int:
        """Transfers whose copies have not been reported done."""
        return len(self._transfers)

    @property
    def num_device_pinned(self) -> int:
        """Device blocks pending transfers keep in flight (held demotions, swap-outs); free once they complete."""
        return sum(len(t.device_pins) for t in self._transfers.values())

    # ------------------------------------------------------------ demotion
    def _host_room(self, num_blocks: int, protected, out: StepOutcome | None) -> list[int]:
        """Up to ``num_blocks`` host ids for demotion (referenced, unpublished): free ones, then cached leaves dropped.

        A host block dropped for room is taken again at once
        (:meth:`~akv.core.block_pool.BlockPool.evict_reuse`), never free in
        between; the host policy's order decides which, leaves only.
        """
        host, tree = self.host, self.tree
        n = min(num_blocks, host.num_free)
        slots = host.allocate(n) if n > 0 else []
        untried = host.num_cached
        while len(slots) < num_blocks and untried > 0:
            victims = host.evict_begin(min(num_blocks - len(slots), untried), protected)
            if not victims:
                break
            untried -= len(victims)
            removed, refused = tree.remove_leaves(victims)
            host.evict_reuse(removed)
            slots += removed
            if removed:
                self.counters.host_evicted += len(removed)
                if out is not None:
                    out.removed_block_ids.extend(removed)
                if self.unready:
                    self.unready.difference_update(removed)
                untried = host.num_cached
            if refused:
                host.evict_abort(refused, to_mru=True)
        return slots

    def _demote(self, victims: list[int], protected, out: StepOutcome | None, held: bool) -> tuple[int, list[int]]:
        """Move the device leaves among ``victims`` (taken by ``evict_begin``) to the host; the rest is returned.

        Args:
            victims: Device blocks in eviction order, in flight.
            protected: Ids eviction must skip (host ones too).
            out: Where the moves are recorded (``demotes``), if anywhere.
            held: Keep the device blocks in flight until the copy completed
                (background eviction); else free them now (on demand).

        Returns:
            ``(blocks demoted, victims not demoted)`` (those, in order, for the
            caller to drop or put back).
        """
        slots = self._host_room(len(victims), protected, out)
        if not slots:
            return 0, victims
        pool, host = self.pool, self.host
        moved, new, rest = self.tree.demote_leaves(victims, slots, check=False)  # free host ids: never in the tree
        unused = slots[len(new) :]
        if unused:
            host.decref(unused, distinct=True)  # unpublished: back to free
        if not moved:
            return 0, rest
        hits = pool.hit_counts(moved) if pool.counts_hits else None
        if self.sync_copies:
            pool.evict_finish(moved)
            host.cache_allocated(new, hits)  # cached on the host now
        else:
            host.publish_in_flight(new, hits)  # matchable only once the copy ran (``unready``)
            t = self._transfer(out)
            if held:
                pool.evict_hold(moved)
                t.device_pins += moved
                t.held += zip(moved, new)
            else:
                pool.evict_finish(moved)
                t.released += moved
                self.released.update(dict.fromkeys(moved, out.transfer))
            t.host_pins += new
            t.unready += new
            self.unready.update(new)
        if out is not None:
            out.demoted += moved
            out.demoted_to += new
        self.counters.demoted_blocks += len(moved)
        return len(moved), rest

    # ----------------------------------------------------------- promotion
    def _split_hits(self, hits: list[int]) -> int:
        """How many leading ``hits`` are device blocks (the rest are host blocks: device blocks come first)."""
        n = len(hits)
        hb = self.host_base
        if hb is None:
            return n
        while n and hits[n - 1] >= hb:
            n -= 1
        return n

    @property
    def _hits_may_wait(self) -> bool:
        """Whether some hit may be unusable now: a pending copy, or a snapshot save holding host blocks."""
        return bool(self.unready) or (self.host is not None and bool(self.snapshot_hold))

    def _ready_hits(self, hits: list[int], out: StepOutcome | None = None) -> list[int]:
        """``hits`` up to the first block that cannot be used now (all of them when none is pending).

        A block whose pending copy has not completed is unusable, and so is a
        host block a snapshot save holds: promoting it would free its slot
        while the save still reads it. The exception: a block the step of
        ``out`` promoted itself (its runner waits for the step's copies, that
        one among them, before reading any block of the step).
        """
        if not self._hits_may_wait:
            return hits
        unready, hold, hb = self.unready, self.snapshot_hold, self.host_base
        promoted = {d for _, d in out.promotes} if out is not None and out.promotes else ()
        for i, b in enumerate(hits):
            if (b in unready and b not in promoted) or (hb is not None and b >= hb and b in hold):
                return hits[:i]
        return hits

    def _promote(self, host_hits: list[int], device_ids: list[int], out: StepOutcome) -> None:
        """Move ``host_hits`` (a matched path's host part) to the new device blocks ``device_ids`` (referenced).

        The host ids are freed once the copy has read them; the device
        blocks are unready until then. Hit counts carry over, plus this hit.
        """
        pool, host = self.pool, self.host
        self.tree.relocate(host_hits, device_ids)
        pool.mark_published(device_ids)
        if pool.counts_hits:
            pool.set_num_hits(device_ids, (host.hit_counts(host_hits) + 1).tolist())
        host.incref(host_hits, distinct=True)  # out of the host eviction order
        host.unpublish(host_hits)
        if not self.sync_copies:
            t = self._transfer(out)
            host.pin_for_copy(host_hits)
            t.host_pins += host_hits
            pool.pin_for_copy(device_ids)  # freed before the copy ran: in flight, never reused under it
            t.held_pins += device_ids
            t.unready += device_ids
            self.unready.update(device_ids)
        host.decref(host_hits, distinct=True)
        out.promoted += host_hits
        out.promoted_to += device_ids
        self.counters.promoted_blocks += len(host_hits)
