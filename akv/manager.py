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

import operator
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import structlog
import torch

from akv.actors.eviction_loop import EvictionLoop
from akv.actors.messages import Check, Evict, Inspect, InspectBlock, Lookup, Room, Stats, Step, Validate
from akv.actors.pool_shard import PoolShardActor, SequenceInfo, ShardStats
from akv.actors.runtime import Actor
from akv.config import KVCacheConfig
from akv.core.ids import NUMPY_INTEGER_TYPES, all_plain, describe, plain_id, plain_ids
from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepOutcome, StepRequest, empty_metadata
from akv.core.tokens import as_token_array
from akv.errors import (
    ActorCrashed,
    DuplicateSequence,
    InvalidInput,
    InvalidTokens,
    ManagerClosed,
    PoolExhausted,
    UnknownSequence,
    WrongExitOrder,
    WrongTask,
)
from akv.obs.metrics import ManagerMetrics, MetricsSnapshot
from akv.obs.tracing import AkvTracer
from akv.results import NO_COPIES, BlockInfo, CacheStats, CopyCompletion, StepResult
from akv.storage import CopyExecutor, KVStorage

__all__ = ["Admit", "KVCacheManager"]

#: Managers entered in this task (its context), oldest first, so that
#: ``__aexit__`` can refuse to leave one while a later one is still open.
_ENTERED: ContextVar[tuple[weakref.ref, ...]] = ContextVar("akv_entered_managers", default=())

#: The manager's tasks besides the actors, by the names they are awaited under.
_BACKGROUND = ("eviction_loop", "stream_worker")


