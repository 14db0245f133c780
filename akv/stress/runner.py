"""Run the stress workload: N concurrent tasks against one manager, then check everything.

:func:`run_stress` is the library entry point (the ``akv stress`` command and
``stress/run_stress.py`` call it). One run:

1. Starts a :class:`~akv.manager.KVCacheManager` with real CPU tensors and
   ``debug_invariants=True`` (conservation counters checked on every message;
   a violation crashes the manager with ``ActorCrashed``).
2. Runs ``options.sequences`` tasks in one task group until the deadline;
   each loops random programs (:mod:`akv.stress.programs`), some under a
   cancel scope that fires at a random await point, and frees every id it
   may own (shielded) after each program.
3. Checks the end state: ``kv.check()``, no live sequence, every block free
   or cached, nothing in flight, every inbox empty.

With ``inject_crash_after_s`` a shard's handler raises once mid-run: every
task must get an error within ``hang_timeout_s``, ``__aexit__`` must raise
``ActorCrashed``, and a short run on a fresh manager must pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import sniffio
import structlog

from akv.config import MODEL_SHAPES, KVCacheConfig
from akv.errors import ActorCrashed, AkvError, ManagerClosed
from akv.manager import KVCacheManager
from akv.results import CacheStats
from akv.stress.client import Client, GiveUp
from akv.stress.fault import CrashInjector
from akv.stress.metrics import Metrics
from akv.stress.options import StressOptions
from akv.stress.oracle import KVOracle
from akv.stress.programs import PROGRAMS, WEIGHTS
from akv.stress.report import FaultInjection, StressReport
from akv.stress.workload import PromptSource

ProgressFn = Callable[[float, Metrics], None]
_MANAGER_DOWN = (ActorCrashed, ManagerClosed)


def stress_config(options: StressOptions) -> KVCacheConfig:
    """The manager configuration of a run: tiny model, CPU tensors, debug invariants."""
    return KVCacheConfig(
        num_blocks=options.pool_blocks(),
        block_size=options.block_size,
        model=MODEL_SHAPES["tiny"],
        storage="tensors",
        device="cpu",
        low_watermark=options.low_watermark,
        high_watermark=options.high_watermark,
        eviction_batch_blocks=options.eviction_batch_blocks,
        debug_invariants=True,
    )


def current_backend() -> str:
    """``asyncio``, ``uvloop`` or ``trio``: the event loop this coroutine runs on."""
    lib = sniffio.current_async_library()
    if lib == "asyncio" and type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        return "uvloop"
    return lib


@dataclasses.dataclass(kw_only=True, slots=True)
class _Outcome:
    """What one manager's run ended with (beyond the shared :class:`Metrics`)."""

    last_stats: CacheStats | None = None
    check_ran: bool = False
    leaked_blocks: int | None = None
    leaked_sequences: int | None = None
    nonempty_inboxes: dict[str, int] = dataclasses.field(default_factory=dict)
    invariant_violations: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    aexit_raised: bool = False
    eviction_wakeups: int = 0
    # fault injection
    injector: CrashInjector | None = None
    tasks_at_fault: int = 0
    tasks_hung: int = 0

    @property
    def clean(self) -> bool:
        return (
            self.check_ran
            and not self.invariant_violations
            and self.leaked_blocks == 0
            and self.leaked_sequences == 0
            and not self.nonempty_inboxes
        )


