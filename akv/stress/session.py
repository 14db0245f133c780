"""One manager's workload: the stress tasks, their shared state, and the monitor.

A :class:`Session` runs ``N`` worker tasks (each loops random programs from
:mod:`akv.stress.programs` until the deadline or until the run's program
budget is spent, some under a cancel scope that fires at a random await
point and then frees from inside the cancelled scope, and frees everything it
may own after each program, shielded) plus a monitor (progress, stats
snapshots, hang detection). At random program counts one worker audits a
quiescent point (:func:`akv.stress.audit.audit`). What the run ends with goes
in an :class:`Outcome`; counters go in the shared
:class:`~akv.stress.metrics.Metrics`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from akv.errors import ActorCrashed, AkvError, ManagerClosed
from akv.manager import KVCacheManager
from akv.results import CacheStats
from akv.stress.audit import AuditResult, PublishRecord, audit
from akv.stress.client import Client, GiveUp
from akv.stress.fault import FaultInjector
from akv.stress.gate import Gate
from akv.stress.metrics import Metrics
from akv.stress.options import StressOptions
from akv.stress.oracle import KVOracle
from akv.stress.programs import HOST_WEIGHTS, PROGRAMS, WEIGHTS
from akv.stress.workload import PromptSource

ProgressFn = Callable[[float, Metrics], None]
MANAGER_DOWN = (ActorCrashed, ManagerClosed)


@dataclasses.dataclass(kw_only=True, slots=True)
class Outcome:
    """What one manager's run ended with (beyond the shared :class:`Metrics`).

    ``leaked_*`` stay ``None`` until the final check (or, after a fatal
    fault, the post-mortem recount) has run.
    """

    last_stats: CacheStats | None = None
    check_ran: bool = False
    leaked_blocks: int | None = None
    leaked_host_blocks: int | None = None
    leaked_sequences: int | None = None
    nonempty_inboxes: dict[str, int] = dataclasses.field(default_factory=dict)
    invariant_violations: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    aexit_raised: bool = False
    eviction_wakeups: int = 0
    audits: int = 0
    audit_violations: int = 0
    probe_errors: list[str] = dataclasses.field(default_factory=list)
    event_batches: int = 0  # checked by the event subscriber (StressOptions.events)
    event_resyncs: int = 0
    # fault injection
    injector: FaultInjector | None = None
    tasks_at_fault: int = 0
    tasks_hung: int = 0

    def add_audit(self, result: AuditResult, label: str) -> None:
        """Count one audit and what it found."""
        self.audits += 1
        self.audit_violations += result.violations
        self.errors.extend(f"audit {label}: {e}" for e in result.errors[: max(0, 20 - len(self.errors))])

    @property
    def clean(self) -> bool:
        """The final check ran and found no violation, leak or waiting message."""
        return (
            self.check_ran
            and not self.invariant_violations
            and self.leaked_blocks == 0
            and not self.leaked_host_blocks
            and self.leaked_sequences == 0
            and not self.nonempty_inboxes
            and not self.audit_violations
        )


class Session:
    """One manager's workload: shared state of its tasks, monitor and injector."""

    def __init__(
        self, kv: KVCacheManager, options: StressOptions, metrics: Metrics, outcome: Outcome, log: Any
    ) -> None:
        cfg = kv.config
        self.kv = kv
        self.options = options
        self.metrics = metrics
        self.outcome = outcome
        self.log = log
        self.oracle = KVOracle(
            num_layers=cfg.model.num_layers, num_kv_heads=cfg.model.num_kv_heads, head_dim=cfg.model.head_dim
        )
        self.prompts = PromptSource(options.seed, cfg.block_size)
        self.record = PublishRecord(cfg.block_size)
        self.gate = Gate()
        self.namespaces = tenant_namespaces(options.namespaces)
        self.clients: list[Client] = []
        self.programs_started = 0
        rng = random.Random(f"akv-stress-audits-{options.seed}")
        budget = options.operations
        self.audit_at = set(rng.sample(range(1, budget), min(options.audits, budget - 1))) if budget else set()
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
        fired = out.injector.fired_at if out.injector is not None and out.injector.fatal else None
        if fired is not None:
            m.error_latencies_s.append(now - fired)
        elif not out.errors:
            out.errors.append(f"task {index}: {exc!r}")

    # --------------------------------------------------------------- tasks
    async def worker(self, index: int, deadline: float) -> None:
        """One stress task: random programs until ``deadline`` or until the manager fails."""
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
            call_timeout_s=self.options.hang_timeout_s * 1.5,
            record=self.record,
            namespaces=self.namespaces,
            gate=self.gate,
        )
        self.clients.append(client)
        table = HOST_WEIGHTS if self.options.host_tier else WEIGHTS
        names, weights = list(table), list(table.values())
        self.alive += 1
        try:
            async with anyio.create_task_group() as helpers:
                while anyio.current_time() < deadline:
                    try:
                        if not await self._next_program():
                            break
                    except MANAGER_DOWN as exc:  # the audit due at this program number saw the failure
                        self.manager_down(index, exc)
                        break
                    kind = rng.choices(names, weights)[0]
                    self.metrics.programs[kind] += 1
                    down = False
                    try:
                        await self._program(client, kind, helpers)
                    except GiveUp:
                        self.metrics.gave_up += 1
                    except MANAGER_DOWN as exc:
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

    async def _next_program(self) -> bool:
        """Take one program from the budget (auditing first when its number is due); False when spent."""
        budget = self.options.operations
        if budget is not None and self.programs_started >= budget:
            return False
        self.programs_started += 1
        n = self.programs_started
        injector, after = self.outcome.injector, self.options.fault_after_programs
        if injector is not None and after is not None and n > after:
            injector.arm()
        if n in self.audit_at:
            await self.audit_point(f"at program {n}")
        return True

    def owned_ids(self) -> set:
        """Every id some task may own now."""
        return set().union(*(c.owned for c in self.clients))

    def swapped(self) -> dict:
        """Every sequence some task holds swapped out -> the host blocks it holds (the tasks' own record)."""
        out: dict = {}
        for c in self.clients:
            out.update(c.swapped)
        return out

    async def audit_point(self, label: str) -> None:
        """Hold every call, audit the quiescent manager against the harness's own records, release."""
        await self.gate.drain()
        try:
            result = await audit(self.kv, self.owned_ids(), self.record, self.swapped())
        except TimeoutError:
            result = AuditResult()
            result.refcount_mismatches = 1
            result.note("the manager did not become quiet within 30 s")
        finally:
            self.gate.open()
        self.outcome.add_audit(result, label)
        if result.violations:
            self.log.error("stress.audit_failed", label=label, errors=result.errors)

    async def _cleanup(self, client: Client, index: int) -> bool:
        """Free everything the client may own; False if the manager is down."""
        try:
            await client.cleanup()
        except MANAGER_DOWN as exc:
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
            helpers.start_soon(cancel_after_checkpoints, scope, rng.randint(1, 80))
        with scope:
            try:
                await program(client, self.prompts)
            finally:
                if scope.cancel_called:  # free from the cancelled task itself, as a request handler would
                    await client.free_cancelled()
        if scope.cancelled_caught:
            self.metrics.cancellations += 1

    # ------------------------------------------------------------- monitor
    async def monitor(self, start: float, progress: ProgressFn | None) -> None:
        """Progress, stats snapshots, hang detection, and the fault-injection deadline."""
        m, out, opts = self.metrics, self.outcome, self.options
        tick = 0
        # A run by time audits at evenly spaced times (a run by count: at random program numbers).
        audit_times = [opts.duration_s * (i + 1) / (opts.audits + 1) for i in range(opts.audits)]
        if opts.operations is not None:
            audit_times = []
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
            fired = out.injector.fired_at if out.injector is not None and out.injector.fatal else None
            if fired is not None and now - fired > opts.hang_timeout_s and self.alive and self.workers is not None:
                out.tasks_hung = self.alive
                self.log.error("stress.tasks_hung_after_fault", tasks=self.alive)
                self.workers.cancel()
            if audit_times and now - start >= audit_times[0] and fired is None and m.manager_failed_at is None:
                audit_times.pop(0)
                with contextlib.suppress(*MANAGER_DOWN):
                    await self.audit_point(f"at {now - start:.1f} s")
            if tick % 4 == 0 and fired is None and m.manager_failed_at is None:
                with contextlib.suppress(*MANAGER_DOWN):
                    out.last_stats = await self.kv.stats()
            if tick % 20 == 0:
                self.log.info(
                    "stress.progress",
                    elapsed_s=round(now - start, 1),
                    operations=m.operations,
                    corrupted_reads=m.corrupted_reads,
                )

    def on_fault(self) -> None:
        """Called by the injector as the fault fires: remember how many tasks must fail."""
        self.outcome.tasks_at_fault = self.alive


async def cancel_after_checkpoints(scope: anyio.CancelScope, k: int) -> None:
    """Cancel ``scope`` after ``k`` scheduler checkpoints (a no-op if it has exited by then)."""
    for _ in range(k):
        await anyio.lowlevel.checkpoint()
    scope.cancel()


def tenant_namespaces(n: int) -> tuple:
    """``n`` prefix-cache namespaces of every plain-value kind: ``None``, ``str``, ``int``, ``bytes``, tuples."""
    kinds = (lambda i: f"tenant-{i}", lambda i: ("lora", i), lambda i: i, lambda i: f"t{i}".encode())
    return (None, *(kinds[i % len(kinds)](i) for i in range(1, n)))
