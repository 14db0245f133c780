"""Swap preemption through the host tier: ``swap_out`` and ``swap_in`` (a mixin of :class:`~akv.manager.KVCacheManager`).

Both send one message to the sequence's shard (:mod:`akv.core.swap`) and
return once the copies it submitted have run, so the caller never sees a
half-moved sequence: after ``swap_out`` returns its device blocks are
released and its K/V are on the host; after ``swap_in`` returns its blocks
hold exactly what they held before, and the model runner may read them. Both
are shielded from cancellation (a cancelled caller's call still completes;
the cancellation reaches the caller afterwards), and with several shards
they take the lock of multi-shard steps, as ``evict`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable

import anyio

from akv.actors.messages import SwapIn, SwapOut
from akv.core.ids import plain_id


class TierCalls:
    """A mixin of :class:`~akv.manager.KVCacheManager` (uses its attributes)."""

    __slots__ = ()

    async def swap_out(self, seq_id: Hashable) -> int:
        """Move a live sequence's blocks to the host tier and release its device blocks.

        A scheduler preempting ``seq_id`` calls this instead of
        ``free(seq_id, preempted=True)`` when it wants to resume it without
        recomputing its K/V. Every block of its table is copied to a host
        slot it holds while swapped out; its device blocks are released as a
        free releases them (published ones stay cached). While swapped out it
        is not live (steps naming it raise :class:`~akv.errors.UnknownSequence`);
        ``free(seq_id)`` drops it and its host slots.

        Args:
            seq_id: A live sequence (a plain value, :mod:`akv.core.ids`).

        Returns:
            The number of blocks moved.

        Raises:
            InvalidInput: ``seq_id`` is not a plain value, or the manager has
                no host tier (``KVCacheConfig.host_blocks``).
            UnknownSequence: ``seq_id`` is not live.
            PoolExhausted: The host tier cannot hold its blocks (host block
                counts); nothing is swapped.
            ManagerClosed, ActorCrashed: The manager is not running, or the
                copy failed (a failed copy fails the manager).
        """
        seq_id = plain_id(seq_id, "seq_id of swap_out()")
        return await self._swap(SwapOut(seq_id), "akv.swap_out")

    async def swap_in(self, seq_id: Hashable) -> int:
        """Bring a swapped-out sequence back: fresh device blocks for all its blocks, or nothing.

        Room is made as for an admission (evicting or demoting cached
        blocks). On return the copies have run and the sequence is live
        again with exactly the history, K/V and committed count it had; its
        reservation (``max_new_tokens``) is earmarked again.

        Args:
            seq_id: A swapped-out sequence.

        Returns:
            The number of blocks brought back.

        Raises:
            InvalidInput: ``seq_id`` is not a plain value, or the manager has
                no host tier.
            UnknownSequence: ``seq_id`` is not swapped out.
            DuplicateSequence: ``seq_id`` is live.
            PoolExhausted: Not enough device blocks even after eviction;
                it stays swapped out.
            RequestTooLarge: It holds more blocks than its shard.
            ManagerClosed, ActorCrashed: The manager is not running.
        """
        seq_id = plain_id(seq_id, "seq_id of swap_in()")
        return await self._swap(SwapIn(seq_id), "akv.swap_in")

    async def _swap(self, msg: SwapOut | SwapIn, span_name: str) -> int:
        """Send ``msg`` to the sequence's shard and wait for its copies, shielded (see the module docstring)."""
        self._check_running()
        sharded = len(self._shards) > 1
        with (
            self._tracer.span(span_name, attributes={"akv.seq_id": str(msg.seq_id)}),
            anyio.CancelScope(shield=True),
        ):
            async with self._sharded_lock if sharded else contextlib.nullcontext():
                shard = self._shards[self._shard_map.owner(msg.seq_id)] if sharded else self._shards[0]
                blocks, ticket = await self._ask(shard, msg, self._track_swap)
            if ticket is not None:
                await ticket.wait_async()
        return blocks

    def _track_swap(self, reply: tuple[int, object]) -> None:
        """``on_reply`` of a swap: record its copy ticket for :meth:`wait_copies`."""
        self._track(reply[1])
