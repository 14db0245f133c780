"""The result of a stress run (:class:`StressReport`), as JSON and as a table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultInjection:
    """Outcome of a fault injection (``--fault`` or ``--inject-crash-after-s``).

    Attributes:
        kind: The fault (:data:`akv.stress.options.FAULTS`).
        fatal: Whether the manager had to fail (every fault but ``slow_copies``);
            the fields below ``actor`` apply to fatal faults only.
        injected: The fault actually took effect.
        actor: The component the fault hit.
        tasks: Tasks alive when it raised.
        tasks_failed_fast: Of those, tasks that got ``ActorCrashed`` or
            ``ManagerClosed`` within ``hang_timeout_s``.
        tasks_hung: Tasks that got no error in time.
        max_error_latency_s: Longest time from the fault to a task's error.
        aexit_raised: ``KVCacheManager.__aexit__`` raised ``ActorCrashed``.
        fresh_manager_ok: A short program on a new manager passed every check.
        not_injected: Why the fault never took effect (empty when it did).
    """

    kind: str
    fatal: bool
    injected: bool
    actor: str
    tasks: int
    tasks_failed_fast: int
    tasks_hung: int
    max_error_latency_s: float | None
    aexit_raised: bool
    fresh_manager_ok: bool
    not_injected: str = ""

    @property
    def problems(self) -> list[str]:
        """What went wrong, each said once: the fault did not take effect, or (if fatal) what did not follow."""
        if not self.injected:
            return [f"fault not injected: {self.not_injected or 'it never took effect'}"]
        if not self.fatal:
            return []
        out = []
        if self.tasks_failed_fast != self.tasks:
            out.append(f"{self.tasks - self.tasks_failed_fast} of {self.tasks} callers did not fail fast")
        if self.tasks_hung:
            out.append(f"{self.tasks_hung} tasks hung")
        if not self.aexit_raised:
            out.append("the exit did not raise ActorCrashed")
        if not self.fresh_manager_ok:
            out.append("the fresh manager failed")
        return out

    @property
    def ok(self) -> bool:
        """The fault took effect; if fatal: every caller failed fast, the exit raised, a fresh manager works."""
        return not self.problems


@dataclass(frozen=True, kw_only=True, slots=True)
class StressReport:
    """Numbers of one stress run (units: calls, blocks, tokens, seconds, microseconds).

    ``leaked_blocks`` and ``leaked_sequences`` come from the final check or,
    when the manager failed, from the post-mortem recount of the state it
    left behind (:func:`akv.stress.audit.postmortem`); ``None`` only if
    neither could run, which fails the run. ``leaked_host_blocks`` is the
    same for the host tier (0 without one).

    ``host_tier`` (empty without a host tier): ``host_blocks``, the final
    ``host_free``, ``host_cached``, ``host_swapped`` and ``host_in_use``,
    the manager's ``demoted_blocks``, ``promoted_blocks``,
    ``host_evicted_blocks``, ``host_hit_tokens``, ``device_hit_tokens``,
    ``swapped_out``, ``swapped_in``, and the tasks' own counts:
    ``swap_outs``, ``swap_ins``, ``swap_refused`` (no host room),
    ``swapped_frees`` (freed while swapped out), ``cancelled_swaps`` (called
    from a cancelled scope) and ``continuations`` (prompts continuing an
    earlier conversation).
    """

    seed: int
    backend: str
    shards: int
    eviction_policy: str
    namespaces: int
    programs_budget: int | None
    audits: int
    audit_violations: int
    probe_errors: list[str]
    duration_s: float
    sequences: int
    num_blocks: int
    block_size: int
    operations: int
    ops_per_s: float
    calls: dict[str, int]
    latency_us: dict[str, dict[str, float]]
    programs: dict[str, int]
    forks: int
    cow_copies: int
    evictions: int
    eviction_batches: int
    eviction_loop_batches: int
    eviction_loop_wakeups: int
    pool_exhausted: int
    retries: int
    gave_up: int
    cancellations: int
    frees_when_cancelled: int
    aborts: int
    verifications: int
    verified_tokens: int
    corrupted_reads: int
    invariant_violations: int
    unexpected_errors: int
    hung_calls: int
    leaked_blocks: int | None
    leaked_sequences: int | None
    leaked_host_blocks: int | None
    nonempty_inboxes: dict[str, int]
    prefix_hit_rate: float
    max_inbox_depth: dict[str, int]
    final_stats: dict[str, int]
    host_tier: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    fault_injection: FaultInjection | None = None

    @property
    def failures(self) -> list[str]:
        """Why the run failed (empty when it passed)."""
        out = []
        if self.corrupted_reads:
            out.append(f"{self.corrupted_reads} corrupted reads")
        if self.invariant_violations:
            out.append(f"{self.invariant_violations} invariant violations")
        if self.audit_violations:
            out.append(f"{self.audit_violations} audit disagreements (refcounts, sequences or prefix cache)")
        if self.probe_errors:
            out.append(f"probes: {'; '.join(self.probe_errors)}")
        if self.leaked_blocks is None or self.leaked_sequences is None:
            out.append("neither the final check nor the post-mortem recount ran")
        else:
            if self.leaked_blocks:
                out.append(f"{self.leaked_blocks} leaked blocks")
            if self.leaked_host_blocks:
                out.append(f"{self.leaked_host_blocks} leaked host blocks")
            if self.leaked_sequences:
                out.append(f"{self.leaked_sequences} live sequences no task owns")
        fatal = self.fault_injection is not None and self.fault_injection.fatal
        if self.nonempty_inboxes and not fatal:
            out.append(f"inboxes not empty: {self.nonempty_inboxes}")
        if self.fault_injection is not None:
            out.extend(f"fault injection ({self.fault_injection.kind}): {p}" for p in self.fault_injection.problems)
        if self.unexpected_errors:
            out.append(f"{self.unexpected_errors} unexpected errors")
        if self.hung_calls:
            out.append(f"{self.hung_calls} hung calls")
        return out

    @property
    def ok(self) -> bool:
        """No corrupted read, violation, leak, hang or unexpected error."""
        return not self.failures

    def as_json(self) -> dict[str, Any]:
        """The report as JSON-ready dict (adds ``ok`` and ``failures``)."""
        data = asdict(self)
        data["ok"] = self.ok
        data["failures"] = self.failures
        return data


def print_summary(report: StressReport, console: Console | None = None) -> None:
    """Print the headline numbers as a table."""
    table = Table(title=f"akv stress: seed {report.seed}, {report.backend}", header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    lat = report.latency_us
    rows = [
        ("sequences (tasks) / pool", f"{report.sequences} / {report.num_blocks:,} blocks x {report.block_size} tokens"),
        ("shards / policy / namespaces", f"{report.shards} / {report.eviction_policy} / {report.namespaces}"),
        ("duration", f"{report.duration_s:,.1f} s"),
        ("operations (ops/s)", f"{report.operations:,} ({report.ops_per_s:,.0f}/s)"),
        ("programs", ", ".join(f"{k} {v:,}" for k, v in sorted(report.programs.items()))),
        ("forks / cow copies", f"{report.forks:,} / {report.cow_copies:,}"),
        (
            "evictions (batches, loop batches)",
            f"{report.evictions:,} ({report.eviction_batches:,}, {report.eviction_loop_batches:,})",
        ),
        ("pool exhausted / retries / gave up", f"{report.pool_exhausted:,} / {report.retries:,} / {report.gave_up:,}"),
        (
            "cancellations (frees from cancelled scopes) / aborts",
            f"{report.cancellations:,} ({report.frees_when_cancelled:,}) / {report.aborts:,}",
        ),
        ("verifications (tokens)", f"{report.verifications:,} ({report.verified_tokens:,})"),
        ("prefix hit rate", f"{report.prefix_hit_rate:.1%}"),
        ("append p50 / p99", _p(lat.get("append"))),
        ("add p50 / p99", _p(lat.get("add"))),
        ("max inbox depth", ", ".join(f"{k} {v}" for k, v in report.max_inbox_depth.items())),
        ("corrupted reads", f"{report.corrupted_reads}"),
        ("invariant violations", f"{report.invariant_violations}"),
        ("leaked blocks / sequences", f"{report.leaked_blocks} / {report.leaked_sequences}"),
        *_host_rows(report.host_tier, report.leaked_host_blocks),
        ("audits (disagreements)", f"{report.audits} ({report.audit_violations})"),
        ("unexpected errors / hung calls", f"{report.unexpected_errors} / {report.hung_calls}"),
    ]
    if report.fault_injection is not None:
        fi = report.fault_injection
        text = f"{fi.kind} on {fi.actor}, injected {fi.injected}"
        if fi.fatal:
            text += (
                f"; {fi.tasks_failed_fast}/{fi.tasks} failed fast (max {fi.max_error_latency_s} s), "
                f"exit raised {fi.aexit_raised}, fresh manager ok {fi.fresh_manager_ok}"
            )
        rows.append(("fault injection", text))
    rows.append(("result", "OK" if report.ok else "FAILED: " + "; ".join(report.failures)))
    for name, value in rows:
        table.add_row(name, value)
    (console or Console()).print(table)


def _host_rows(h: dict[str, int], leaked: int | None) -> list[tuple[str, str]]:
    """The summary's host-tier rows (none without a host tier)."""
    if not h:
        return []
    return [
        (
            "host blocks: in use / free (cached, swapped) at the end",
            f"{h['host_in_use']:,} / {h['host_free']:,} ({h['host_cached']:,}, {h['host_swapped']:,}) "
            f"of {h['host_blocks']:,}",
        ),
        (
            "demoted / promoted / dropped by the host",
            f"{h['demoted_blocks']:,} / {h['promoted_blocks']:,} / {h['host_evicted_blocks']:,}",
        ),
        ("hit tokens: device / host", f"{h['device_hit_tokens']:,} / {h['host_hit_tokens']:,}"),
        (
            "swaps out / in (refused, freed swapped, cancelled)",
            f"{h['swapped_out']:,} / {h['swapped_in']:,} ({h['swap_refused']:,}, {h['swapped_frees']:,}, "
            f"{h['cancelled_swaps']:,})",
        ),
        ("continued conversations", f"{h['continuations']:,}"),
        ("leaked host blocks", f"{leaked}"),
    ]


def _p(summary: dict[str, float] | None) -> str:
    if not summary:
        return "-"
    return f"{summary['p50']:,.0f} / {summary['p99']:,.0f} us"
