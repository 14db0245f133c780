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
3. Checks the end state: ``kv.check()``, no live or swapped-out sequence,
   every block free or cached (with a host tier: on both tiers), nothing in
   flight, every inbox empty, and a last audit (:mod:`akv.stress.audit`:
   refcounts recounted from the block tables, both tiers' block states
   against the tasks' record of swapped-out sequences, the prefix cache
   against the harness's record).
4. Probes the eviction order of every policy and the leaves-only rule
   (:mod:`akv.stress.probe`).

With a fatal fault (:mod:`akv.stress.fault`) every task must get an error
within ``hang_timeout_s``, ``__aexit__`` must raise ``ActorCrashed``, the
state the manager left behind is recounted (:func:`~akv.stress.audit.postmortem`)
for the leak figures, and a short run on a fresh manager must pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import anyio
import structlog

from akv.config import MODEL_SHAPES, KVCacheConfig
from akv.errors import ActorCrashed
from akv.manager import KVCacheManager
from akv.stress.audit import audit, postmortem
from akv.stress.event_check import EventCheck
from akv.stress.fault import COPY_FAULTS, FaultInjector
from akv.stress.kv_io import quiesce
from akv.stress.metrics import Metrics
from akv.stress.options import StressOptions
from akv.stress.probe import EXPECTED_ORDER, probe_eviction_order, probe_pending_hits, probe_pinned_child
from akv.stress.report import FaultInjection, StressReport
from akv.stress.session import Outcome, ProgressFn, Session


def stress_config(options: StressOptions) -> KVCacheConfig:
    """The manager configuration of a run: tiny model, CPU tensors, debug invariants."""
    return KVCacheConfig(
        num_blocks=options.pool_blocks(),
        block_size=options.block_size,
        model=MODEL_SHAPES["tiny"],
        storage="tensors",
        device="cpu",
        num_shards=options.shards,
        eviction_policy=options.policy(),
        low_watermark=options.low_watermark,
        high_watermark=options.high_watermark,
        eviction_batch_blocks=options.eviction_batch_blocks,
        debug_invariants=True,
        enable_events=options.events,
        host_blocks=options.host_blocks,
        host_gib=options.host_gib,
        copy_process=options.fault not in COPY_FAULTS,  # those wrap the worker thread's copier
    )


def current_backend() -> str:
    """``asyncio``, ``uvloop`` or ``trio``: the event loop this coroutine runs on (no ``sniffio`` needed)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return "trio"
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def _final_check(kv: KVCacheManager, out: Outcome, session: Session) -> None:
    await kv.wait_copies()
    try:
        # The leak figures and the audit need block states that no eviction batch changes meanwhile.
        await quiesce(kv, timeout_s=10.0)
    except TimeoutError:
        out.errors.append("the manager did not become quiet within 10 s after the tasks ended")
        out.invariant_violations += 1
        return
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
    out.leaked_host_blocks = stats.host_blocks - stats.host_free - stats.host_cached
    out.leaked_sequences = stats.num_sequences + stats.num_swapped
    out.nonempty_inboxes = {name: depth for name, depth in kv.inbox_depths.items() if depth}
    out.add_audit(await audit(kv, session.owned_ids(), session.record, session.swapped()), "at the end")


async def _finish_events(checker: EventCheck, out: Outcome) -> None:
    """The event subscriber's last comparison; its findings become invariant violations."""
    await checker.finish()
    out.event_batches, out.event_resyncs = checker.batches, checker.resyncs
    out.invariant_violations += len(checker.errors)
    out.errors.extend(checker.errors)


def _postmortem(kv: KVCacheManager, out: Outcome, session: Session) -> None:
    """Leak figures of a failed manager from the state it left behind (never ``None``)."""
    leaks = postmortem(kv, session.owned_ids())
    out.leaked_blocks, out.leaked_sequences, out.leaked_host_blocks = leaks.blocks, leaks.sequences, leaks.host_blocks
    out.invariant_violations += leaks.audit.violations
    out.errors.extend(f"post-mortem: {e}" for e in leaks.audit.errors)


async def run_manager(
    options: StressOptions,
    metrics: Metrics,
    *,
    tasks: int,
    duration_s: float,
    inject: bool = False,
    progress: ProgressFn | None = None,
    log: Any = None,
) -> Outcome:
    """Run ``tasks`` workers for ``duration_s`` against a fresh manager and check its end state."""
    log = log or structlog.get_logger("akv.stress").bind(component="stress")
    out = Outcome()
    start = time.perf_counter()
    kv = KVCacheManager(stress_config(options))
    s: Session | None = None
    try:
        async with kv:
            s = Session(kv, options, metrics, out, log)
            checker = EventCheck(kv) if options.events else None
            # The subscriber's task group outlives tg's cancellation: it reads to the end.
            async with anyio.create_task_group() if checker is not None else contextlib.nullcontext() as events_tg:
                if checker is not None:
                    events_tg.start_soon(checker.run)
                async with anyio.create_task_group() as tg:
                    kind = options.fault_kind
                    if inject and kind is not None:
                        out.injector = FaultInjector(kv, kind, seed=options.seed, on_fire=s.on_fault)
                        if options.fault_after_programs is None:
                            tg.start_soon(out.injector.run_after, options.fault_delay_s)
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
                    await _final_check(kv, out, s)
                    if checker is not None:
                        await _finish_events(checker, out)
                if checker is not None:
                    checker.sub.close()  # ends checker.run
    except ActorCrashed as exc:
        out.aexit_raised = True
        if out.injector is None or out.injector.fired_at is None:
            out.invariant_violations = max(out.invariant_violations, 1)
            if not out.errors:
                out.errors.append(f"manager crashed: {exc!r}")
        log.warning("stress.manager_exit_raised", error=repr(exc))
    if out.leaked_blocks is None and s is not None:
        _postmortem(kv, out, s)
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
        host_blocks=config.num_host_blocks,
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
        inject=True,
        progress=progress,
        log=log,
    )
    elapsed = time.perf_counter() - start
    for policy in EXPECTED_ORDER:
        out.probe_errors.extend(await probe_eviction_order(policy))
    out.probe_errors.extend(await probe_pinned_child())
    out.probe_errors.extend(await probe_pending_hits())
    fault = None
    if options.fault_kind is not None:
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


