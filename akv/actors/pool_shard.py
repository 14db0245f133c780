"""Pool shard actor: owns one shard's blocks, refcounts, free queue, eviction order, sequences and prefix tree.

A thin shell around :class:`~akv.core.shard_state.ShardState`: it decodes a
message and runs one core method. The state owns the
:class:`~akv.core.radix_tree.RadixTree` of its own blocks: prefix hits are
shard-local (namespace keys carry the shard index), so a shard owning its
tree loses nothing and saves a second actor hop per step (see
docs/architecture.md, "One actor per step"). Copy-on-write
copies go to the stream worker's executor (a non-blocking, thread-safe
submit), and their source and destination blocks stay pinned until the copy
has run: neither can be handed out again while the copy may still read or
write it.

After every message it publishes a :class:`~akv.actors.shard_snapshot.ShardSnapshot`
(:attr:`PoolShardActor.snapshot`: pool counts by state, reservations,
counters), replaced by one attribute assignment, which is all that anyone
outside the actor reads of it (the manager's gauges, ``stats`` and placement,
the eviction loop, the metrics scrape thread); below the low watermark it
wakes the eviction loop (a hint through an event, not an ask). Blocks
earmarked by reservations count as taken there.
Tasks waiting for room (``KVCacheManager.wait_for_room``) wait on
:meth:`PoolShardActor.room_changed`, set after a message that freed
sequences, evicted blocks or raised the free plus evictable blocks, when a
copy batch finishes (its pins may free blocks without any message reaching
the shard), and when the actor stops.

With cache events on (``KVCacheConfig.enable_events``) the step, ``Evict``,
swap, ``Retire`` and snapshot-load (``ImportPublish``) handlers hand what
they changed in the prefix cache to the manager's event sink before they
return (:mod:`akv.events.shard_events`), and so does the settling of a copy
batch that failed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import anyio

from akv.actors.messages import (
    Check,
    Evict,
    Inspect,
    InspectBlock,
    Lookup,
    PendingCopies,
    Retire,
    Room,
    SettleCopies,
    Stats,
    Step,
    SwapIn,
    SwapOut,
)
from akv.actors.runtime import Actor
from akv.actors.shard_copies import ShardCopies
from akv.actors.shard_snapshot import ShardSnapshot, take_snapshot
from akv.actors.shard_views import inspect_block, inspect_sequence
from akv.actors.snapshot_messages import ImportPublish, SnapshotCall
from akv.core.cache_reset import ALL_NAMESPACES, retire_blocks
from akv.core.shard_state import ShardState
from akv.core.step import StepOutcome, StepRequest
from akv.errors import AkvError, PoolExhausted
from akv.events.shard_events import EventSink, ShardEvents
from akv.obs.tracing import AkvTracer


class PoolShardActor(ShardCopies, Actor):
    """Owns a :class:`ShardState`.

    Args:
        state: The shard's core state (owned from now on by this actor alone).
        copy_executor: Stream worker executor with ``submit(src, dst) -> ticket``.
        watermarks: ``(low, high)`` free blocks (see
            :meth:`~akv.config.KVCacheConfig.watermark_blocks`): below ``low``,
            ``wake_eviction`` is called; the eviction loop refills to ``high``.
        wake_eviction: Callback that wakes the eviction loop (must not block).
        debug_invariants: Run the O(1) conservation check after every message.
        inbox_capacity: Inbox bound (messages).
        logger: structlog logger.
        copy_bytes: Histogram (``observe(bytes)``) of each submitted copy batch.
        tracer: :class:`~akv.obs.tracing.AkvTracer` (default: the global provider's).

    Attributes:
        snapshot: The :class:`~akv.actors.shard_snapshot.ShardSnapshot` of the
            shard after the last message it served (one made at start): current
            between messages, replaced (never changed) at the end of every
            message and right after a voted step part is applied, so any task,
            or the metrics scrape thread, may read it without a message.
        index: The shard's index.
    """

    def __init__(
        self,
        state: ShardState,
        copy_executor: Any,
        *,
        watermarks: tuple[float, int],
        wake_eviction: Callable[[], None],
        debug_invariants: bool,
        inbox_capacity: int,
        logger: Any = None,
        copy_bytes: Any = None,
        tracer: Any = None,
    ) -> None:
        super().__init__(f"pool_shard_{state.shard_index}", inbox_capacity, logger)
        self.log = self.log.bind(shard=state.shard_index)
        self.state = state
        self.copy_executor = copy_executor
        #: Free blocks below which the eviction loop is woken (while any block is cached).
        self.low_free_blocks = watermarks[0]
        #: Free blocks the eviction loop refills to.
        self.high_free_blocks = watermarks[1]
        #: Whether evicted blocks are demoted to a host tier (each eviction batch is then a copy batch).
        self.demotes = state.host is not None
        self.wake_eviction = wake_eviction
        self.debug_invariants = debug_invariants
        self.copy_bytes = copy_bytes
        self.tracer = tracer or AkvTracer()
        self._pinned: list[tuple[Any, list[int], int | None]] = []  # (ticket, copy-on-write blocks, tier transfer)
        #: The shard's index (fixed).
        self.index = state.shard_index
        #: The counts after the last message served (see :mod:`akv.actors.shard_snapshot`):
        #: replaced, never changed, so any task or thread may read it.
        self.snapshot: ShardSnapshot = take_snapshot(state, pinned_copies=0, version=0)
        self._room_event: anyio.Event | None = None  # made on demand: no waiter, no cost
        self._room_hint = False  # the message being served freed sequences or evicted blocks
        self._thread_id = threading.get_ident()  # the event loop's thread
        self._schedule: Callable[[Callable[[], object]], object] | None = None
        #: Cache events of the shard (``KVCacheConfig.enable_events``; set by the manager) and their sink.
        self.events: ShardEvents | None = None
        self.sink: EventSink | None = None

    @property
    def num_free(self) -> int:
        """Unreserved free blocks after the last message (``snapshot.num_free``)."""
        return self.snapshot.num_free

    @property
    def free_fraction(self) -> float:
        """Free fraction after the last message, 0.0-1.0 (``snapshot.free_fraction``)."""
        return self.snapshot.free_fraction

    @property
    def blocks_in_use(self) -> int:
        """Active plus in-flight blocks after the last message (``snapshot.blocks_in_use``)."""
        return self.snapshot.blocks_in_use

    @property
    def blocks_available(self) -> int:
        """Unreserved free plus cached blocks after the last message (``snapshot.blocks_available``)."""
        return self.snapshot.blocks_available

    @property
    def pinned_copies(self) -> int:
        """Copy batches whose pins were not released after the last message (``snapshot.pinned_copies``)."""
        return self.snapshot.pinned_copies

    def close(self) -> None:
        """Close as :meth:`Actor.close`, and wake the tasks waiting for room (their next ask fails)."""
        super().close()
        self._wake_room()

    def stop(self, error: BaseException) -> None:
        """Stop as :meth:`Actor.stop`, and wake the tasks waiting for room (their next ask fails)."""
        super().stop(error)
        self._wake_room()

    def handle(self, msg: Any) -> Any:
        """Serve :class:`Step`, :class:`Evict`, :class:`Retire`, :class:`Lookup`, :class:`Room`, :class:`Inspect`, :class:`InspectBlock`, :class:`Stats`, :class:`Check` or a snapshot message
        (:class:`~akv.actors.snapshot_messages.SnapshotCall`).

        Synchronous (it never awaits), so the runtime may run it on an asking
        task when the shard is idle (see :mod:`akv.actors.runtime`). Publishes
        :attr:`snapshot` before it returns, whatever the message.
        """
        self._settle_copies()
        result: Any = None
        if isinstance(msg, Step):
            if msg.vote is None:
                result = self.apply_step(msg, publish=False)
            else:
                self._vote(msg)
        elif isinstance(msg, Evict):
            if self.events is None and self.state.host is None:
                result = self.state.evict(msg.max_blocks)
            else:
                out = StepOutcome()
                result = self.state.evict(msg.max_blocks, out)
                self._changed(out)
            self._room_hint = result > 0
        elif isinstance(msg, (SwapOut, SwapIn)):
            result = self._swap(msg)
        elif isinstance(msg, Retire):
            result = self._retire(msg)
        elif isinstance(msg, Room):
            result = self.state.room(msg.seq_id, msg.num_tokens)
        elif isinstance(msg, Lookup):
            result = self.state.lookup(msg.namespace, msg.prompt)
        elif isinstance(msg, Inspect):
            result = inspect_sequence(self.state, msg.seq_id)
        elif isinstance(msg, InspectBlock):
            result = inspect_block(self.state, msg.block_id)
        elif isinstance(msg, Check):
            self.state.check()
        elif isinstance(msg, PendingCopies):
            result = [ticket for ticket, _, _ in self._pinned]
        elif isinstance(msg, SnapshotCall):
            result = msg.apply(self.state)
            if self.events is not None and isinstance(msg, ImportPublish):  # a load's blocks entered the cache
                self.sink.emit(self.events.loaded(msg.block_ids))
        elif not isinstance(msg, (Stats, SettleCopies)):
            raise TypeError(f"{self.name}: unknown message {type(msg).__name__}")
        self._after()
        return self.snapshot if isinstance(msg, Stats) else result

    def _vote(self, msg: Step) -> None:
        """Validate this shard's part of a multi-shard step and vote; the last voter decides (see :class:`StepVote`)."""
        vote, req = msg.vote, msg.request
        try:
            self.state.validate(req)
            if req.forks and self.state.num_reserved_seqs:
                self.state.fork_room(req.forks)
        except AkvError as exc:
            vote.refuse(msg.part, exc)
        else:
            vote.accept(msg.part, self, msg)
        if vote.complete:
            with self.sink.batch() if self.sink is not None else contextlib.nullcontext():
                vote.finish(self)

    def _changed(self, out: StepOutcome) -> Any:
        """Submit the copies of a non-step change to the prefix cache and emit its events; the copy ticket or None."""
        ticket = self._submit_copies(out) if out.copies or out.transfer is not None else None
        if self.events is not None:
            self.sink.emit(self.events.step_events(out))
        return ticket

    def _swap(self, msg: SwapOut | SwapIn) -> tuple[int, Any]:
        """Swap a sequence out or in (:mod:`akv.core.swap`): ``(blocks, copy ticket or None)``."""
        out = StepOutcome()
        self._room_hint = True
        try:
            if isinstance(msg, SwapOut):
                blocks = self.state.swap_out(msg.seq_id, out)
            else:
                blocks = self.state.swap_in(msg.seq_id, out)
        except AkvError:
            self._changed(out)  # refused, but room made by evicting stays made: its copies and events go out
            raise
        if isinstance(msg, SwapOut):
            self.log.debug("sequence.swapped_out", seq_id=msg.seq_id, blocks=blocks)
        else:
            self.log.debug("sequence.swapped_in", seq_id=msg.seq_id, blocks=blocks)
        return blocks, self._changed(out)

    def _retire(self, msg: Retire) -> tuple[int, int]:
        """Retire the prefix cache (all of it, or one namespace): ``(blocks retired, blocks freed now)``."""
        retired, freed = retire_blocks(self.state, msg.namespace)
        if self.events is not None:
            self.sink.emit(self.events.retired(retired, msg.event))
        self._room_hint = freed > 0
        everything = msg.namespace is ALL_NAMESPACES
        self.log.info("prefix_cache.retired", blocks=len(retired), freed_blocks=freed, all_namespaces=everything)
        return len(retired), freed

    def apply_step(self, msg: Step, *, publish: bool) -> tuple[StepOutcome, Any]:
        """Apply ``msg.request`` to the shard: the outcome and the copy ticket (or None).

        Called by :meth:`handle`, and by :meth:`StepVote.finish` for a part
        this shard accepted (on the task of the shard that voted last: handlers
        never await, so no other handler is running then).

        Args:
            msg: The step (or part of one).
            publish: Publish the snapshot right after (a part applied outside
                this shard's own message); :meth:`handle` publishes otherwise.

        Raises:
            AkvError: The request's input error (nothing applied); a voted
                part was validated already and does not raise one.
        """
        with self.tracer.span("akv.shard_step", context=msg.context) as span:
            allocated = self.state.counters.blocks_allocated
            outcome: StepOutcome = self.state.step(msg.request)
            ticket = self._submit_copies(outcome) if outcome.copies or outcome.transfer is not None else None
            if ticket is None and outcome.wait_transfer is not None:
                ticket = self._earlier_ticket(outcome)
            if self.events is not None:
                self.sink.emit(self.events.step_events(outcome))
            if span.is_recording():
                span.set_attributes(
                    {
                        "akv.shard": self.index,
                        "akv.blocks_allocated": self.state.counters.blocks_allocated - allocated,
                        "akv.evicted_blocks": outcome.evicted_blocks,
                        "akv.scheduled": len(outcome.seq_ids),
                        "akv.rejected": len(outcome.rejected),
                        "akv.free_blocks": self.state.pool.num_free,
                    }
                )
        self._log_step(msg.request, outcome)
        self._room_hint = bool(outcome.freed or outcome.evicted_blocks)
        if publish:
            self._after()
        return outcome, ticket

    def _log_step(self, request: StepRequest, outcome: StepOutcome) -> None:
        """Debug events of one step, each carrying the sequence that caused it (see docs/logging.md)."""
        log, seqs = self.log, self.state.sequences
        enabled = getattr(log, "is_enabled_for", None)  # structlog's filtering loggers have it
        if enabled is not None and not enabled(logging.DEBUG):
            if outcome.rejected:
                self._log_rejected(outcome)
            return
        for seq_id in outcome.freed:
            log.debug("sequence.freed", seq_id=seq_id, preempted=seq_id in request.preempted)
        for parent_id, child_ids in request.forks:
            parent = seqs.get(parent_id)
            blocks = len(parent.block_ids) if parent is not None else None
            log.debug("sequence.forked", seq_id=parent_id, child_ids=list(child_ids), shared_blocks=blocks)
        for adm in request.admits:
            if adm.seq_id in outcome.cached_tokens:
                seq = seqs[adm.seq_id]
                log.debug(
                    "sequence.added",
                    seq_id=adm.seq_id,
                    prompt_tokens=len(adm.prompt),
                    cached_tokens=outcome.cached_tokens[adm.seq_id],
                    blocks=len(seq.block_ids),
                    resumed=adm.resumed,
                )
        self._log_rejected(outcome)

    def _log_rejected(self, outcome: StepOutcome) -> None:
        log = self.log
        for seq_id, err in outcome.rejected.items():
            if isinstance(err, PoolExhausted):
                log.debug(
                    "pool.exhausted",
                    seq_id=seq_id,
                    requested_blocks=err.requested_blocks,
                    free_blocks=err.free_blocks,
                    evictable_blocks=err.evictable_blocks,
                )
            else:
                log.info(
                    "request.too_large",
                    seq_id=seq_id,
                    requested_blocks=err.requested_blocks,
                    num_blocks=err.num_blocks,
                )

    def _after(self) -> None:
        """Publish the snapshot; wake the room waiters and the eviction loop if it says so."""
        before = self.snapshot
        self.snapshot = snap = take_snapshot(self.state, pinned_copies=len(self._pinned), version=before.version + 1)
        available = snap.blocks_available
        if self._room_event is not None and (self._room_hint or available > before.blocks_available):
            self._wake_room()
        self._room_hint = False
        if snap.num_free + snap.demoting < self.low_free_blocks and snap.cached:
            self.wake_eviction()
        if self.debug_invariants:
            self.state.check_counters()

    def block_refcounts(self) -> dict[int, int]:
        """The shard's audit call: block id -> refcount of every block a block table holds.

        Synchronous and O(num_blocks): it reads the shard's own pool, so call
        it at a quiescent point (no message in flight; handlers never await,
        so the actor is never half-way through one when another task runs).
        It also works once the actor has stopped or crashed: the state it
        leaves behind is kept, and this reads it as it was when the actor
        stopped, the point its last :attr:`snapshot` describes.

        Returns:
            ``{block_id: refcount}`` for every block with refcount >= 1.
        """
        return _refcounts(self.state.pool)

    def host_block_refcounts(self) -> dict[int, int]:
        """The same audit call for the host tier: host id -> refcount of every host block a swapped-out sequence holds.

        Host ids are tree ids (``host_base + slot``); empty without a host tier.
        """
        host = self.state.host
        return {} if host is None else _refcounts(host)


def _refcounts(pool: Any) -> dict[int, int]:
    """Block id -> refcount of every referenced block of ``pool`` (O(num_blocks))."""
    out: dict[int, int] = {}
    for b in range(pool.first_block_id, pool.first_block_id + pool.num_blocks):
        if r := pool.refcount(b):
            out[b] = r
    return out
