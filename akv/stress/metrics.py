"""Counters and latency samples the stress tasks record while they run.

One :class:`Metrics` object is shared by every task of a run. Tasks run on one
event loop, so plain attribute updates need no lock.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass(kw_only=True, slots=True)
class Metrics:
    """What the harness counts (units: calls, events, blocks, seconds)."""

    #: Manager calls per operation name (``add``, ``append``, ``commit``, ...).
    calls: Counter = field(default_factory=Counter)
    #: Latency samples in microseconds per operation name.
    latency_us: dict[str, array] = field(default_factory=dict)
    #: Programs started per kind (``chat``, ``beam``, ``parallel``, ``abort``).
    programs: Counter = field(default_factory=Counter)
    cancellations: int = 0
    #: Sequences freed (``kv.free``) from inside a cancelled scope.
    frees_when_cancelled: int = 0
    aborts: int = 0
    retries: int = 0
    gave_up: int = 0
    #: Swaps (host tier): sequences swapped out and in, swap-outs refused for host room,
    #: swapped sequences freed, swaps called from cancelled scopes, prompts continuing a conversation.
    swap_outs: int = 0
    swap_ins: int = 0
    swap_refused: int = 0
    swapped_frees: int = 0
    cancelled_swaps: int = 0
    continuations: int = 0
    verifications: int = 0
    verified_tokens: int = 0
    corrupted_reads: int = 0
    unexpected_errors: int = 0
    hung_calls: int = 0
    #: Details of the first corrupted reads and unexpected errors (capped).
    samples: list[dict] = field(default_factory=list)
    #: Monotonic time at which the manager failed (first error seen by a task).
    manager_failed_at: float | None = None
    #: Per task, seconds from the fault injection to the error it saw.
    error_latencies_s: list[float] = field(default_factory=list)
    #: Calls in flight: token -> (operation, start time), for hang detection.
    in_flight: dict[int, tuple[str, float]] = field(default_factory=dict)

    @property
    def operations(self) -> int:
        """Manager calls made, all operations together."""
        return sum(self.calls.values())

    def record(self, op: str, elapsed_s: float) -> None:
        """Count one call of ``op`` that took ``elapsed_s`` seconds."""
        self.calls[op] += 1
        samples = self.latency_us.get(op)
        if samples is None:
            samples = self.latency_us[op] = array("d")
        samples.append(elapsed_s * 1e6)

    def sample(self, event: dict, limit: int = 100) -> None:
        """Keep ``event`` for the report unless ``limit`` samples are kept already."""
        if len(self.samples) < limit:
            self.samples.append(event)

    def latency_summary(self) -> dict[str, dict[str, float]]:
        """Per operation: count, p50, p99 and max latency in microseconds."""
        out = {}
        for op, samples in sorted(self.latency_us.items()):
            arr = np.frombuffer(samples, dtype=np.float64)
            if len(arr) == 0:
                continue
            p50, p99 = np.percentile(arr, [50, 99])
            out[op] = {
                "count": len(arr),
                "p50": round(float(p50), 1),
                "p99": round(float(p99), 1),
                "max": round(float(arr.max()), 1),
            }
        return out
