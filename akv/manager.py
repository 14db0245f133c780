"""KVCacheManager: the async facade a serving stack embeds.

::

    async with KVCacheManager(KVCacheConfig(num_blocks=4096)) as kv:
        cached = await kv.add_sequence("req-1", prompt_ids)
        ...
        result = await kv.step(commits={"req-1": n}, appends={"req-1": [tok]})

Every call is one message per shard (each shard owns its blocks' prefix tree),
so a scheduler pays the actor round trip once per step, not per token. Calls are
atomic with respect to cancellation: a call is cancellable at one checkpoint
before its message is sent; an idle shard then serves the message on the
caller's task and the result is returned with no await after it; a message
queued for a busy shard runs to completion in its actor (the wait is shielded)
and the cancellation is re-raised right after. A cancelled caller never leaves
a half-applied operation; cleaning up by id (``free`` is idempotent) is always
safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import structlog

from akv.actors.eviction_loop import EvictionLoop
from akv.actors.messages import Step
from akv.actors.pool_shard import PoolShardActor
from akv.actors.runtime import Actor
from akv.config import KVCacheConfig
from akv.core.ids import describe, plain_id
from akv.core.shard_map import ShardMap
from akv.core.step import Admit, StepOutcome, StepRequest
from akv.errors import (
    ActorCrashed,
    InvalidInput,
    ManagerClosed,
    WrongTask,
)
from akv.manager_events import ManagerEvents
from akv.manager_input import metadata_options, step_attributes, step_request
from akv.manager_nesting import check_exit_order, entered
from akv.manager_parts import apply_parts
from akv.manager_queries import ManagerQueries
from akv.manager_results import metrics_snapshot, result_attributes, step_result
from akv.manager_sequence_move import SequenceMoves
from akv.manager_sequences import SequenceCalls
from akv.manager_snapshot import ManagerSnapshots
from akv.manager_start import build_shards, start_executor
from akv.manager_tiers import TierCalls
from akv.obs.metrics import ManagerMetrics, MetricsSnapshot
from akv.obs.tracing import AkvTracer
from akv.results import StepResult
from akv.storage import KVStorage
from akv.storage.shared_memory import stoppable

__all__ = ["Admit", "KVCacheManager"]

#: The manager's tasks besides the actors, by the names they are awaited under.
_BACKGROUND = ("eviction_loop", "stream_worker")


def _no_wake() -> None:
    """A stopped manager's shards wake no eviction loop (nor keep it, and their pools, alive in a cycle)."""


