"""Wait for the eviction loop by the completion of its passes, never by sleeping until a value.

The loop (:class:`akv.actors.eviction_loop.EvictionLoop`) serves one wake-up
by running one relief pass per shard. :class:`EvictionPasses` wraps that pass:
the real pass runs unchanged, and when it returns the wrapper records the
shard and its free blocks and sets an event, so a test awaits "a pass ended
with the shard refilled" instead of polling ``kv.stats()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio
import pytest

from akv.actors.eviction_loop import EvictionLoop
from akv.actors.pool_shard import PoolShardActor


@dataclass(frozen=True, kw_only=True, slots=True)
class Pass:
    """One finished relief pass: the shard it served and that shard's free blocks when it ended."""

    shard: int
    free_blocks: int


class EvictionPasses:
    """Every relief pass the eviction loop finished, in order, and a way to wait for the next one.

    Args:
        monkeypatch: The test's ``monkeypatch``; the wrapper is removed with it.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.passes: list[Pass] = []
        self._changed: anyio.Event | None = None
        real = EvictionLoop._relieve

        async def relieve(loop: EvictionLoop, shard: PoolShardActor) -> None:
            await real(loop, shard)
            self.passes.append(Pass(shard=shard.state.shard_index, free_blocks=shard.num_free))
            if self._changed is not None:
                self._changed.set()

        monkeypatch.setattr(EvictionLoop, "_relieve", relieve)

    async def wait_for(self, done: Callable[[list[Pass]], bool], *, hang_guard_s: float = 60.0) -> None:
        """Return once ``done(passes)`` holds, checked after each finished pass (and once at the start).

        Raises:
            TimeoutError: Not within ``hang_guard_s`` (a hang guard, not a timing check).
        """
        with anyio.fail_after(hang_guard_s):
            while not done(self.passes):
                self._changed = anyio.Event()
                await self._changed.wait()

    async def wait_refilled(self, shard: int, free_blocks: int, *, since: int = 0) -> int:
        """Wait for a pass on ``shard`` that ended with at least ``free_blocks`` free.

        Args:
            shard: Shard index.
            free_blocks: Free blocks the pass must have left (e.g. the high watermark).
            since: Consider only passes from this index of :attr:`passes` on.

        Returns:
            The index in :attr:`passes` of the first such pass.
        """

        def refilled_at() -> int | None:
            for i in range(since, len(self.passes)):
                if self.passes[i].shard == shard and self.passes[i].free_blocks >= free_blocks:
                    return i
            return None

        await self.wait_for(lambda _: refilled_at() is not None)
        return refilled_at()
