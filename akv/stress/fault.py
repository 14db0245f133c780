"""Fault injection: make one actor's handler raise once, mid-run.

The manager must then fail loudly: every caller gets ``ActorCrashed`` or
``ManagerClosed`` within a bounded time (none hangs) and ``__aexit__`` raises
``ActorCrashed``. The runner measures that; this module only arms the fault.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio

from akv.manager import KVCacheManager


class CrashInjector:
    """Wraps the first pool shard's ``handle`` so that it raises ``RuntimeError`` once, after a delay.

    Args:
        kv: The running manager.
        after_s: Seconds to wait before arming the fault.
        on_fire: Called (synchronously, inside the actor) right before it raises.

    Attributes:
        actor: Name of the actor made to crash.
        fired_at: ``time.perf_counter()`` when the handler raised, else ``None``.
    """

    def __init__(self, kv: KVCacheManager, after_s: float, on_fire: Callable[[], None] | None = None) -> None:
        self._target = kv._shards[0]  # the harness reaches in on purpose: no public fault hook exists
        self.actor = self._target.name
        self.after_s = after_s
        self.on_fire = on_fire
        self.fired_at: float | None = None

    async def run(self) -> None:
        """Sleep ``after_s``, then arm the fault (the next message to the shard raises)."""
        await anyio.sleep(self.after_s)
        original = self._target.handle

        def handle(msg: Any) -> Any:
            if self.fired_at is None:
                self.fired_at = time.perf_counter()
                if self.on_fire is not None:
                    self.on_fire()
                raise RuntimeError("injected fault (akv stress --inject-crash-after-s)")
            return original(msg)

        self._target.handle = handle  # type: ignore[method-assign]
