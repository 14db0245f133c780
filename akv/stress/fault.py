"""Fault injection through the manager's real seams: one actor raises, copies slow down or fail.

Kinds (``--fault``):

- ``crash``: the first pool shard's ``handle`` raises once.
- ``shard_exception``: one pool shard other than the first (chosen by the
  seed; needs ``--shards >= 2``) raises once, while the others serve.
- ``eviction_crash``: the eviction loop's next batch raises once.
- ``failing_copies``: the stream worker's next copy batch raises (in its
  thread), so the stream worker fails the manager.
- ``slow_copies``: every copy batch sleeps 1-5 ms in the stream worker's
  thread first; nothing may fail, every check of a clean run applies.

Both copy faults wrap the stream worker's CPU copier
(:class:`~akv.storage.tier_copy.TierCopier`), which runs every batch:
copy-on-write copies and, with a host tier, demotions, promotions and swaps.
Runs with a copy fault therefore configure ``copy_process=False`` (the copy
process has no seam to wrap; its failures are a child's error answer or its
death, tested in ``tests/test_copy_process.py``).

Each wraps the real component's method on the running manager (the harness
reaches in on purpose: there is no public fault hook); nothing under test is
mocked. After a fatal fault the manager must fail loudly: every caller gets
``ActorCrashed`` or ``ManagerClosed`` within a bounded time and
``__aexit__`` raises ``ActorCrashed``. The runner measures that; this module
only arms the fault.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import anyio

from akv.manager import KVCacheManager
from akv.stress.options import FATAL_FAULTS

#: The faults that wrap the worker thread's copier.
COPY_FAULTS = ("slow_copies", "failing_copies")


class FaultInjector:
    """Arms one fault on a running manager, once.

    Args:
        kv: The running manager.
        kind: One of :data:`akv.stress.options.FAULTS`.
        seed: Picks the shard of ``shard_exception`` and the slow copies' delays.
        on_fire: Called right before the fault takes effect (inside the
            actor, or in the stream worker's thread for copy faults).

    Attributes:
        actor: Name of the component the fault hits.
        fatal: Whether the manager must fail.
        fired_at: ``time.perf_counter()`` when the fault took effect, else ``None``.
        armed: Whether the fault is armed.
    """

    def __init__(
        self, kv: KVCacheManager, kind: str, *, seed: int = 0, on_fire: Callable[[], None] | None = None
    ) -> None:
        self.kv = kv
        self.kind = kind
        self.fatal = kind in FATAL_FAULTS
        self.on_fire = on_fire
        self.fired_at: float | None = None
        self.armed = False
        self._rng = random.Random(f"akv-stress-fault-{seed}")
        self._shard_index = 0
        if kind == "shard_exception":
            self._shard_index = self._rng.randrange(1, len(kv._shards))
        self.actor = {
            "crash": kv._shards[0].name,
            "shard_exception": kv._shards[self._shard_index].name,
            "eviction_crash": "eviction_loop",
        }.get(kind, "stream_worker")

    async def run_after(self, delay_s: float) -> None:
        """Sleep ``delay_s``, then :meth:`arm`."""
        await anyio.sleep(delay_s)
        self.arm()

    def _fire(self) -> None:
        if self.fired_at is None:
            self.fired_at = time.perf_counter()
            if self.on_fire is not None:
                self.on_fire()

    def arm(self) -> None:
        """Install the fault on its component (idempotent)."""
        if self.armed:
            return
        self.armed = True
        if self.kind in ("crash", "shard_exception"):
            self._wrap_shard(self.kv._shards[self._shard_index])
        elif self.kind == "eviction_crash":
            self._wrap_eviction()
        else:
            self._wrap_copies()

    def _wrap_shard(self, shard: Any) -> None:
        original = shard.handle
        fired = False

        def handle(msg: Any) -> Any:
            nonlocal fired
            if not fired:
                fired = True
                self._fire()
                raise RuntimeError(f"injected fault (akv stress --fault {self.kind})")
            return original(msg)

        shard.handle = handle

    def _wrap_eviction(self) -> None:
        loop = self.kv._eviction
        original = loop._relieve

        async def relieve(shard: Any) -> None:
            if self.fired_at is None:
                self._fire()
                raise RuntimeError("injected fault (akv stress --fault eviction_crash)")
            await original(shard)

        loop._relieve = relieve

    def _wrap_copies(self) -> None:
        copier = self.kv._executor._cpu_copier  # runs every batch, each phase of it
        original = copier.run
        slow = self.kind == "slow_copies"
        delays = [self._rng.uniform(0.001, 0.005) for _ in range(64)]
        count = 0

        def run(batch: Any) -> None:  # runs in the stream worker's thread
            nonlocal count
            self._fire()
            if not slow:
                raise RuntimeError("injected fault (akv stress --fault failing_copies)")
            time.sleep(delays[count % len(delays)])
            count += 1
            original(batch)

        copier.run = run