class KVCacheManager(SequenceCalls, ManagerQueries, ManagerEvents, ManagerSnapshots, SequenceMoves, TierCalls):
    """Paged KV cache manager run by asyncio actors (anyio).

    Use it as an async context manager; it starts its actors (prefix tree,
    pool shards, eviction loop, stream worker) in one task group on entry and
    stops them in order on exit (drain, then close).

    Args:
        config: Pool size, block size, model shape, storage and policies.
        logger: structlog logger to bind context on (default
            ``structlog.get_logger("akv")``). akv never configures logging.
        tracer_provider: OpenTelemetry ``TracerProvider`` for akv's spans
            (default: the global one as set when the manager is entered; spans
            are nearly free while none is set).

    Raises:
        ActorCrashed: From any call, and from ``__aexit__``, once an actor has
            crashed; no call hangs.
        ManagerClosed: A call outside ``async with`` or after exit.
    """

    def __init__(self, config: KVCacheConfig, *, logger: Any = None, tracer_provider: Any = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise InvalidInput(f"config must be a KVCacheConfig, got {type(config).__name__}")
        self.config = config
        self.log = (logger or structlog.get_logger("akv")).bind(component="manager")
        self._logger = logger
        self._phase = "new"
        self._failure: ActorCrashed | None = None
        self._shard_map = ShardMap(
            [len(ids) for ids in config.shard_ranges()], config.block_size, config.null_block_id
        )  # owner shard of each sequence when there are several
        self._tg: anyio.abc.TaskGroup | None = None
        #: K/V tensors (None in metadata mode). The model runner writes through
        #: the slot mappings and reads through the block tables.
        self.storage: KVStorage | None = None
        self._tickets: list = []
        self._sharded_lock = anyio.Lock()
        self._shards: list[PoolShardActor] = []
        self._actors: list[Actor] = []
        self._metrics = ManagerMetrics(self._metrics_snapshot)
        self._tracer_provider = tracer_provider
        self._tracer = AkvTracer(tracer_provider)

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> KVCacheManager:
        if self._phase != "new":
            raise ManagerClosed("a KVCacheManager can only be entered once; create a new one")
        cfg = self.config
        self._tracer = AkvTracer(self._tracer_provider)  # picks up a global provider set since __init__
        # On a worker thread: allocating GiBs of pools takes seconds; a cancelled entry (Ctrl-C,
        # SIGTERM, a timeout) returns at once and the thread stops within a chunk.
        stop = threading.Event()
        try:
            self.storage = await anyio.to_thread.run_sync(
                stoppable(partial(KVStorage.from_config, cfg), stop), abandon_on_cancel=True
            )
        except BaseException:
            stop.set()
            raise
        self._executor = await start_executor(self.storage, self.log)
        self._executor.on_failure = self._on_copy_failure
        self._eviction = EvictionLoop(
            self._shards,
            batch_blocks=cfg.eviction_batch_blocks,
            logger=self._logger,
            batch_seconds=self._metrics.eviction_batch_s,
            tracer=self._tracer,
        )
        try:
            shards = build_shards(
                cfg,
                self._executor,
                self._eviction.wake,
                sync_copies=self.storage is None,
                logger=self._logger,
                copy_bytes=self._metrics.copy_bytes,
                tracer=self._tracer,
            )
        except InvalidInput:
            self._executor.close(drain=False)  # nothing was queued; stops the copy process
            raise
        self._shards.extend(shards)  # the eviction loop's list
        self._start_events()
        self._actors: list[Actor] = [*self._shards]
        for actor in self._actors:
            actor.on_crash = self._on_crash
        self._stopped = {name: anyio.Event() for name in (*(a.name for a in self._actors), *_BACKGROUND)}
        self._entered_in = anyio.get_current_task().id
        self._tasks_ended = False
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        entered(self)
        for actor in self._actors:
            self._tg.start_soon(self._run_actor, actor, name=f"akv.{actor.name}")
        self._tg.start_soon(self._run_eviction, name="akv.eviction_loop")
        self._tg.start_soon(self._run_stream_worker, name="akv.stream_worker")
        self._phase = "running"
        self.log.info(
            "manager.started",
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            num_shards=cfg.num_shards,
            model=cfg.model.name,
            storage=cfg.storage,
            device=cfg.device if cfg.storage == "tensors" else None,
            pool_bytes=self.storage.nbytes if self.storage is not None else 0,
        )
        try:
            await self._snapshot_on_enter()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        """Stop the actors in order (drain, then close) and end their task group.

        Raises:
            WrongTask: Called in another task than the one that entered the
                manager (anyio ties a task group to the task that enters it).
                The actors are stopped all the same (no task is left running);
                leaving it again from the entering task ends the task group.
            WrongExitOrder: A manager entered after this one in the same task
                is still open (leave managers in the reverse order of entering
                them). This one's actors are stopped all the same; leaving it
                again after the later ones ends its task group.
            ActorCrashed: An actor crashed while the manager ran (unless the
                ``async with`` body is already raising).
        """
        if self._tg is None:
            return
        if exc_type is None:
            await self._snapshot_on_exit()
        await self._stop_tasks()
        if anyio.get_current_task().id != self._entered_in:
            raise WrongTask(
                "a KVCacheManager must be left in the task that entered it (its actors run in an anyio "
                "task group, which belongs to that task); keep 'async with' in one task, e.g. a lifespan. "
                "Its actors are stopped now; leave it from the entering task to end the task group"
            )
        check_exit_order(self)
        tg, self._tg = self._tg, None
        # Every task has ended by now; the caller's own exception (if any)
        # propagates unchanged instead of inside an exception group.
        await tg.__aexit__(None, None, None)
        if self._failure is not None and exc_type is None:
            raise self._failure

    async def _stop_tasks(self) -> None:
        """Stop every actor and background task (drain, then close) and wait until each has ended."""
        if self._tasks_ended:
            return
        if self._phase == "running":
            self._phase = "closing"
        with anyio.CancelScope(shield=True):
            self._eviction.stop()
            for shard in self._shards:
                shard.close()
            for shard in self._shards:
                await self._stopped[shard.name].wait()
            self._stop_events()
            self._executor.close(drain=self._failure is None)
            for name in _BACKGROUND:
                await self._stopped[name].wait()
        self._tasks_ended = True
        self._executor.on_failure = None  # break the cycles through the manager: refcounting frees its pools
        for actor in self._actors:
            actor.on_crash = None
        for shard in self._shards:
            shard.wake_eviction = _no_wake
        failed = self._failure is not None
        self._phase = "failed" if failed else "closed"
        self.log.info("manager.stopped", failed=failed)

    async def _run_actor(self, actor: Actor) -> None:
        try:
            await actor.run()
        finally:
            self._stopped[actor.name].set()

    async def _run_eviction(self) -> None:
        try:
            await self._eviction.run()
        except Exception as exc:  # a crash of the loop fails the manager like any actor's
            err = ActorCrashed("eviction_loop", exc)
            err.__cause__ = exc
            self.log.error("actor.crashed", actor="eviction_loop", error=repr(exc), exc_info=exc)
            self._on_crash(None, err)
        finally:
            self._stopped["eviction_loop"].set()

    async def _run_stream_worker(self) -> None:
        # A limiter of its own: the copy thread never queues behind the host's
        # threads on anyio's default limiter, nor takes one of its tokens.
        try:
            await anyio.to_thread.run_sync(self._executor.run_forever, limiter=anyio.CapacityLimiter(1))
        except Exception as exc:
            err = ActorCrashed("stream_worker", exc)
            err.__cause__ = exc
            self._on_crash(None, err)
        finally:
            self._stopped["stream_worker"].set()

    def _on_copy_failure(self, error: ActorCrashed) -> None:
        """From the stream worker's thread: a copy failed on the device; fail the manager."""
        self.log.error("actor.crashed", actor="stream_worker", error=repr(error.cause))
        # The executor runs in an anyio worker thread (_run_stream_worker), so this
        # hands the failure to the event loop and waits until every actor is stopped.
        anyio.from_thread.run_sync(self._on_crash, None, error)

    def _on_crash(self, actor: Actor | None, error: ActorCrashed) -> None:
        if self._failure is None:
            self._failure = error
        self._phase = "failed"
        self._eviction.stop()
        for other in self._actors:
            if other is not actor:
                other.stop(error)
        self._executor.close(drain=False)

    def _check_running(self) -> None:
        if self._phase == "running":
            return
        if self._failure is not None:
            # One stored error for every later call: drop the frames of its earlier raises, or
            # its traceback grows with each call and points at where it was raised first.
            raise self._failure.with_traceback(None)
        raise ManagerClosed(f"KVCacheManager is {self._phase}; use it inside 'async with'")

    async def _ask(self, actor: Actor, msg: Any, on_reply: Callable[[Any], object] | None = None) -> Any:
        """Send one message and return the reply; atomic with respect to cancellation.

        ``Actor.ask(shield=True)``: a cancellation at its first checkpoint sends
        nothing; an idle actor then serves the message on this task and the
        reply is returned with no await after it; a queued message is served
        even if the caller is cancelled meanwhile (the wait is shielded), and
        the cancellation is re-raised after the reply, once ``on_reply`` (a
        synchronous ``callable(reply)``) has recorded what must not be lost.

        Raises:
            ActorCrashed, ManagerClosed: The manager is not running.
            AkvError: The actor's typed error for this message.
        """
        self._check_running()
        return await actor.ask(msg, shield=True, on_reply=on_reply)

    # -------------------------------------------------------------- the step
    async def step(
        self,
        *,
        frees: Iterable[Hashable] = (),
        preempted: Iterable[Hashable] = (),
        commits: Mapping[Hashable, int] | None = None,
        forks: Iterable[tuple[Hashable, Sequence[Hashable]]] = (),
        appends: Mapping[Hashable, Any] | None = None,
        admits: Iterable[Admit] = (),
        want_metadata: bool = True,
        block_tables: str = "full",
    ) -> StepResult:
        """Apply one scheduler step: frees, commits, forks, appends, admissions (in that order).

        One message per shard. Appends and admissions are each all-or-nothing;
        those that cannot get blocks are returned in ``rejected`` (the
        scheduler preempts or waits) rather than raised.

        Every sequence id (and namespace) is a plain value: an exact ``str``,
        ``int`` or ``bytes``, a numpy integer (made ``int``), or a tuple of
        these; see :mod:`akv.core.ids`. Anything else is refused before any
        message is sent.

        Args:
            frees: Sequence ids to free (unknown ids are ignored).
            preempted: Sequence ids to free as preemptions (the scheduler will
                re-admit them, with ``Admit(resumed=True)``); freed like
                ``frees`` and counted in ``CacheStats.preemptions``.
            commits: Id -> number of tokens whose K/V the runner has written
                since the last commit. Committed full blocks are published to
                the prefix cache.
            forks: ``(parent_id, child_ids)``: each child shares all the
                parent's blocks (beam search, parallel sampling).
            appends: Id -> new token ids (1-D ints), or a single ``int``
                token (the usual decode step; validated without numpy).
            admits: :class:`Admit` items (prompt as 1-D ints).
            want_metadata: Build block tables and slot mapping: a bool
                (``numpy.bool_`` is accepted and made ``bool``).
            block_tables: ``"full"`` (padded tables in ``block_tables``) or
                ``"updates"`` (for a runner that keeps its own tables: only the
                changed entries, in ``block_table_updates``; see :class:`~akv.results.StepResult`).

        Returns:
            :class:`~akv.results.StepResult` for the model runner.

        Raises:
            InvalidTokens: Bad token ids (nothing applied).
            InvalidInput: An id or namespace that is not a plain value, a
                collection or mapping that is not one or raises while read,
                bad commit counts, empty appends, a ``want_metadata`` that is
                neither ``bool`` nor ``numpy.bool_``, a ``block_tables`` that is
                neither ``"full"`` nor ``"updates"`` (nothing applied).
            UnknownSequence: A commit, fork or append names no live sequence.
            DuplicateSequence: An admission or fork child id is already live.
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        self._check_running()
        want_metadata, updates = metadata_options(want_metadata, block_tables)
        with self._tracer.span("akv.step") as span:
            t0 = time.perf_counter()
            result = await self._step(
                span,
                frees=frees,
                preempted=preempted,
                commits=commits,
                forks=forks,
                appends=appends,
                admits=admits,
                want_metadata=want_metadata,
                block_table_updates=updates,
            )
            self._metrics.step_latency_s.observe(time.perf_counter() - t0)
            if span.is_recording():
                span.set_attributes(result_attributes(result))
            return result

    async def _step(self, span: Any, *, want_metadata: bool, **arguments: Any) -> StepResult:
        """Validate and convert the step's input, then ask the shard(s) (see :meth:`step`)."""
        request = step_request(**arguments, want_metadata=want_metadata, vocab_size=self.config.vocab_size)
        if span.is_recording():
            span.set_attributes(step_attributes(request))
        return await self._ask_step(request)

    async def _ask_step(self, request: StepRequest) -> StepResult:
        """Send a validated step to its shard (or split it over the shards) and build the result."""
        if len(self._shards) == 1:
            outcome, ticket = await self._ask(self._shards[0], Step(request, self._tracer.context()), self._track_step)
            return step_result(outcome, [ticket] if ticket is not None else [])
        return await self._step_sharded(request)

    async def _step_sharded(self, request: StepRequest) -> StepResult:
        """Split a step by shard and send each shard exactly one ``Step``; all parts apply or none.

        :func:`~akv.manager_parts.apply_parts` sends the parts (one shard's
        refusal applies nothing anywhere). Multi-shard steps are serialized
        by a lock, so no other step reaches a shard between its vote and the
        decision. Acquiring the lock is the call's checkpoint (a cancellation
        there applies nothing). If every shard the step touches can serve now,
        the parts are served on this task with no await until the result is
        returned; otherwise they go through the shards' inboxes inside a
        shielded scope, and a cancellation is re-raised once the step is decided.
        """
        async with self._sharded_lock:
            snaps = [s.snapshot for s in self._shards]
            subs, children = self._shard_map.split(
                request, [x.num_free for x in snaps], [x.blocks_available for x in snaps]
            )
            context = self._tracer.context()
            self._check_running()
            replies, direct = await apply_parts(self._shards, subs, context)
            outcomes = [(shard, outcome) for shard, (outcome, _) in replies]
            tickets = [ticket for _, (_, ticket) in replies if ticket is not None]
            for ticket in tickets:
                self._track(ticket)
            self._shard_map.record(outcomes, children)
        if not direct:
            await anyio.lowlevel.checkpoint_if_cancelled()
        if len(outcomes) == 1:
            return step_result(outcomes[0][1], tickets)
        order = [*request.appends, *(adm.seq_id for adm in request.admits)]
        merged = self._shard_map.merge([o for _, o in outcomes], order, want_metadata=request.want_metadata)
        return step_result(merged, tickets)

    def _track_step(self, reply: tuple[StepOutcome, Any]) -> None:
        """``on_reply`` of a one-shard step: record its copy ticket even if the caller is cancelled."""
        self._track(reply[1])

    def _track(self, ticket: Any) -> None:
        """Remember a copy ticket for :meth:`wait_copies` (before a deferred cancellation is re-raised)."""
        if ticket is not None:
            self._tickets = [t for t in self._tickets if not t.done()]
            self._tickets.append(ticket)

    # ------------------------------------------------- one-sequence helpers
    async def free(self, seq_id: Hashable, *, preempted: bool = False) -> bool:
        """Free a sequence's blocks (full published blocks stay cached). Idempotent.

        Shielded from cancellation: it runs to completion even inside a
        cancelled scope (so ``finally: await kv.free(seq_id)`` releases the
        blocks of a cancelled request) and is not itself a cancellation point;
        the cancellation reaches the caller at its next checkpoint.

        Args:
            seq_id: The sequence.
            preempted: The scheduler preempts it (to re-admit later); counted
                in ``CacheStats.preemptions``. A bool (``numpy.bool_`` is
                accepted and made ``bool``).

        Returns:
            True if the sequence was live, False if unknown or already freed.

        Raises:
            InvalidInput: ``seq_id`` is not a plain value (:mod:`akv.core.ids`)
                or ``preempted`` is neither ``bool`` nor ``numpy.bool_``.
            ManagerClosed, ActorCrashed: The manager is not running (its
                sequences are gone with it).
        """
        seq_id = plain_id(seq_id, "seq_id of free()")
        if not isinstance(preempted, (bool, np.bool_)):
            raise InvalidInput(f"preempted must be a bool, got {describe(preempted)}")
        with self._tracer.span("akv.free", attributes={"akv.seq_id": str(seq_id)}), anyio.CancelScope(shield=True):
            if preempted:
                result = await self.step(preempted=(seq_id,), want_metadata=False)
            else:
                result = await self.step(frees=(seq_id,), want_metadata=False)
        return bool(result.freed)

    def _metrics_snapshot(self) -> MetricsSnapshot:
        """Sum the shards' published snapshots (one attribute read each; safe from a scrape thread)."""
        return metrics_snapshot(self.config.num_blocks, [s.snapshot for s in list(self._shards)], list(self._actors))