class KVCacheManager:
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
        self._route: dict[Hashable, int] = {}
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
        self.storage = KVStorage.from_config(cfg)
        self._executor = CopyExecutor(self.storage)
        self._executor.on_failure = self._on_copy_failure
        self._eviction = EvictionLoop(
            self._shards,
            batch_blocks=cfg.eviction_batch_blocks,
            logger=self._logger,
            batch_seconds=self._metrics.eviction_batch_s,
            tracer=self._tracer,
        )
        for index, block_ids in enumerate(cfg.shard_ranges()):
            try:
                state = ShardState(
                    index,
                    block_ids,
                    cfg.block_size,
                    enable_prefix_cache=cfg.enable_prefix_cache,
                    eviction_policy=cfg.eviction_policy,
                    null_block_id=cfg.null_block_id,
                )
            except MemoryError:
                self._shards.clear()
                raise InvalidInput(
                    f"cannot allocate the block metadata of {len(block_ids):,} blocks "
                    f"(states, refcounts and {cfg.block_size} token ids per block) on the host"
                ) from None
            self._shards.append(
                PoolShardActor(
                    state,
                    self._executor,
                    watermarks=cfg.watermark_blocks(len(block_ids)),
                    wake_eviction=self._eviction.wake,
                    debug_invariants=cfg.debug_invariants,
                    inbox_capacity=cfg.inbox_capacity,
                    logger=self._logger,
                    copy_bytes=self._metrics.copy_bytes,
                    tracer=self._tracer,
                )
            )
        self._actors: list[Actor] = [*self._shards]
        for actor in self._actors:
            actor.on_crash = self._on_crash
        self._stopped = {name: anyio.Event() for name in (*(a.name for a in self._actors), *_BACKGROUND)}
        self._entered_in = anyio.get_current_task().id
        self._tasks_ended = False
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        _ENTERED.set((*(r for r in _ENTERED.get() if _is_open(r())), weakref.ref(self)))
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
        await self._stop_tasks()
        if anyio.get_current_task().id != self._entered_in:
            raise WrongTask(
                "a KVCacheManager must be left in the task that entered it (its actors run in an anyio "
                "task group, which belongs to that task); keep 'async with' in one task, e.g. a lifespan. "
                "Its actors are stopped now; leave it from the entering task to end the task group"
            )
        entered = [r() for r in _ENTERED.get()]
        mine = next((i for i, m in enumerate(entered) if m is self), None)
        later = [] if mine is None else [m for m in entered[mine + 1 :] if _is_open(m)]
        if later:
            raise WrongExitOrder(
                f"leave KVCacheManagers in the reverse order of entering them: {len(later)} manager(s) "
                "entered after this one in this task are still open (their task groups nest inside this "
                "one's). Its actors are stopped now; leave it again after those to end its task group"
            )
        _ENTERED.set(tuple(r for r in _ENTERED.get() if r() is not self))
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
            self._executor.close(drain=self._failure is None)
            for name in _BACKGROUND:
                await self._stopped[name].wait()
        self._tasks_ended = True
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
            raise self._failure
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

        Returns:
            :class:`~akv.results.StepResult` for the model runner.

        Raises:
            InvalidTokens: Bad token ids (nothing applied).
            InvalidInput: An id or namespace that is not a plain value, a
                collection or mapping that is not one or raises while read,
                bad commit counts, empty appends, a ``want_metadata`` that is
                neither ``bool`` nor ``numpy.bool_`` (nothing applied).
            UnknownSequence: A commit, fork or append names no live sequence.
            DuplicateSequence: An admission or fork child id is already live.
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        self._check_running()
        if not isinstance(want_metadata, (bool, np.bool_)):
            raise InvalidInput(f"want_metadata must be a bool, got {describe(want_metadata)}")
        want_metadata = bool(want_metadata)
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
            )
            self._metrics.step_latency_s.observe(time.perf_counter() - t0)
            if span.is_recording():
                span.set_attributes(
                    {
                        "akv.scheduled": len(result.seq_ids),
                        "akv.rejected": len(result.rejected),
                        "akv.freed": len(result.freed),
                        "akv.evicted_blocks": result.evicted_blocks,
                        "akv.copy_blocks": sum(t.num_blocks for t in result.copies.tickets),
                        "akv.copy_bytes": result.copies.nbytes,
                    }
                )
            return result

    async def _step(
        self,
        span: Any,
        *,
        frees: Iterable[Hashable],
        preempted: Iterable[Hashable],
        commits: Mapping[Hashable, int] | None,
        forks: Iterable[tuple[Hashable, Sequence[Hashable]]],
        appends: Mapping[Hashable, Any] | None,
        admits: Iterable[Admit],
        want_metadata: bool,
    ) -> StepResult:
        """Validate and convert the step's input, then ask the shard(s) (see :meth:`step`)."""
        if (
            commits is None
            and appends is None
            and _empty_tuple(admits)
            and _empty_tuple(forks)
            and _empty_tuple(preempted)
        ):
            # Frees only (a serving stack's end-of-request call): nothing else to validate.
            request = StepRequest(frees=tuple(_ids(frees, "frees")), want_metadata=want_metadata)
            if span.is_recording():
                span.set_attributes(_step_attributes(request))
            return await self._ask_step(request)
        vocab = self.config.vocab_size
        frees = _ids(frees, "frees")
        preempted = frozenset(_ids(preempted, "preempted"))
        commits = _commit_counts(_mapping(commits, "commits"))
        appends = _mapping(appends, "appends", commits)
        appends_arr = _decode_tokens(appends, vocab)
        if appends_arr is None:
            appends_arr = {seq_id: _append_tokens(seq_id, tokens, vocab) for seq_id, tokens in appends.items()}
        admits_arr = []
        for adm in _items(admits, "admits"):
            if type(adm) is not Admit:
                raise InvalidInput(f"admits must hold Admit items, got {describe(adm)}")
            prompt = as_token_array(adm.prompt, vocab, what=f"prompt of {adm.seq_id!r}")
            admits_arr.append(
                Admit(
                    seq_id=adm.seq_id,
                    prompt=prompt,
                    namespace=adm.namespace,
                    prefill_done=adm.prefill_done,
                    resumed=adm.resumed,
                    max_new_tokens=_max_new_tokens(adm),
                )
            )  # a copy, checked again: the caller's object is not changed (1.4 us, against 2.3 for dataclasses.replace)
        fork_list = []
        for item in _items(forks, "forks"):
            if type(item) not in (tuple, list) or len(item) != 2:
                raise InvalidInput(f"forks must hold (parent_id, child_ids) pairs, got {describe(item)}")
            parent = plain_id(item[0], "fork parent id")
            fork_list.append((parent, tuple(_ids(item[1], f"child ids of {parent!r}"))))
        forks = fork_list
        request = StepRequest(
            frees=(*frees, *preempted),
            preempted=preempted,
            commits=commits,
            forks=forks,
            appends=appends_arr,
            admits=admits_arr,
            want_metadata=want_metadata,
        )
        if span.is_recording():
            span.set_attributes(_step_attributes(request))
        return await self._ask_step(request)

    async def _ask_step(self, request: StepRequest) -> StepResult:
        """Send a validated step to its shard (or split it over the shards) and build the result."""
        if len(self._shards) == 1:
            outcome, ticket = await self._ask(self._shards[0], Step(request, self._tracer.context()), self._track_step)
            return self._result([outcome], [ticket] if ticket is not None else [])
        return await self._step_sharded(request)

    async def _step_sharded(self, request: StepRequest) -> StepResult:
        """Split a step by shard; validate every part, then apply every part (all or nothing).

        Multi-shard steps are serialized by a lock so that no other step can
        change a shard between the validation and the application of a part.
        Acquiring the lock is the call's checkpoint (a cancellation there
        applies nothing). If every shard the step touches can serve now
        (``Actor.can_serve_now``), the parts are validated and applied on this
        task with no await until the result is returned; otherwise they go
        through the shards' inboxes inside a shielded scope, and a
        cancellation is re-raised once every part is applied.
        """
        async with self._sharded_lock:
            route = self._route
            parts: dict[int, dict[str, Any]] = {}

            def part(shard: int) -> dict[str, Any]:
                return parts.setdefault(
                    shard,
                    {"frees": [], "preempted": frozenset(), "commits": {}, "forks": [], "appends": {}, "admits": []},
                )

            def where(seq_id: Hashable) -> int:
                try:
                    return route[seq_id]
                except KeyError:
                    raise UnknownSequence(seq_id) from None

            freed = {seq_id for seq_id in request.frees if seq_id in route}
            for seq_id in request.frees:
                if seq_id in route:
                    part(route[seq_id])["frees"].append(seq_id)
            for fields in parts.values():
                fields["preempted"] = frozenset(s for s in fields["frees"] if s in request.preempted)
            for seq_id, n in request.commits.items():
                part(where(seq_id))["commits"][seq_id] = n
            children: dict[Hashable, int] = {}
            for parent, kids in request.forks:
                shard = children[parent] if parent in children else where(parent)
                part(shard)["forks"].append((parent, kids))
                for kid in kids:
                    if (kid in route and kid not in freed) or kid in children:
                        raise DuplicateSequence(kid)
                    children[kid] = shard
            for seq_id, tokens in request.appends.items():
                shard = children[seq_id] if seq_id in children else where(seq_id)
                part(shard)["appends"][seq_id] = tokens
            free_now = [s.num_free / s.state.pool.num_blocks for s in self._shards]  # unreserved
            admitted: set[Hashable] = set()
            for adm in request.admits:
                if (
                    (adm.seq_id in route and adm.seq_id not in freed)
                    or adm.seq_id in children
                    or adm.seq_id in admitted
                ):
                    raise DuplicateSequence(adm.seq_id)
                admitted.add(adm.seq_id)
                shard = max(range(len(free_now)), key=lambda i: free_now[i])
                free_now[shard] -= (len(adm.prompt) + (adm.max_new_tokens or 0)) / (
                    self.config.block_size * self._shards[shard].state.pool.num_blocks
                )
                part(shard)["admits"].append(adm)
            subs = [
                (shard, StepRequest(**parts[shard], want_metadata=request.want_metadata)) for shard in sorted(parts)
            ]
            context = self._tracer.context()
            self._check_running()
            outcomes, tickets = [], []

            def record(shard: int, reply: tuple[StepOutcome, Any]) -> None:
                outcome, ticket = reply
                self._track(ticket)
                outcomes.append((shard, outcome))
                if ticket is not None:
                    tickets.append(ticket)

            direct = all(self._shards[shard].can_serve_now for shard, _ in subs)
            if direct:  # every part served on this task with no await in between: all or nothing
                for shard, sub in subs:
                    self._shards[shard].serve(Validate(sub))
                for shard, sub in subs:
                    record(shard, self._shards[shard].serve(Step(sub, context)))
            else:
                with anyio.CancelScope(shield=True):  # all shards' parts, or none
                    for shard, sub in subs:
                        await self._shards[shard].ask(Validate(sub))
                    for shard, sub in subs:
                        record(shard, await self._shards[shard].ask(Step(sub, context)))
            for _, outcome in outcomes:
                for seq_id in outcome.freed:
                    route.pop(seq_id, None)
            route.update(children)
            for shard, outcome in outcomes:
                for seq_id in outcome.cached_tokens:
                    route[seq_id] = shard
        if not direct:
            await anyio.lowlevel.checkpoint_if_cancelled()
        order = [*request.appends, *(adm.seq_id for adm in request.admits)]
        return self._result([o for _, o in outcomes], tickets, order, want_metadata=request.want_metadata)

    def _track_step(self, reply: tuple[StepOutcome, Any]) -> None:
        """``on_reply`` of a one-shard step: record its copy ticket even if the caller is cancelled."""
        self._track(reply[1])

    def _track(self, ticket: Any) -> None:
        """Remember a copy ticket for :meth:`wait_copies` (before a deferred cancellation is re-raised)."""
        if ticket is not None:
            self._tickets = [t for t in self._tickets if not t.done()]
            self._tickets.append(ticket)

    def _result(
        self, outcomes: list[StepOutcome], tickets: list, order: list | None = None, *, want_metadata: bool = False
    ) -> StepResult:
        copies = CopyCompletion(tickets) if tickets else NO_COPIES
        if len(outcomes) == 1:
            o = outcomes[0]
            return StepResult(
                seq_ids=tuple(o.seq_ids),
                block_tables=_tensor(o.block_tables),
                context_lens=_tensor(o.context_lens),
                query_start_loc=_tensor(o.query_start_loc),
                slot_mapping=_tensor(o.slot_mapping),
                cached_tokens=o.cached_tokens,
                rejected=o.rejected,
                copies=copies,
                freed=tuple(o.freed),
                evicted_blocks=o.evicted_blocks,
            )
        seq_ids, cached, rejected, freed = [], {}, {}, []
        for o in outcomes:
            seq_ids.extend(o.seq_ids)
            cached.update(o.cached_tokens)
            rejected.update(o.rejected)
            freed.extend(o.freed)
        with_meta = [o for o in outcomes if o.block_tables is not None]
        tables = context = qsl = slots = None
        if with_meta:
            width = max(o.block_tables.shape[1] for o in with_meta)
            tables = np.full(
                (sum(o.block_tables.shape[0] for o in with_meta), width), self.config.null_block_id, dtype=np.int32
            )
            row = 0
            for o in with_meta:
                b, w = o.block_tables.shape
                tables[row : row + b, :w] = o.block_tables
                row += b
            context = np.concatenate([o.context_lens for o in with_meta])
            slots = np.concatenate([o.slot_mapping for o in with_meta])
            lens = np.concatenate([np.diff(o.query_start_loc) for o in with_meta]).astype(np.int64)
            starts = np.zeros(len(lens), dtype=np.int64)
            np.cumsum(lens[:-1], out=starts[1:])
            if order is not None:  # rows back in request order (appends, then admissions)
                position = {seq_id: i for i, seq_id in enumerate(seq_ids)}
                perm = np.array([position[x] for x in order if x in position], dtype=np.intp)
                seq_ids = [seq_ids[i] for i in perm]
                tables, context, lens, starts = tables[perm], context[perm], lens[perm], starts[perm]
                total = int(lens.sum())
                row_of = np.repeat(np.arange(len(lens)), lens)
                offsets = np.zeros(len(lens), dtype=np.int64)
                np.cumsum(lens[:-1], out=offsets[1:])
                slots = slots[starts[row_of] + (np.arange(total) - offsets[row_of])]
            qsl = np.zeros(len(lens) + 1, dtype=np.int32)
            np.cumsum(lens, out=qsl[1:])
        elif order is not None:
            position = {seq_id: i for i, seq_id in enumerate(seq_ids)}
            seq_ids = [x for x in order if x in position]
        if want_metadata and tables is None:  # no shard scheduled anything: empty, as one shard gives
            tables, context, qsl, slots = empty_metadata()
        return StepResult(
            seq_ids=tuple(seq_ids),
            block_tables=_tensor(tables),
            context_lens=_tensor(context),
            query_start_loc=_tensor(qsl),
            slot_mapping=_tensor(slots),
            cached_tokens=cached,
            rejected=rejected,
            copies=copies,
            freed=tuple(freed),
            evicted_blocks=sum(o.evicted_blocks for o in outcomes),
        )

    # ------------------------------------------------- one-sequence helpers
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
            already computed).

        Raises:
            InvalidInput: ``seq_id`` or ``namespace`` is not a plain value.
            InvalidTokens: Empty or bad prompt (nothing allocated).
            InvalidInput: ``max_new_tokens`` is not ``None`` or an ``int >= 0``.
            DuplicateSequence: ``seq_id`` is live.
            PoolExhausted: Transient: not enough free plus evictable blocks now
                (for the prompt and the reservation).
            RequestTooLarge: Permanent: more blocks than the shard holds.
        """
        seq_id = plain_id(seq_id, "seq_id of add_sequence()")
        namespace = plain_id(namespace, "namespace of add_sequence()", allow_none=True)
        with self._tracer.span("akv.add_sequence", attributes={"akv.seq_id": str(seq_id)}) as span:
            adm = Admit(seq_id=seq_id, prompt=prompt, namespace=namespace, max_new_tokens=max_new_tokens)
            result = await self.step(admits=[adm], want_metadata=False)
            if seq_id in result.rejected:
                raise result.rejected[seq_id]
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
                collection of ids.
            UnknownSequence: ``seq_id`` is not live.
            DuplicateSequence: A child id is live or repeated.
        """
        seq_id = plain_id(seq_id, "seq_id of fork()")
        child_ids = tuple(_ids(child_ids, "child_ids of fork()"))
        with self._tracer.span("akv.fork", attributes={"akv.seq_id": str(seq_id)}):
            await self.step(forks=[(seq_id, child_ids)], want_metadata=False)

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
            timeout_s: Longest wait, in seconds (a real ``>= 0``;
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
        if type(timeout_s) not in (int, float) or not timeout_s >= 0:
            raise InvalidInput(f"timeout_s must be a real number >= 0 (math.inf: no limit), got {describe(timeout_s)}")
        if len(self._shards) == 1:
            shard = self._shards[0]
        elif seq_id in self._route:
            shard = self._shards[self._route[seq_id]]
        else:
            raise UnknownSequence(seq_id)
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

    # ---------------------------------------------------------------- metrics
    @property
    def metrics_registry(self) -> Any:
        """This manager's own ``prometheus_client.CollectorRegistry`` (see docs/metrics.md).

        Counters and block gauges are read from the shards at scrape time, so
        they equal :meth:`stats` at any quiescent point; they stay readable
        after exit (final values).
        """
        return self._metrics.registry

    def _metrics_snapshot(self) -> MetricsSnapshot:
        """Read the shards' counters and pool counts (plain reads; safe from a scrape thread)."""
        totals: dict[str, int] = {}
        blocks = {"free": 0, "active": 0, "cached": 0, "in_flight": 0}
        reserved = 0
        for shard in list(self._shards):
            state = shard.state
            c = state.counters
            for name in c.__slots__:
                totals[name] = totals.get(name, 0) + getattr(c, name)
            pool = state.pool
            totals["blocks_freed"] = totals.get("blocks_freed", 0) + pool.blocks_freed
            blocks["free"] += pool.num_free
            blocks["active"] += pool.num_active
            blocks["cached"] += pool.num_cached
            blocks["in_flight"] += pool.num_in_flight
            reserved += state.num_reserved
        return MetricsSnapshot(
            counters=totals,
            blocks=blocks,
            num_blocks=self.config.num_blocks,
            inbox_depths={a.name: a.inbox_depth for a in list(self._actors)},
            reserved_blocks=reserved,
        )

    # ---------------------------------------------------------------- queries
    async def lookup(self, prompt: Any, *, namespace: Hashable = None) -> int:
        """Prompt tokens that would be served from the cache right now; no side effects.

        For cache-aware routers: touches neither recency nor refcounts. With
        ``num_shards > 1`` this is the best shard's count; an admission is
        placed by free blocks, not by prefix, so it may be served fewer
        (docs/architecture.md, "Several shards").

        Args:
            prompt: Token ids, as for :meth:`add_sequence`.
            namespace: As for :meth:`add_sequence`: ``None`` or a plain value
                (:mod:`akv.core.ids`); only blocks cached under an equal
                namespace count.

        Raises:
            InvalidInput: ``namespace`` is not a plain value.
            InvalidTokens: Bad prompt.
        """
        self._check_running()
        namespace = plain_id(namespace, "namespace of lookup()", allow_none=True)
        arr = as_token_array(prompt, self.config.vocab_size, what="prompt")
        results = [await self._ask(shard, Lookup(namespace, arr)) for shard in self._shards]
        return max(results) * self.config.block_size

    async def sequence(self, seq_id: Hashable) -> SequenceInfo:
        """Snapshot of one sequence (tokens, block table, counts).

        Raises:
            UnknownSequence: Not live.
            InvalidInput: ``seq_id`` is not a plain value (:mod:`akv.core.ids`).
        """
        self._check_running()
        seq_id = plain_id(seq_id, "seq_id of sequence()")
        if len(self._shards) == 1:
            return await self._ask(self._shards[0], Inspect(seq_id))
        if seq_id not in self._route:
            raise UnknownSequence(seq_id)
        return await self._ask(self._shards[self._route[seq_id]], Inspect(seq_id))

    async def evict(self, max_blocks: int) -> int:
        """Evict up to ``max_blocks`` cached blocks now; return how many were evicted.

        The path the background eviction loop takes (an ``Evict`` message to a
        shard): only cached leaves of the prefix cache, deepest first, in the
        eviction policy's order within a shard; never a block a sequence
        references or a pending copy pins. An admission's prefix hits are
        protected inside the shard's step, which is atomic, so no message runs
        between its match and its pin. Each shard's policy clock is its own:
        with several shards they are asked in index order, each for what is
        still wanted. Evicted blocks are free at once.

        Args:
            max_blocks: Most blocks to evict (an ``int >= 0``; 0 evicts nothing).

        Returns:
            Blocks evicted (``<= max_blocks``; fewer when fewer are evictable).

        Raises:
            InvalidInput: ``max_blocks`` is not an int ``>= 0`` (a bool is refused).
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        self._check_running()
        if type(max_blocks) not in (int, *NUMPY_INTEGER_TYPES) or max_blocks < 0:
            raise InvalidInput(f"max_blocks must be an int >= 0, got {describe(max_blocks)}")
        want = int(max_blocks)
        if len(self._shards) == 1:
            return await self._ask(self._shards[0], Evict(want)) if want else 0
        evicted = 0
        async with self._sharded_lock:  # not between a sharded step's validation and its application
            for shard in self._shards:
                if evicted >= want:
                    break
                evicted += await self._ask(shard, Evict(want - evicted))
        return evicted

    async def block_info(self, block_id: int) -> BlockInfo:
        """Snapshot of one block: its state, refcount and, if published, its content key.

        The key is computed on demand (``O(depth)`` hashes, in the owning
        shard) from the block's chain in the prefix tree: for the block at
        position ``i`` of a cached prompt it equals
        ``akv.core.block_key.chain_keys(prompt, block_size, namespace)[i]``,
        whichever shard and block id hold it.

        Args:
            block_id: An ``int`` (or numpy integer) in ``[0, num_blocks)``; not a bool.

        Returns:
            A frozen :class:`~akv.results.BlockInfo`.

        Raises:
            InvalidInput: ``block_id`` is not an integer in range (checked
                before any message is sent).
        """
        self._check_running()
        if type(block_id) in NUMPY_INTEGER_TYPES:
            block_id = int(block_id)
        if type(block_id) is not int or not 0 <= block_id < self.config.num_blocks:
            raise InvalidInput(f"block_id must be an int in [0, {self.config.num_blocks}), got {describe(block_id)}")
        shard = next(i for i, ids in enumerate(self.config.shard_ranges()) if block_id in ids)
        return await self._ask(self._shards[shard], InspectBlock(block_id))

    async def wait_copies(self) -> None:
        """Wait until every copy submitted so far has run, and settle the shards.

        A shard releases a finished copy's pins when it serves its next
        message; this call sends one (:class:`Stats`) to each shard that
        published pins not yet released, so right after it returns
        :meth:`stats`, the metrics scrape and the gauges show no block in
        flight for those copies.

        Raises:
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        self._check_running()
        for ticket in list(self._tickets):
            await ticket.wait_async()
        self._tickets = [t for t in self._tickets if not t.done()]
        for shard in self._shards:
            if shard.pinned_copies:
                await self._ask(shard, Stats())

    async def stats(self) -> CacheStats:
        """Snapshot of block states, counters and actor inbox depths."""
        self._check_running()
        shard_stats: list[ShardStats] = [await self._ask(s, Stats()) for s in self._shards]
        tree_blocks = sum(s.prefix_cache_blocks for s in shard_stats)
        c = [s.counters for s in shard_stats]
        prompt = sum(x.prompt_tokens for x in c)
        cached = sum(x.cached_tokens for x in c)
        free = sum(s.free for s in shard_stats)
        depth = {a.name: a.max_inbox_depth for a in self._actors}
        return CacheStats(
            num_blocks=self.config.num_blocks,
            block_size=self.config.block_size,
            free=free,
            active=sum(s.active for s in shard_stats),
            cached=sum(s.cached for s in shard_stats),
            in_flight=sum(s.in_flight for s in shard_stats),
            usage=1.0 - free / self.config.num_blocks,
            num_sequences=sum(s.num_sequences for s in shard_stats),
            prefix_cache_blocks=tree_blocks,
            prompt_tokens=prompt,
            cached_tokens=cached,
            hit_rate=cached / prompt if prompt else 0.0,
            blocks_allocated=sum(x.blocks_allocated for x in c),
            blocks_evicted=sum(x.blocks_evicted for x in c),
            eviction_batches=sum(x.eviction_batches for x in c),
            cow_copies=sum(x.cow_copies for x in c),
            forks=sum(x.forks for x in c),
            sequences_added=sum(x.sequences_added for x in c),
            sequences_freed=sum(x.sequences_freed for x in c),
            pool_exhausted=sum(x.pool_exhausted for x in c),
            eviction_loop_batches=self._eviction.stats.batches,
            eviction_loop_blocks=self._eviction.stats.blocks,
            max_inbox_depth=depth,
            pool_bytes=self.storage.nbytes if self.storage is not None else 0,
            blocks_freed=sum(s.blocks_freed for s in shard_stats),
            preemptions=sum(x.preemptions for x in c),
            sequences_resumed=sum(x.sequences_resumed for x in c),
            resumed_prompt_tokens=sum(x.resumed_prompt_tokens for x in c),
            resumed_cached_tokens=sum(x.resumed_cached_tokens for x in c),
            reserved_blocks=sum(s.reserved for s in shard_stats),
        )

    async def check(self) -> None:
        """Full consistency check at a quiescent point (waits for pending copies first).

        Checks every block's state against refcounts and block tables, the free
        queue, the LRU list, that exactly the published blocks are in the
        prefix tree, that the tree's links are consistent, and that the
        reservations' earmarks add up (at most the free blocks).

        Raises:
            ActorCrashed: An inconsistency was found (the check's AssertionError
                crashes the shard: a broken invariant is never silent).
        """
        self._check_running()
        await self.wait_copies()
        for shard in self._shards:
            await self._ask(shard, Check())

    def block_refcounts(self) -> dict[int, int]:
        """Block id -> refcount of every block that some block table holds (read-only audit view).

        Reads the shards' pools without a message, so take it at a quiescent
        point (no call in flight); it also reads the state a crashed manager
        left behind. The stress harness recounts it from the block tables.

        Returns:
            ``{block_id: refcount}`` for every block with refcount >= 1. O(num_blocks).
        """
        out: dict[int, int] = {}
        for shard in self._shards:
            pool = shard.state.pool
            for b in range(pool.first_block_id, pool.first_block_id + pool.num_blocks):
                if r := pool.refcount(b):
                    out[b] = r
        return out

    @property
    def null_block_id(self) -> int:
        """The block id that pads every block table: ``config.num_blocks`` (see :attr:`KVCacheConfig.null_block_id`).

        Never allocated, cached or evicted; the storage has one block for it
        past the usable ones, so a model runner may read it or write garbage
        into its slots without touching any sequence's K/V.
        """
        return self.config.null_block_id

    @property
    def usage(self) -> float:
        """Fraction of blocks not free (0.0-1.0), as published by the shards after their last message.

        A gauge, read without a message: cheap enough to sample every step.
        """
        if not self._shards:
            return 0.0
        free = sum(s.free_fraction * s.state.pool.num_blocks for s in self._shards)
        return 1.0 - free / self.config.num_blocks

    @property
    def blocks_in_use(self) -> int:
        """Blocks referenced by sequences or pending copies (not free, not merely cached); a gauge."""
        return sum(s.blocks_in_use for s in self._shards)

    @property
    def blocks_available(self) -> int:
        """Free plus evictable blocks, as published by the shards after their last message; a gauge.

        A scheduler can skip an admission that cannot fit (vLLM's ``can_allocate``)
        without a message: a prompt of ``n`` blocks fits at most when
        ``n <= blocks_available`` plus its hits on blocks other sequences hold.
        """
        return sum(s.blocks_available for s in self._shards)

    @property
    def inbox_depths(self) -> dict[str, int]:
        """Messages waiting in each actor's inbox now."""
        return {a.name: a.inbox_depth for a in self._actors}


def _empty_tuple(value: Any) -> bool:
    """Whether ``value`` is ``()`` (a step argument left at its default), without comparing arrays."""
    return type(value) is tuple and not value


def _step_attributes(request: StepRequest) -> dict[str, int]:
    """Span attributes of a step's input: how many items of each kind."""
    return {
        "akv.frees": len(request.frees),
        "akv.preempted": len(request.preempted),
        "akv.commits": len(request.commits),
        "akv.forks": len(request.forks),
        "akv.appends": len(request.appends),
        "akv.admits": len(request.admits),
    }


def _items(values: Any, what: str) -> list:
    """``values`` copied into a list; a string, a non-iterable or a failing iteration is :class:`InvalidInput`."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidInput(f"{what} must be a collection, got {describe(values)}")
    try:
        return list(values)
    except Exception as exc:  # the caller's __iter__ or __len__ raised
        raise InvalidInput(f"{what} could not be read: {describe(exc)}") from exc


def _ids(values: Any, what: str) -> list:
    """A collection of sequence ids as a list of plain ids (a lone string is refused, not split into characters)."""
    return plain_ids(_items(values, what), what)


def _mapping(values: Any, what: str, checked: dict | None = None) -> dict:
    """A copy of a mapping from sequence ids, with plain keys (``None`` is empty).

    A plain ``dict`` is copied as it is when its keys are the very objects, in
    order, of the already checked ``checked`` (a decode loop builds its commits
    and appends from one list of ids: one identity pass, no user code runs) or
    when :func:`~akv.core.ids.all_plain` accepts them; any other mapping is
    read once into a new dict, key by key.

    Args:
        values: The caller's mapping, or ``None``.
        what: Its name, for the message.
        checked: A dict with plain keys (the step's commits), or ``None``.

    Raises:
        InvalidInput: Not a mapping, a key that is not a plain id, two keys
            naming one sequence, or reading the mapping raised.
    """
    if values is None:
        return {}
    if type(values) is dict and (
        (checked and len(checked) == len(values) and all(map(operator.is_, values, checked))) or all_plain(values)
    ):
        return dict(values)
    if not isinstance(values, Mapping):
        raise InvalidInput(f"{what} must be a mapping of sequence id -> value, got {describe(values)}")
    try:
        items = list(values.items())
        out = {plain_id(key, f"a key of {what}"): value for key, value in items}
    except InvalidInput:
        raise
    except Exception as exc:  # the caller's mapping raised while being read
        raise InvalidInput(f"{what} could not be read: {describe(exc)}") from exc
    if len(out) != len(items):
        raise InvalidInput(f"{what} names a sequence more than once")
    return out


def _commit_counts(commits: dict) -> dict:
    """``commits`` (a copy the manager owns) with numpy integer counts made ``int``, in place.

    The shard then checks each count's range; no caller's number type reaches it.

    Raises:
        InvalidInput: A count that is neither an exact ``int`` nor a numpy integer.
    """
    if set(map(type, commits.values())) <= {int}:
        return commits
    for seq_id, n in commits.items():
        if type(n) is int:
            continue
        if type(n) not in NUMPY_INTEGER_TYPES:
            raise InvalidInput(f"commit of {describe(n)} tokens for sequence {seq_id!r}: need an int >= 0")
        commits[seq_id] = int(n)
    return commits


def _fits(room: tuple[int, int, int]) -> bool:
    """Whether a :class:`Room` reply ``(need, free, evictable)`` says there is room."""
    need, free, evictable = room
    return need <= free + evictable


def _is_open(manager: KVCacheManager | None) -> bool:
    """Whether ``manager`` (a dereferenced entry of the entered stack) is alive and not yet left."""
    return manager is not None and manager._tg is not None


def _max_new_tokens(adm: Admit) -> int | None:
    """``adm.max_new_tokens`` as a Python int (or None).

    Raises:
        InvalidInput: Not None and not an integer >= 0 (a bool is refused).
    """
    n = adm.max_new_tokens
    if n is None:
        return None
    if type(n) not in (int, *NUMPY_INTEGER_TYPES) or n < 0:
        raise InvalidInput(f"Admit {adm.seq_id!r}: max_new_tokens must be None or an int >= 0, got {describe(n)}")
    return int(n)


def _append_tokens(seq_id: Hashable, tokens: Any, vocab_size: int) -> int | np.ndarray:
    """One append's tokens: a validated ``int`` for one token, else an int32 array.

    Raises:
        InvalidTokens: A token outside ``[0, vocab_size)`` or not an integer.
    """
    if type(tokens) is int or type(tokens) in NUMPY_INTEGER_TYPES:
        tokens = int(tokens)  # one decode token (an int subclass takes the array path: its __int__ may raise)
        if not 0 <= tokens < vocab_size:
            raise InvalidTokens(f"token appended to {seq_id!r} is {tokens}, outside [0, {vocab_size})")
        return tokens
    return as_token_array(tokens, vocab_size, what=f"tokens appended to {seq_id!r}")


def _decode_tokens(appends: dict, vocab_size: int) -> dict | None:
    """``appends`` (the manager's copy) if it is a decode batch (one valid int token per sequence), else None.

    Checked with a set of types and one numpy range check over the batch
    instead of a Python check per sequence; anything else (token arrays, numpy
    scalars, a bad token) goes through the per-item path, which also words the
    errors.
    """
    if not appends or set(map(type, appends.values())) != {int}:
        return None
    try:
        arr = np.fromiter(appends.values(), dtype=np.int64, count=len(appends))
    except OverflowError:
        return None
    if arr.min() < 0 or arr.max() >= vocab_size:
        return None
    return appends


def _tensor(array: np.ndarray | None) -> torch.Tensor | None:
    return None if array is None else torch.from_numpy(array)
