"""What a stress run is asked to do (:class:`StressOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("asyncio", "uvloop", "trio")


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
            fresh manager works. ``None`` injects nothing.
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
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError("watermarks must satisfy 0 <= low_watermark <= high_watermark <= 1")
        if not 0.0 <= self.cancel_probability <= 1.0:
            raise ValueError(f"cancel_probability must lie in [0, 1], got {self.cancel_probability!r}")

    def pool_blocks(self) -> int:
        """Blocks in the pool: ``num_blocks``, or 3.5 blocks of 16 tokens per concurrent task.

        A task holds about 2-10 blocks of 16 tokens while it runs (prompt,
        decode, beams), so at 3.5 per task the pool runs near full: cached
        blocks are evicted all the time and some allocations fail transiently
        (896 blocks for 256 tasks).
        """
        if self.num_blocks is not None:
            return self.num_blocks
        return max(64, 7 * self.sequences * 16 // (2 * self.block_size))
