"""Host-tier rules of :class:`~akv.testing.manager_machine.ManagerMachine`: swaps, frees of swapped sequences, evict().

:class:`TierRules` is a mixin of the machine (it uses the hooks and the model
of :class:`~akv.testing.manager_checks.ManagerMachineBase`). With a host
tier drawn for the example:

- ``swap_out``: a live sequence moves to the host tier (``kv.swap_out``); it
  must move exactly its blocks, or be refused with ``PoolExhausted`` when
  the host tier cannot hold them. Sometimes called from an already
  cancelled scope: akv shields it, so it must be applied all the same.
- ``swap_in``: it comes back (``kv.swap_in``), refused exactly when its
  shard's free plus evictable blocks (the shard less what live sequences
  hold: the eviction loop is off in host-tier examples) cannot take all its
  blocks; afterwards it reads back exactly its own history (the machine's
  K/V invariant) in fresh blocks.
- ``free_swapped``: a swapped-out sequence is not live (steps and
  ``sequence()`` raise ``UnknownSequence``) and ``free`` (or a step's
  frees) releases it once.

In every example, ``evict``: ``kv.evict(n)`` (with a host tier: demotions
held in flight until their copies ran), then ``wait_copies``; and
``next_turn``: a conversation's next turn (its last turn freed, the cache
aged by an eviction, a prompt continuing the history), whose blocks may be
on the device, demoted to the host (then promoted) or gone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import anyio
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from akv.core.step import Admit
from akv.errors import PoolExhausted, UnknownSequence
from akv.testing.step_plans import StepPlan

__all__ = ["TierRules"]


async def _from_cancelled_scope(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """``await fn(*args)`` inside a scope cancelled first; ``None`` if the cancellation reached the call."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        return await fn(*args)
    return None