class _Session:
    """One manager's workload: shared state of its tasks, monitor and injector."""

    def __init__(self, kv: KVCacheManager, options: StressOptions, metrics: Metrics, outcome: _Outcome, log: Any) -> None:
        cfg = kv.config
        self.kv = kv
        self.options = options
        self.metrics = metrics
        self.outcome = outcome
        self.log = log
        self.oracle = KVOracle(num_layers=cfg.model.num_layers, num_kv_heads=cfg.model.num_kv_heads, head_dim=cfg.model.head_dim)
        self.prompts = PromptSource(options.seed, cfg.block_size)
        self.alive = 0
        self.errored: set[int] = set()
        self.hung_tokens: set[int] = set()
        self.workers: anyio.CancelScope | None = None

    def manager_down(self, index: int, exc: BaseException) -> None:
        """A task saw the manager fail: record when, relative to the injected fault."""
        m, out = self.metrics, self.outcome
        now = time.perf_counter()
        self.errored.add(index)
        if m.manager_failed_at is None:
            m.manager_failed_at = now
            self.log.warning("stress.manager_failed", task=index, error=repr(exc))
        fired = out.injector.fired_at if out.injector is not None else None
        if fired is not None:
            m.error_latencies_s.append(now - fired)
        elif not out.errors:
            out.errors.append(f"task {index}: {exc!r}")

    # --------------------------------------------------------------- tasks
    async def worker(self, index: int, deadline: float) -> None:
        rng = random.Random(f"akv-stress-{self.options.seed}-{index}")
        client = Client(
            self.kv,
            self.oracle,
            self.metrics,
            rng,
            max_retries=self.options.max_retries,
            log=self.log.bind(task=index),
            name=f"t{index}",
            deadline=deadline,
        )
        names, weights = list(WEIGHTS), list(WEIGHTS.values())
        self.alive += 1
        try:
            async with anyio.create_task_group() as helpers:
                while anyio.current_time() < deadline:
                    kind = rng.choices(names, weights)[0]
                    self.metrics.programs[kind] += 1
                    down = False
                    try:
                        await self._program(client, kind, helpers)
                    except GiveUp:
                        self.metrics.gave_up += 1
                    except _MANAGER_DOWN as exc:
                        self.manager_down(index, exc)
                        down = True
                    except AkvError as exc:
                        client.unexpected("error", program=kind, error=repr(exc))
                    except Exception as exc:  # a harness bug must not hide as a hang: report and go on
                        client.unexpected("exception", program=kind, error=repr(exc))
                        self.log.error("stress.exception", exc_info=exc)
                    finally:
                        if not await self._cleanup(client, index):
                            down = True
                    if down:
                        break
                helpers.cancel_scope.cancel()
        finally:
            self.alive -= 1

    async def _cleanup(self, client: Client, index: int) -> bool:
        """Free everything the client may own; False if the manager is down."""
        try:
            await client.cleanup()
        except _MANAGER_DOWN as exc:
            if index not in self.errored:
                self.manager_down(index, exc)
            return False
        return True

    async def _program(self, client: Client, kind: str, helpers: anyio.abc.TaskGroup) -> None:
        program, rng = PROGRAMS[kind], client.rng
        if rng.random() >= self.options.cancel_probability:
            await program(client, self.prompts)
            return
        scope = anyio.CancelScope()
        if rng.random() < 0.5:
            scope.deadline = anyio.current_time() + rng.uniform(0.0, 0.01)
        else:
            helpers.start_soon(_cancel_after_checkpoints, scope, rng.randint(1, 80))
        with scope:
            await program(client, self.prompts)
        if scope.cancelled_caught:
            self.metrics.cancellations += 1

    # ------------------------------------------------------------- monitor
    async def monitor(self, start: float, progress: ProgressFn | None) -> None:
        """Progress, stats snapshots, hang detection, and the fault-injection deadline."""
        m, out, opts = self.metrics, self.outcome, self.options
        tick = 0
        while True:
            await anyio.sleep(0.25)
            tick += 1
            now = time.perf_counter()
            if progress is not None:
                progress(now - start, m)
            for token, (op, began) in list(m.in_flight.items()):
                if now - began > opts.hang_timeout_s and token not in self.hung_tokens:
                    self.hung_tokens.add(token)
                    m.hung_calls += 1
                    self.log.error("stress.hung_call", op=op, pending_s=round(now - began, 3))
            fired = out.injector.fired_at if out.injector is not None else None
            if fired is not None and now - fired > opts.hang_timeout_s and self.alive and self.workers is not None:
                out.tasks_hung = self.alive
                self.log.error("stress.tasks_hung_after_fault", tasks=self.alive)
                self.workers.cancel()
            if tick % 4 == 0 and fired is None and m.manager_failed_at is None:
                with contextlib.suppress(*_MANAGER_DOWN):
                    out.last_stats = await self.kv.stats()
            if tick % 20 == 0:
                self.log.info("stress.progress", elapsed_s=round(now - start, 1), operations=m.operations, corrupted_reads=m.corrupted_reads)

    def on_fault(self) -> None:
        self.outcome.tasks_at_fault = self.alive


