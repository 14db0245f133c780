"""What a stress run is asked to do (:class:`StressOptions`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from akv.stress.programs import max_sequence_blocks

BACKENDS = ("asyncio", "uvloop", "trio")
#: Eviction policies a run may use; ``random`` picks one from the seed.
POLICIES = ("lru", "lfu", "slru", "random")
#: Faults a run may inject (``--fault``); see :mod:`akv.stress.fault`.
FAULTS = ("crash", "slow_copies", "failing_copies", "shard_exception", "eviction_crash")
#: Faults after which the manager must have failed (every caller fails fast).
FATAL_FAULTS = ("crash", "failing_copies", "shard_exception", "eviction_crash")


@dataclass(frozen=True, kw_only=True, slots=True)
class StressOptions:
    """Options of one stress run; every random choice derives from ``seed``.

    Args:
        seed: Seed of every task's random program (task ``i`` uses its own
            ``random.Random`` seeded from ``(seed, i)``).
        duration_s: Seconds the tasks start new programs for.
        sequences: Concurrent tasks, each driving its own sequences.
        num_blocks: Blocks in the pool; ``None`` sizes it from ``sequences``
            (:meth:`pool_blocks`) so that eviction runs continuously and
            allocations sometimes fail with ``PoolExhausted``.
        block_size: Tokens per block.
        backend: ``asyncio``, ``uvloop`` or ``trio`` (informational inside
            :func:`~akv.stress.runner.run_stress`; the caller picks the loop).
        progress: Draw a progress bar on stderr when it is a terminal.
        inject_crash_after_s: Make the pool shard's handler raise once after
            this many seconds, then check that every caller fails fast and a
            fresh manager works. ``None`` injects nothing. The same as
            ``fault="crash"`` with ``fault_after_s``.
        operations: Programs (requests) the run starts in all; the run ends
            when they have finished (``duration_s`` stays an upper bound).
            ``None``: run for ``duration_s``.
        shards: Pool shards (1-4).
        eviction_policy: ``lru``, ``lfu``, ``slru`` or ``random`` (one of the
            three, picked from ``seed``).
        namespaces: Tenants sharing the prompts (namespace ``None`` plus
            ``namespaces - 1`` others); 1 uses only ``None``.
        audits: Quiescent points during the run at which every block's
            refcount is recounted from the live block tables and the prefix
            cache is compared with the harness's record (plus one at the end).
        events: Turn cache events on and check them with a subscriber
            (:mod:`akv.stress.event_check`).
        host_blocks: Blocks of a host-memory tier (all shards together; 0:
            none). With a tier, eviction demotes cached blocks there, prompts
            that continue earlier conversations promote them back, and the
            ``swap`` program swaps sequences out and in (docs/host_tier.md).
        host_gib: The host tier's size in GiB instead of ``host_blocks``
            (``None``: use ``host_blocks``); give at most one of the two.
        fault: Fault to inject (:data:`FAULTS`), or ``None``.
        fault_after_s: Seconds into the run at which a timed fault fires.
        fault_after_programs: Programs started before a fault fires (takes
            precedence over ``fault_after_s``; a count, not a time).
        low_watermark: Free fraction that wakes the eviction loop (0.0-1.0).
        high_watermark: Free fraction the eviction loop refills to (0.0-1.0).
        eviction_batch_blocks: Blocks per eviction batch.
        cancel_probability: Chance that a program runs under a cancel scope
            that fires at a random point (0.0-1.0).
        max_retries: ``PoolExhausted`` retries before a program gives up.
        hang_timeout_s: A call pending this long is counted as hung; after a
            fault injection, the time every caller must have failed within.
        fresh_manager_s: Seconds of the short program run on a fresh manager
            after a fault injection.

    Raises:
        ValueError: A field out of range, options that cannot work together,
            or a ``num_blocks`` whose shards (``num_blocks // shards``) are
            smaller than the workload's longest sequence
            (:func:`~akv.stress.programs.max_sequence_blocks`).
    """

    seed: int = 0
    duration_s: float = 20.0
    sequences: int = 256
    num_blocks: int | None = None
    block_size: int = 16
    backend: str = "asyncio"
    progress: bool = False
    inject_crash_after_s: float | None = None
    low_watermark: float = 0.10
    high_watermark: float = 0.15
    eviction_batch_blocks: int = 8
    cancel_probability: float = 0.35
    max_retries: int = 40
    hang_timeout_s: float = 10.0
    fresh_manager_s: float = 1.0
    operations: int | None = None
    shards: int = 1
    eviction_policy: str = "slru"
    namespaces: int = 3
    audits: int = 3
    fault: str | None = None
    fault_after_s: float = 1.0
    fault_after_programs: int | None = None
    events: bool = False
    host_blocks: int = 0
    host_gib: float | None = None

    def __post_init__(self) -> None:
        for name in ("sequences", "block_size", "eviction_batch_blocks", "max_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 8):
            raise ValueError(f"num_blocks must be an int >= 8 or None, got {self.num_blocks!r}")
        for name in ("duration_s", "hang_timeout_s", "fresh_manager_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.inject_crash_after_s is not None and not 0 <= self.inject_crash_after_s < self.duration_s:
            raise ValueError(
                f"inject_crash_after_s must lie in [0, duration_s={self.duration_s}), got {self.inject_crash_after_s!r}"
            )
        self._check_counts()
        if self.inject_crash_after_s is not None and self.fault not in (None, "crash"):
            raise ValueError("inject_crash_after_s is fault 'crash'; do not combine it with another fault")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError("watermarks must satisfy 0 <= low_watermark <= high_watermark <= 1")
        if not 0.0 <= self.cancel_probability <= 1.0:
            raise ValueError(f"cancel_probability must lie in [0, 1], got {self.cancel_probability!r}")
        self._check_host()

    def _check_host(self) -> None:
        value, gib = self.host_blocks, self.host_gib
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"host_blocks must be an int >= 0, got {value!r}")
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < 2**40):
            raise ValueError(f"host_gib must be None or a number in (0, 2**40), got {gib!r}")
        if value and gib is not None:
            raise ValueError("give --host-blocks or --host-gib, not both")
        if 0 < value < self.shards:
            raise ValueError(f"--host-blocks {value} cannot be split over {self.shards} shards")

    @property
    def host_tier(self) -> bool:
        """Whether the run has a host-memory tier (``host_blocks`` or ``host_gib``)."""
        return bool(self.host_blocks) or self.host_gib is not None

    def _check_counts(self) -> None:
        for name in ("operations", "fault_after_programs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if not isinstance(self.shards, int) or not 1 <= self.shards <= 4:
            raise ValueError(f"shards must be an int in 1..4, got {self.shards!r}")
        if not isinstance(self.namespaces, int) or not 1 <= self.namespaces <= 16:
            raise ValueError(f"namespaces must be an int in 1..16, got {self.namespaces!r}")
        if not isinstance(self.audits, int) or not 0 <= self.audits <= 1000:
            raise ValueError(f"audits must be an int in 0..1000, got {self.audits!r}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(POLICIES)}, got {self.eviction_policy!r}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {self.fault!r}")
        if self.fault == "shard_exception" and self.shards < 2:
            raise ValueError("fault 'shard_exception' needs shards >= 2 (the other shards keep serving)")
        after, budget = self.fault_after_programs, self.operations
        if after is not None and budget is not None and after >= budget:
            raise ValueError(
                f"--fault-after-programs {after} must be below --operations {budget} (the fault could never fire)"
            )
        if self.fault is not None and not 0 <= self.fault_after_s < self.duration_s:
            raise ValueError(f"fault_after_s must lie in [0, duration_s={self.duration_s}), got {self.fault_after_s!r}")
        need = max_sequence_blocks(self.block_size)
        if self.num_blocks is not None and self.num_blocks // self.shards < need:
            raise ValueError(
                f"num_blocks={self.num_blocks} gives a shard {self.num_blocks // self.shards} blocks, but the "
                f"workload's longest sequence needs {need} blocks of {self.block_size} tokens: use "
                f"num_blocks >= {need * self.shards} (or leave it unset)"
            )

    @property
    def fault_kind(self) -> str | None:
        """The fault this run injects (``inject_crash_after_s`` is ``crash``)."""
        return "crash" if self.inject_crash_after_s is not None else self.fault

    @property
    def fault_delay_s(self) -> float:
        """Seconds into the run at which a timed fault fires."""
        return self.inject_crash_after_s if self.inject_crash_after_s is not None else self.fault_after_s

    def policy(self) -> str:
        """The eviction policy of the run (``random`` resolved from the seed)."""
        if self.eviction_policy != "random":
            return self.eviction_policy
        return ("lru", "lfu", "slru")[random.Random(f"akv-stress-policy-{self.seed}").randrange(3)]

    def pool_blocks(self) -> int:
        """Blocks in the pool: ``num_blocks``, or 3.5 blocks of 16 tokens per concurrent task.

        A task holds about 2-10 blocks of 16 tokens while it runs (prompt,
        decode, beams), so at 3.5 per task the pool runs near full: cached
        blocks are evicted all the time and some allocations fail transiently
        (896 blocks for 256 tasks). The default is never below 64 blocks, nor
        below what lets every shard hold the workload's longest sequence
        (:func:`~akv.stress.programs.max_sequence_blocks`).
        """
        if self.num_blocks is not None:
            return self.num_blocks
        per_task = 7 * self.sequences * 16 // (2 * self.block_size)
        return max(64, per_task, self.shards * max_sequence_blocks(self.block_size))