class TierRules:
    """Rules of the host tier (a mixin of :class:`~akv.testing.manager_machine.ManagerMachine`)."""

    #: Sequences swapped out at once, at most.
    max_swapped = 3

    def _swap(self, fn: Callable[..., Awaitable[Any]], sid: Hashable, cancelled: bool) -> int:
        """``fn(sid)``, from a cancelled scope if ``cancelled`` (then it must still return its result)."""
        if not cancelled:
            return self._call(fn, sid)
        moved = self._call(_from_cancelled_scope, fn, sid)
        assert moved is not None, f"{fn.__name__}({sid!r}) from a cancelled scope raised the cancellation"
        event(f"{fn.__name__} from a cancelled scope")
        return moved

    @precondition(lambda self: self.host_blocks and self.model.sequences and len(self.model.swapped) < self.max_swapped)
    @rule(data=st.data(), cancelled=st.booleans())
    def swap_out(self, data: st.DataObject, cancelled: bool) -> None:
        """A live sequence to the host tier: exactly its blocks, or refused for host room."""
        sid = data.draw(st.sampled_from(self._live()), label="seq")
        blocks = len(self.model.sequences[sid].blocks)
        note(f"swap_out {sid} ({blocks} blocks){' from a cancelled scope' if cancelled else ''}")
        try:
            moved = self._swap(self.kv.swap_out, sid, cancelled)
        except PoolExhausted as err:
            note(f"  refused: {err!r}")
            assert err.requested_blocks == blocks > err.free_blocks + err.evictable_blocks, f"{sid}: {err!r}"
            event("swap out refused: host tier full")
            return
        assert moved == blocks, f"{sid}: swap_out moved {moved} blocks, it holds {blocks}"
        self.model.swap_out(sid)
        event("swap out")

    @precondition(lambda self: self.model.swapped and len(self.model.sequences) < self.max_sequences)
    @rule(data=st.data(), cancelled=st.booleans())
    def swap_in(self, data: st.DataObject, cancelled: bool) -> None:
        """A swapped-out sequence back in fresh device blocks, refused exactly when its shard has no room."""
        sid = data.draw(st.sampled_from(sorted(self.model.swapped, key=str)), label="swapped")
        seq = self.model.swapped[sid]
        blocks = len(seq.blocks)
        room = len(self.kv.config.shard_ranges()[seq.shard]) - self.model.held_on(seq.shard)
        note(f"swap_in {sid} ({blocks} blocks, room for {room}){' from a cancelled scope' if cancelled else ''}")
        try:
            moved = self._swap(self.kv.swap_in, sid, cancelled)
        except PoolExhausted as err:
            note(f"  refused: {err!r}")
            have = err.free_blocks + err.evictable_blocks
            if blocks <= room:  # only transiently: its own demotions filled the host tier (see check_append_room)
                assert err.requested_blocks == blocks > have and have < room, f"{sid}: {err!r} with room for {room}"
                moved = self.retry_until_room(lambda: self.kv.swap_in(sid), err, f"swap_in of {sid}")
                event("transient refusal: host tier copies pending")
            else:
                assert (err.requested_blocks, have) == (blocks, room), f"{sid}: {err!r} with room for {room}"
                event("swap in refused")
                return
        assert blocks <= room, f"{sid}: swapped in {blocks} blocks with room for {room}"
        assert moved == blocks, f"{sid}: swap_in brought {moved} blocks back, it had {blocks}"
        self.model.swap_in(sid)
        event("swap in")

    @precondition(lambda self: self.model.swapped)
    @rule(data=st.data(), how=st.sampled_from(["free", "step"]))
    def free_swapped(self, data: st.DataObject, how: str) -> None:
        """A swapped-out sequence is not live; one free (or a step's) releases it and its host blocks."""
        sid = data.draw(st.sampled_from(sorted(self.model.swapped, key=str)), label="swapped")
        note(f"free swapped {sid} ({how})")
        for call in (lambda: self.kv.sequence(sid), lambda: self.kv.append(sid, [1])):
            try:
                self._call(call)
            except UnknownSequence:
                continue
            raise AssertionError(f"swapped-out {sid} answered as live")
        if how == "free":
            assert self._call(self.kv.free, sid) is True, f"{sid} was swapped out"
        else:
            assert list(self._call(self.kv.step, frees=[sid], want_metadata=False).freed) == [sid]
        assert self._call(self.kv.free, sid) is False, f"a second free of {sid} found it"
        del self.model.swapped[sid]

    @precondition(lambda self: self.model.cache and len(self.model.sequences) < self.max_sequences)
    @rule(data=st.data(), aged=st.sampled_from([0, 3, 32, 32]), finish=st.booleans())
    def next_turn(self, data: st.DataObject, aged: int, finish: bool) -> None:
        """A conversation's next turn: the last turn ends, the cache ages, a prompt continues the history.

        With ``finish``, a live sequence with committed full blocks is freed
        and its history continued; else the history is a prefix the model
        says may be cached, an idle one when there is one. ``aged`` cached
        blocks are evicted in between (with a host tier: demoted, so the
        continuation's hits are promoted back).
        """
        bs = self.block_size
        done = [s for s in self._live() if self.model.sequences[s].committed >= bs]
        if finish and done:
            sid = data.draw(st.sampled_from(done), label="finished")
            seq = self.model.sequences[sid]
            namespace, history = seq.namespace, seq.tokens[: seq.committed]
            assert self._call(self.kv.free, sid) is True, f"{sid} was live"
            del self.model.sequences[sid]
            if self.host_blocks:  # its blocks may move tiers (demoted, promoted) before this rule ends
                held = self.model.holders()
                self.real_of = {m: r for m, r in self.real_of.items() if held[m]}
            note(f"finish {sid}")
        else:
            held = self.model.holders()
            idle = [key for key, block in self.model.cache.items() if not held[block]]
            _, namespace, history = data.draw(st.sampled_from(idle or list(self.model.cache)), label="cached prefix")
        if aged:
            self.evict(aged)
        cut = data.draw(st.integers(bs, max(bs, len(history))), label="cut")
        prompt = list(history[:cut]) + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5), label="turn")
        adm = Admit(seq_id=self._fresh_id(), prompt=prompt, namespace=namespace)
        note(f"next turn {adm.seq_id} ns={namespace!r} {prompt}")
        plan = StepPlan(admits=[adm])
        self._run_step(plan, self._call(self.kv.step, admits=plan.admits), data)

    @rule(max_blocks=st.sampled_from([1, 2, 5, 32]))
    def evict(self, max_blocks: int) -> None:
        """``kv.evict`` (the eviction loop's message): cached leaves, demoted with a host tier; then its copies."""
        evicted = self._call(self.kv.evict, max_blocks)
        self._call(self.kv.wait_copies)
        self._poison_free()  # what the evicted blocks held is garbage now, even where a demotion copied it
        note(f"evict {max_blocks} -> {evicted}")
        assert 0 <= evicted <= max_blocks
        if evicted:
            event("evict()")