async def _cancel_after_checkpoints(scope: anyio.CancelScope, k: int) -> None:
    """Cancel ``scope`` after ``k`` scheduler checkpoints (a no-op if it has exited by then)."""
    for _ in range(k):
        await anyio.lowlevel.checkpoint()
    scope.cancel()


async def _final_check(kv: KVCacheManager, out: _Outcome) -> None:
    await kv.wait_copies()
    try:
        await kv.check()
    except ActorCrashed as exc:
        out.invariant_violations += 1
        out.errors.append(f"final check: {exc!r}")
        return
    stats = await kv.stats()
    out.last_stats = stats
    out.check_ran = True
    out.leaked_blocks = stats.num_blocks - stats.free - stats.cached
    out.leaked_sequences = stats.num_sequences
    out.nonempty_inboxes = {name: depth for name, depth in kv.inbox_depths.items() if depth}


async def run_manager(
    options: StressOptions,
    metrics: Metrics,
    *,
    tasks: int,
    duration_s: float,
    inject_after_s: float | None = None,
    progress: ProgressFn | None = None,
    log: Any = None,
) -> _Outcome:
    """Run ``tasks`` workers for ``duration_s`` against a fresh manager and check its end state."""
    log = log or structlog.get_logger("akv.stress").bind(component="stress")
    out = _Outcome()
    start = time.perf_counter()
    try:
        async with KVCacheManager(stress_config(options)) as kv:
            s = _Session(kv, options, metrics, out, log)
            async with anyio.create_task_group() as tg:
                if inject_after_s is not None:
                    out.injector = CrashInjector(kv, inject_after_s, on_fire=s.on_fault)
                    tg.start_soon(out.injector.run)
                tg.start_soon(s.monitor, start, progress)
                deadline = anyio.current_time() + duration_s
                with anyio.CancelScope() as workers:
                    s.workers = workers
                    async with anyio.create_task_group() as wg:
                        for index in range(tasks):
                            wg.start_soon(s.worker, index, deadline, name=f"akv.stress.task{index}")
                tg.cancel_scope.cancel()
            out.eviction_wakeups = kv._eviction.stats.wakeups  # no public counter for wake-ups yet
            if metrics.manager_failed_at is None:
                await _final_check(kv, out)
    except ActorCrashed as exc:
        out.aexit_raised = True
        if out.injector is None or out.injector.fired_at is None:
            out.invariant_violations = max(out.invariant_violations, 1)
            if not out.errors:
                out.errors.append(f"manager crashed: {exc!r}")
        log.warning("stress.manager_exit_raised", error=repr(exc))
    return out


async def run_stress(options: StressOptions, *, progress: ProgressFn | None = None) -> StressReport:
    """Run the stress harness and return its report.

    Args:
        options: What to run.
        progress: Called about four times a second with the elapsed seconds and
            the live :class:`~akv.stress.metrics.Metrics` (for a progress bar).

    Returns:
        The :class:`~akv.stress.report.StressReport`; ``report.ok`` is the verdict.
    """
    log = structlog.get_logger("akv.stress").bind(component="stress", seed=options.seed)
    backend = current_backend()
    config = stress_config(options)
    log.info(
        "stress.started",
        backend=backend,
        sequences=options.sequences,
        duration_s=options.duration_s,
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        inject_crash_after_s=options.inject_crash_after_s,
    )
    metrics = Metrics()
    start = time.perf_counter()
    out = await run_manager(
        options,
        metrics,
        tasks=options.sequences,
        duration_s=options.duration_s,
        inject_after_s=options.inject_crash_after_s,
        progress=progress,
        log=log,
    )
    elapsed = time.perf_counter() - start
    fault = None
    if options.inject_crash_after_s is not None:
        fault = await _fault_verdict(options, out, metrics, log)
    report = _build_report(options, backend, config, metrics, out, elapsed, fault)
    log.info(
        "stress.finished",
        ok=report.ok,
        failures=report.failures,
        operations=report.operations,
        ops_per_s=report.ops_per_s,
        forks=report.forks,
        cow_copies=report.cow_copies,
        evictions=report.evictions,
        cancellations=report.cancellations,
        corrupted_reads=report.corrupted_reads,
        invariant_violations=report.invariant_violations,
        leaked_blocks=report.leaked_blocks,
    )
    return report


