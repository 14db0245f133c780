"""Swap preemption through a stress task's client: ``swap_out``, ``swap_in``, and both from cancelled scopes.

A mixin of :class:`~akv.stress.client.Client`. The client records which of
its sequences are swapped out (and how many blocks each holds on the host
tier) right after a swap call returns, with no await in between, so an audit
at a quiescent point (:func:`akv.stress.audit.audit`) compares the manager's
host-tier counts with an exact record.

akv shields a swap from cancellation from the moment it is called
(:mod:`akv.manager_tiers`): a swap that was sent is applied, and the
cancellation reaches the caller afterwards. :meth:`ClientSwaps.swap_out_cancelled`
and :meth:`ClientSwaps.swap_in_cancelled` call them from an already cancelled
scope and check exactly that.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import anyio

from akv.errors import PoolExhausted, UnknownSequence

if TYPE_CHECKING:
    from akv.stress.seq_model import SeqModel


def num_blocks(seq: SeqModel, block_size: int) -> int:
    """Blocks a sequence holds: ``ceil(len(tokens) / block_size)`` (its block table, or its host slots when swapped)."""
    return -(-len(seq.tokens) // block_size)


class ClientSwaps:
    """Swap calls of :class:`~akv.stress.client.Client` (a mixin; uses its attributes)."""

    #: Sequence id -> host blocks it holds while swapped out (the audit's record).
    swapped: dict[Hashable, int]

    async def swap_out(self, seq: SeqModel) -> bool:
        """Swap ``seq`` out to the host tier; False when the host tier has no room (it stays live).

        Raises:
            ActorCrashed, ManagerClosed: The manager failed.
        """
        try:
            moved = await self.call("swap_out", self.kv.swap_out, seq.seq_id)
        except PoolExhausted:
            self.metrics.swap_refused += 1
            return False
        self._swapped_out(seq, moved)
        return True

    def _swapped_out(self, seq: SeqModel, moved: int | None) -> None:
        """Record that ``seq`` is swapped out (``moved``: blocks the call reported, if it returned)."""
        want = num_blocks(seq, self.block_size)
        if moved is not None and moved != want:
            self.unexpected("swap_out_blocks", seq_id=seq.seq_id, moved=moved, blocks=want)
        self.swapped[seq.seq_id] = want
        self.metrics.swap_outs += 1

    async def swap_in(self, seq: SeqModel) -> None:
        """Swap ``seq`` back in, retrying while the device pool is exhausted; it must bring every block back.

        Raises:
            GiveUp: Still no room after the retries (it stays swapped out;
                the program's cleanup frees it there).
        """
        moved = await self.retrying("swap_in", lambda: self.call("swap_in", self.kv.swap_in, seq.seq_id))
        self._swapped_in(seq, moved)

    def _swapped_in(self, seq: SeqModel, moved: int | None) -> None:
        want = self.swapped.pop(seq.seq_id, None)
        if moved is not None and moved != want:
            self.unexpected("swap_in_blocks", seq_id=seq.seq_id, moved=moved, blocks=want)
        self.metrics.swap_ins += 1

    async def swap_out_cancelled(self, seq: SeqModel) -> bool:
        """``swap_out`` from a scope cancelled before the call: once sent it must be applied (or refused).

        Returns:
            Whether ``seq`` is swapped out now.
        """
        sent = await self._cancelled_call("swap_out", self.kv.swap_out, seq)
        if sent is None or sent[1]:  # never sent, or refused for host room
            return False
        if sent[0] is not None:  # returned: applied; recorded before any other await
            self._swapped_out(seq, sent[0])
            return True
        if await self._is_live(seq.seq_id):
            return False
        self._swapped_out(seq, None)
        return True

    async def swap_in_cancelled(self, seq: SeqModel) -> bool:
        """``swap_in`` from a scope cancelled before the call: once sent it must be applied (or refused).

        Returns:
            Whether ``seq`` is live again.
        """
        sent = await self._cancelled_call("swap_in", self.kv.swap_in, seq)
        if sent is None or sent[1]:
            return False
        if sent[0] is not None:
            self._swapped_in(seq, sent[0])
            return True
        if not await self._is_live(seq.seq_id):
            return False
        self._swapped_in(seq, None)
        return True

    async def _cancelled_call(self, op: str, fn: Any, seq: SeqModel) -> tuple[int | None, bool] | None:
        """Call ``fn(seq_id)`` inside a scope cancelled first; ``None`` if it was never sent.

        akv shields a swap from the moment it is called and has no
        checkpoint after it, so a call that was sent returns its result; one
        that raises the cancellation instead breaks that contract (counted
        as unexpected; whether it was applied is then asked).

        Returns:
            ``(blocks moved, or None if the call raised the cancellation; refused)``;
            ``refused`` is True when it raised ``PoolExhausted``.
        """
        sent = False

        def mark() -> None:
            nonlocal sent
            sent = True

        moved: int | None = None
        refused = False
        with anyio.CancelScope() as scope:
            scope.cancel()
            try:
                moved = await self.call(op, fn, seq.seq_id, before=mark)
            except PoolExhausted:
                refused = True
        if not sent:  # cancelled while an audit held the gate: never sent
            return None
        self.metrics.cancelled_swaps += 1
        if moved is None and not refused:
            self.unexpected(f"cancelled_{op}_raised", seq_id=seq.seq_id)
        return moved, refused

    async def _is_live(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is live (asked shielded: the program's own scope may be cancelled)."""
        with anyio.CancelScope(shield=True):
            try:
                await self.call("sequence", self.kv.sequence, seq_id)
            except UnknownSequence:
                return False
        return True