async def _fresh_manager_ok(options: StressOptions, log: Any) -> bool:
    """After a fatal fault: 32 programs on a fresh manager pass every check."""
    m_fresh = Metrics()
    fresh_options = dataclasses.replace(
        options, inject_crash_after_s=None, fault=None, fault_after_programs=None, operations=32, audits=1
    )
    fresh = await run_manager(
        fresh_options,
        m_fresh,
        tasks=min(16, options.sequences),
        duration_s=options.fresh_manager_s,
        log=log.bind(phase="fresh_manager"),
    )
    fresh_ok = (
        fresh.clean
        and m_fresh.operations > 0
        and not (m_fresh.corrupted_reads or m_fresh.unexpected_errors or m_fresh.hung_calls)
    )
    if not fresh_ok:
        log.error("stress.fresh_manager_failed", errors=fresh.errors, corrupted_reads=m_fresh.corrupted_reads)
    return fresh_ok


async def _fault_verdict(options: StressOptions, out: Outcome, metrics: Metrics, log: Any) -> FaultInjection:
    inj = out.injector
    fatal = inj is not None and inj.fatal
    fresh_ok = await _fresh_manager_ok(options, log) if fatal else True
    latencies = metrics.error_latencies_s
    return FaultInjection(
        kind=options.fault_kind,
        fatal=fatal,
        injected=inj is not None and inj.fired_at is not None,
        actor=inj.actor if inj is not None else "",
        tasks=out.tasks_at_fault,
        tasks_failed_fast=sum(1 for t in latencies if t <= options.hang_timeout_s),
        tasks_hung=out.tasks_hung,
        max_error_latency_s=round(max(latencies), 6) if latencies else None,
        aexit_raised=out.aexit_raised,
        fresh_manager_ok=fresh_ok,
        not_injected=_why_not_injected(options, inj),
    )


def _why_not_injected(options: StressOptions, inj: FaultInjector | None) -> str:
    """Why the fault never took effect: its trigger never came, or nothing reached the armed component."""
    if inj is None or inj.fired_at is not None:
        return ""
    if inj.armed:
        return f"nothing reached {inj.actor} after the fault was armed"
    if options.fault_after_programs is not None:
        return "the run ended before --fault-after-programs"
    flag = "--inject-crash-after-s" if options.inject_crash_after_s is not None else "--fault-after-s"
    return f"the run ended before {flag}"


def _build_report(
    options: StressOptions,
    backend: str,
    config: KVCacheConfig,
    metrics: Metrics,
    out: Outcome,
    elapsed: float,
    fault: FaultInjection | None,
) -> StressReport:
    st = out.last_stats
    g = (lambda name: getattr(st, name)) if st is not None else (lambda name: 0)
    return StressReport(
        seed=options.seed,
        backend=backend,
        shards=config.num_shards,
        eviction_policy=config.eviction_policy,
        namespaces=options.namespaces,
        programs_budget=options.operations,
        audits=out.audits,
        audit_violations=out.audit_violations,
        probe_errors=out.probe_errors,
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
        frees_when_cancelled=metrics.frees_when_cancelled,
        aborts=metrics.aborts,
        verifications=metrics.verifications,
        verified_tokens=metrics.verified_tokens,
        corrupted_reads=metrics.corrupted_reads,
        invariant_violations=out.invariant_violations,
        unexpected_errors=metrics.unexpected_errors,
        hung_calls=metrics.hung_calls,
        leaked_blocks=out.leaked_blocks,
        leaked_sequences=out.leaked_sequences,
        leaked_host_blocks=out.leaked_host_blocks if options.host_tier else 0,
        host_tier=_host_numbers(g, metrics) if options.host_tier else {},
        nonempty_inboxes=out.nonempty_inboxes,
        prefix_hit_rate=round(g("hit_rate"), 4),
        max_inbox_depth=dict(g("max_inbox_depth") or {}),
        final_stats={
            k: g(k) for k in ("free", "active", "cached", "in_flight", "num_sequences", "prefix_cache_blocks")
        },
        errors=out.errors,
        samples=metrics.samples,
        fault_injection=fault,
    )


#: The manager's host-tier fields of :class:`~akv.results.CacheStats` in the report.
HOST_STATS = (
    "host_blocks", "host_free", "host_cached", "host_swapped", "host_in_use", "demoted_blocks", "promoted_blocks",
    "host_evicted_blocks", "host_hit_tokens", "device_hit_tokens", "swapped_out", "swapped_in",
)  # fmt: skip
#: The tasks' own host-tier counters (:class:`~akv.stress.metrics.Metrics`) in the report.
HOST_METRICS = ("swap_outs", "swap_ins", "swap_refused", "swapped_frees", "cancelled_swaps", "continuations")


def _host_numbers(stat: Any, metrics: Metrics) -> dict[str, int]:
    """The report's ``host_tier`` numbers: the last stats' host fields and the tasks' swap counters."""
    return {**{k: int(stat(k)) for k in HOST_STATS}, **{k: getattr(metrics, k) for k in HOST_METRICS}}