async def _fault_verdict(options: StressOptions, out: _Outcome, metrics: Metrics, log: Any) -> FaultInjection:
    m_fresh = Metrics()
    fresh = await run_manager(
        dataclasses.replace(options, inject_crash_after_s=None),
        m_fresh,
        tasks=min(16, options.sequences),
        duration_s=options.fresh_manager_s,
        log=log.bind(phase="fresh_manager"),
    )
    fresh_ok = fresh.clean and m_fresh.operations > 0 and not (m_fresh.corrupted_reads or m_fresh.unexpected_errors or m_fresh.hung_calls)
    if not fresh_ok:
        log.error("stress.fresh_manager_failed", errors=fresh.errors, corrupted_reads=m_fresh.corrupted_reads)
    inj = out.injector
    latencies = metrics.error_latencies_s
    return FaultInjection(
        injected=inj is not None and inj.fired_at is not None,
        actor=inj.actor if inj is not None else "",
        tasks=out.tasks_at_fault,
        tasks_failed_fast=sum(1 for t in latencies if t <= options.hang_timeout_s),
        tasks_hung=out.tasks_hung,
        max_error_latency_s=round(max(latencies), 6) if latencies else None,
        aexit_raised=out.aexit_raised,
        fresh_manager_ok=fresh_ok,
    )


def _build_report(options, backend, config, metrics: Metrics, out: _Outcome, elapsed: float, fault) -> StressReport:
    st = out.last_stats
    g = (lambda name: getattr(st, name)) if st is not None else (lambda name: 0)
    return StressReport(
        seed=options.seed,
        backend=backend,
        duration_s=round(elapsed, 3),
        sequences=options.sequences,
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        operations=metrics.operations,
        ops_per_s=round(metrics.operations / elapsed, 1) if elapsed > 0 else 0.0,
        calls=dict(sorted(metrics.calls.items())),
        latency_us=metrics.latency_summary(),
        programs=dict(sorted(metrics.programs.items())),
        forks=g("forks"),
        cow_copies=g("cow_copies"),
        evictions=g("blocks_evicted"),
        eviction_batches=g("eviction_batches"),
        eviction_loop_batches=g("eviction_loop_batches"),
        eviction_loop_wakeups=out.eviction_wakeups,
        pool_exhausted=g("pool_exhausted"),
        retries=metrics.retries,
        gave_up=metrics.gave_up,
        cancellations=metrics.cancellations,
        aborts=metrics.aborts,
        verifications=metrics.verifications,
        verified_tokens=metrics.verified_tokens,
        corrupted_reads=metrics.corrupted_reads,
        invariant_violations=out.invariant_violations,
        unexpected_errors=metrics.unexpected_errors,
        hung_calls=metrics.hung_calls,
        leaked_blocks=out.leaked_blocks,
        leaked_sequences=out.leaked_sequences,
        nonempty_inboxes=out.nonempty_inboxes,
        prefix_hit_rate=round(g("hit_rate"), 4),
        max_inbox_depth=dict(g("max_inbox_depth") or {}),
        final_stats={k: g(k) for k in ("free", "active", "cached", "in_flight", "num_sequences", "prefix_cache_blocks")},
        errors=out.errors,
        samples=metrics.samples,
        fault_injection=fault,
    )
