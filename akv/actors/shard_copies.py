"""Copies of a pool shard in the stream worker: submitted with each step, settled at a later message.

A step's copies (copy-on-write pairs, and with a host tier the demotions,
promotions and swaps of :mod:`akv.core.tiers` and :mod:`akv.core.swap`) go to
the stream worker as one batch, in three phases: device to host, device to
device, host to device (:meth:`ShardCopies._submit_copies`). Until the batch
has run, its copy-on-write blocks stay pinned and its tier transfer stays
open. When it finishes, the shard settles it (releases them,
:meth:`ShardCopies._settle_copies`) on the event loop at once if it is idle,
else at the first message queued; so the state the shard publishes never
runs ahead of the copies (nor do its cache events: a failed held demotion's
return to the device is published there), and the tasks waiting for room are woken.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import anyio
import numpy as np

from akv.actors.messages import SettleCopies
from akv.core.step import StepOutcome
from akv.errors import AkvError
from akv.storage.copy_ticket import loop_scheduler


class ShardCopies:
    """Copy submission and settling; a mixin of :class:`~akv.actors.pool_shard.PoolShardActor` (uses its attributes)."""

    __slots__ = ()

    def room_changed(self) -> anyio.Event:
        """An event set once room may have grown (or the actor stopped); take it before asking :class:`Room`.

        Set after the first later message that freed a sequence, evicted
        blocks or raised :attr:`blocks_available`, or once a copy batch
        finishes (its pins released, blocks may be free); a fresh event after that.
        """
        if self._room_event is None:
            self._room_event = anyio.Event()
        self._know_loop()
        return self._room_event

    def _know_loop(self) -> None:
        """Remember this event loop's thread-safe scheduler, for wake-ups and settling from the copy thread."""
        if self._schedule is None:
            with contextlib.suppress(RuntimeError):  # no event loop (a bare handler): the next message settles
                self._schedule = loop_scheduler()

    def _wake_room(self) -> None:
        if self._room_event is not None:
            self._room_event.set()
            self._room_event = None

    def _submit_copies(self, outcome: StepOutcome) -> Any:
        """Submit a step's copies to the stream worker; pin their blocks until they ran (see the module docstring)."""
        state = self.state
        src = [s for s, _ in outcome.copies]
        dst = [d for _, d in outcome.copies]
        hb = state.host_base
        tiered = hb is not None and (outcome.demoted or outcome.promoted or outcome.swap_outs or outcome.swap_ins)
        to_host = to_device = 0
        with self.tracer.span("akv.copy_blocks") as span:
            try:
                if tiered:
                    d2h_src = outcome.demoted + [d for d, _ in outcome.swap_outs]
                    d2h_dst = np.array(outcome.demoted_to + [h for _, h in outcome.swap_outs], dtype=np.int64) - hb
                    h2d_src = np.array(outcome.promoted + [h for h, _ in outcome.swap_ins], dtype=np.int64) - hb
                    h2d_dst = outcome.promoted_to + [d for _, d in outcome.swap_ins]
                    to_host, to_device = len(d2h_src), len(h2d_src)
                    ticket = self.copy_executor.submit_own(d2h_src, d2h_dst, src, dst, h2d_src, h2d_dst)
                else:
                    ticket = self.copy_executor.submit(src, dst)
            except AkvError as exc:
                # The step is applied and cannot be taken back without its copies:
                # a broken stream worker fails the manager.
                raise RuntimeError(f"stream worker refused copies: {exc}") from exc
            nbytes = getattr(ticket, "nbytes", 0)
            if span.is_recording():
                blocks = len(src) + to_host + to_device
                span.set_attributes({"akv.shard": state.shard_index, "akv.blocks": blocks, "akv.bytes": nbytes})
        self._pinned.append((ticket, src + dst, outcome.transfer))
        self._know_loop()
        ticket.add_done_callback(self._copy_done)
        if self.copy_bytes is not None:
            self.copy_bytes.observe(nbytes)
        if src:
            self.log.debug(
                "cow.copy",
                blocks=len(src),
                seq_ids=outcome.copy_seq_ids[:16],
                src_block_ids=src[:16],
                dst_block_ids=dst[:16],
            )
        if tiered:
            self.log.debug("tier.copy", to_host_blocks=to_host, to_device_blocks=to_device)
        return ticket

    def _earlier_ticket(self, outcome: StepOutcome) -> Any:
        """The ticket a step without copies of its own must wait on: the batch of ``outcome.wait_transfer``.

        That step handed out a block an earlier step demoted on demand (free
        at once) whose copy to the host may still be pending
        (:meth:`~akv.core.tiers.ShardTiers._note_reused`); its runner must
        not write the block before that copy read it. None once that batch
        was settled (it ran).
        """
        tid = outcome.wait_transfer
        for ticket, _, transfer in self._pinned:
            if transfer == tid:
                return ticket
        return None

    def _copy_done(self, ticket: Any) -> None:
        """Done callback of a copy batch: have the event loop settle it (:meth:`_copy_finished`).

        Runs on the copy worker's thread (or the copy process's reader
        thread), or on this one when the batch was done at once: the message
        being served, or the next one, settles it then (:meth:`_settle_copies`),
        and the tasks waiting for room are woken now. A waiter that takes the
        event after this read finds the batch done at its own ask: no wake-up
        is lost.
        """
        if threading.get_ident() == self._thread_id:
            self._wake_room()
            return
        if self._schedule is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended: nothing is left to settle
                self._schedule(self._copy_finished)  # non-blocking: the copy thread never waits on the loop

    def _copy_finished(self) -> None:
        """On the event loop, after a batch finished: settle it now if the shard is idle, then wake the room waiters.

        Settling when the copies end, rather than at the next message, takes
        it off the next step's path (a runner's loop is idle while its
        forward pass runs) and releases the pins and held blocks sooner. A
        shard with messages queued settles at the first of them, as before.
        """
        if self._pinned and self.can_serve_now:
            with contextlib.suppress(AkvError):  # ActorCrashed: the shard stopped and the manager was told
                self.serve(SettleCopies())
        self._wake_room()

    def _settle_copies(self) -> None:
        """Release the pins and transfers of the copy batches that have finished (in submission order).

        Held demotions whose copy failed go back to the device, or leave the
        tree (:meth:`~akv.core.tiers.ShardTiers.transfer_done`); with events
        on, that is a batch of its own (``BlockRemoved`` from ``"host"``, then
        ``BlockStored`` in ``"device"``), or the next part of a multi-shard
        batch that is open (after this shard's earlier part, as it happened).
        """
        pinned = self._pinned
        done = 0
        state = self.state
        for ticket, blocks, transfer in pinned:
            if not ticket.done():
                break  # one executor runs the batches in submission order: the rest are pending too
            done += 1
            if blocks:
                state.release_copy_pins(blocks)
            if transfer is not None:
                put_back, dropped = state.transfer_done(transfer, ticket.exception() is None)
                self._room_hint = True
                if (put_back or dropped) and self.events is not None:
                    self.sink.emit(self.events.put_back(put_back, dropped))
        if done:
            del pinned[:done]
