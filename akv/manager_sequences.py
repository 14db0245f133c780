"""SequenceCalls: one-sequence calls of :class:`~akv.manager.KVCacheManager` (a mixin).

``add_sequence``, ``append``, ``commit`` and ``fork`` are one-item
:meth:`~akv.manager.KVCacheManager.step` calls; ``wait_for_room`` waits on the
owning shard's room event. It relies on the manager's ``step``, ``config``,
``_shards``, ``_shard_map``, ``_tracer``, ``_check_running`` and ``_ask``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import anyio
import numpy as np

from akv.actors.messages import Room
from akv.core.ids import NUMPY_INTEGER_TYPES, describe, plain_id
from akv.core.step import Admit
from akv.errors import InvalidInput, PoolExhausted
from akv.manager_input import ids
from akv.results import StepResult

__all__ = ["SequenceCalls"]


class SequenceCalls:
    """One-sequence helpers of :class:`~akv.manager.KVCacheManager` (see the module docstring)."""

    async def add_sequence(
        self, seq_id: Hashable, prompt: Any, *, namespace: Hashable = None, max_new_tokens: int | None = None
    ) -> int:
        """Add a sequence from its prompt and allocate its blocks (all or nothing).

        Args:
            seq_id: New caller-chosen id (e.g. the request id): an exact
                ``str``, ``int`` or ``bytes``, a numpy integer, or a tuple of
                these (:mod:`akv.core.ids`); not ``None``.
            prompt: Token ids, 1-D ints, non-empty (a list, numpy array or
                torch tensor; a lone integer scalar is a one-token prompt).
            namespace: Prefix-cache namespace (tenant, adapter, model epoch):
                a prompt only hits blocks cached under an equal namespace.
                ``None`` (the default) or a plain value as for ``seq_id``; a
                tagged tuple such as ``("lora", 7)`` is recommended. Values of
                different types never merge (``True`` and ``1.0`` are refused,
                ``numpy.int64(1)`` is ``1``); see :mod:`akv.core.ids`.
            max_new_tokens: Reserve room for this many generated tokens (an
                ``int >= 0``): appends up to ``len(prompt) + max_new_tokens``
                tokens then never raise :class:`~akv.errors.PoolExhausted`;
                this call raises it instead when the room is not there. The
                earmarked blocks stay free but no other sequence may take
                them (``CacheStats.reserved_blocks``); free and preemption
                release them; forked children do not inherit them. ``None``
                (default): no reservation.

        Returns:
            Prompt tokens served from the prefix cache: whole blocks, and never
            the last prompt token (it is always computed), so at most
            ``(len(prompt) - 1) // block_size * block_size``. After computing
            the prompt, commit ``len(prompt) - cached`` tokens (the hits are
            already computed). It returns once the step's copies have run
            (with a host tier: host hits promoted into its blocks, cached
            blocks demoted to make room), so its blocks may be written and
            read at once: the call gives the caller nothing else to wait on.

        Raises:
            InvalidInput: ``seq_id`` or ``namespace`` is not a plain value.
            InvalidTokens: Empty or bad prompt (nothing allocated).
            InvalidInput: ``max_new_tokens`` is not ``None`` or an ``int >= 0``.
            DuplicateSequence: ``seq_id`` is live.
            PoolExhausted: Transient: not enough free plus evictable blocks now
                (for the prompt and the reservation).
            RequestTooLarge: Permanent: more blocks than the shard holds.
            ActorCrashed: A copy of the step failed (the manager has failed).
        """
        seq_id = plain_id(seq_id, "seq_id of add_sequence()")
        namespace = plain_id(namespace, "namespace of add_sequence()", allow_none=True)
        with self._tracer.span("akv.add_sequence", attributes={"akv.seq_id": str(seq_id)}) as span:
            adm = Admit(seq_id=seq_id, prompt=prompt, namespace=namespace, max_new_tokens=max_new_tokens)
            result = await self.step(admits=[adm], want_metadata=False)
            if seq_id in result.rejected:
                raise result.rejected[seq_id]
            await result.copies.wait()  # no-op without copies (no host tier: admissions copy nothing)
            span.set_attribute("akv.cached_tokens", result.cached_tokens[seq_id])
            return result.cached_tokens[seq_id]

    async def append(self, seq_id: Hashable, token_ids: Any) -> StepResult:
        """Append tokens to a sequence (copy-on-write of a shared partial tail first).

        Returns:
            A one-row :class:`~akv.results.StepResult` with the new tokens'
            slot mapping and the copy completion to wait on.

        Raises:
            InvalidInput: ``seq_id`` is not a plain value (:mod:`akv.core.ids`).
            UnknownSequence, InvalidTokens, PoolExhausted, RequestTooLarge.
        """
        seq_id = plain_id(seq_id, "seq_id of append()")
        with self._tracer.span("akv.append", attributes={"akv.seq_id": str(seq_id)}):
            result = await self.step(appends={seq_id: token_ids})
        if seq_id in result.rejected:
            raise result.rejected[seq_id]
        return result

    async def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Report that the K/V of the next ``num_tokens`` tokens of ``seq_id`` is written.

        Raises:
            UnknownSequence: Not live.
            InvalidInput: ``seq_id`` is not a plain value, or ``num_tokens`` is
                not an int in ``[0, appended and not yet committed]``.
        """
        seq_id = plain_id(seq_id, "seq_id of commit()")
        with self._tracer.span("akv.commit", attributes={"akv.seq_id": str(seq_id)}):
            await self.step(commits={seq_id: num_tokens}, want_metadata=False)

    async def fork(self, seq_id: Hashable, child_ids: Sequence[Hashable]) -> None:
        """Fork ``seq_id`` into each of ``child_ids``; children share every block.

        Raises:
            InvalidInput: An id is not a plain value, or ``child_ids`` is not a
                collection of ids or is empty.
            UnknownSequence: ``seq_id`` is not live.
            DuplicateSequence: A child id is live or repeated.
        """
        seq_id = plain_id(seq_id, "seq_id of fork()")
        child_ids = tuple(ids(child_ids, "child_ids of fork()"))
        with self._tracer.span("akv.fork", attributes={"akv.seq_id": str(seq_id)}):
            await self.step(forks=[(seq_id, child_ids)], want_metadata=False)

    async def wait_for_room(self, seq_id: Hashable, num_tokens: int, timeout_s: float) -> None:
        """Wait until the shard of ``seq_id`` has room for it to append ``num_tokens`` tokens.

        Room means the free plus evictable (cached) blocks of the shard that
        owns the sequence, less the blocks other sequences' reservations hold,
        cover the new blocks the append needs plus a copy-on-write copy of a
        shared partial tail. It is a hint, not a hold: another task may take
        the room before this one appends (the append can still be rejected).
        For a guarantee, reserve at admission
        (``add_sequence(..., max_new_tokens=N)``).

        Woken by the shard's frees and evictions (the eviction loop's
        included) and by finished copies (their blocks' pins released)
        through an event, never by polling. Cancellation-safe: it
        only reads, so a cancelled wait leaves nothing behind.

        Every handler that waits while holding blocks keeps them from the
        others: when all of them wait, nobody frees and the pool starves.
        Bound the wait and give the blocks back on timeout::

            try:
                await kv.wait_for_room(seq_id, 1, timeout_s=2.0)
            except PoolExhausted:
                await kv.free(seq_id, preempted=True)  # re-admit later, or answer 503
                raise
            await kv.append(seq_id, token)

        Args:
            seq_id: A live sequence.
            num_tokens: Tokens about to be appended (an ``int >= 1``).
            timeout_s: Longest wait, in seconds (an int, float or numpy float ``>= 0``;
                ``math.inf`` waits without limit).

        Raises:
            PoolExhausted: No room after ``timeout_s``, with the numbers of the
                last look (blocks needed, free blocks this sequence may take,
                evictable blocks).
            UnknownSequence: ``seq_id`` is not live (or was freed meanwhile).
            RequestTooLarge: The sequence would hold more blocks than its shard.
            InvalidInput: A bad ``seq_id``, ``num_tokens`` or ``timeout_s``.
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        self._check_running()
        seq_id = plain_id(seq_id, "seq_id of wait_for_room()")
        if type(num_tokens) not in (int, *NUMPY_INTEGER_TYPES) or num_tokens < 1:
            raise InvalidInput(f"num_tokens must be an int >= 1, got {describe(num_tokens)}")
        if type(timeout_s) not in (int, float, np.float64, np.float32, np.float16) or not timeout_s >= 0:
            raise InvalidInput(f"timeout_s must be a real number >= 0 (math.inf: no limit), got {describe(timeout_s)}")
        timeout_s = float(timeout_s)
        shard = self._shards[0] if len(self._shards) == 1 else self._shards[self._shard_map.owner(seq_id)]
        msg = Room(seq_id, int(num_tokens))
        changed = shard.room_changed()  # taken before each look: a change after it is not missed
        last = [await self._ask(shard, msg)]
        if _fits(last[-1]):
            return
        with anyio.move_on_after(timeout_s):
            while True:
                await changed.wait()
                changed = shard.room_changed()
                if _fits(await self._ask(shard, msg, last.append)):
                    return
        if _fits(last[-1]):  # the deadline passed while the last look was being served
            return
        raise PoolExhausted(*last[-1])


def _fits(room: tuple[int, int, int]) -> bool:
    """Whether a :class:`Room` reply ``(need, free, evictable)`` says there is room."""
    need, free, evictable = room
    return need <= free + evictable
