"""Cancellation points chosen by scheduler checkpoint count, not by wall time.

``run_cancelled(call, k)`` runs ``call()`` under a cancel scope that a helper
task cancels once it has passed ``k`` checkpoints (``k == 0``: cancelled
before the call starts). Each checkpoint of the helper lets every other
runnable task (the call, the actors) take one turn, so ``k`` walks the
cancellation through the call's await points in order, the same way on every
machine whatever its load.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel


async def cancel_after(
    scope: anyio.CancelScope, k: int, *, wait: Callable[[], Awaitable[object]] | None = None, wait_at: int = 0
) -> None:
    """Cancel ``scope`` after ``k`` checkpoints; with ``wait``, await ``wait()`` once before checkpoint ``wait_at``.

    ``wait`` (e.g. ``kv.wait_copies``) moves the later cancellation points past
    a completion the call waits on outside the event loop (a copy thread),
    which no number of checkpoints alone is sure to reach.
    """
    for i in range(k):
        if wait is not None and i == wait_at:
            await wait()
        await anyio.lowlevel.checkpoint()
    scope.cancel()


async def run_cancelled(
    call: Callable[[], Awaitable[object]],
    k: int,
    *,
    wait: Callable[[], Awaitable[object]] | None = None,
    wait_at: int = 0,
) -> bool:
    """Run ``call()`` under a scope cancelled after ``k`` checkpoints; True if it finished before that.

    Args:
        call: The awaited call.
        k: Checkpoints the canceller passes first (0: the scope is cancelled
            before ``call`` starts).
        wait: See :func:`cancel_after`.
        wait_at: See :func:`cancel_after`.
    """
    scope = anyio.CancelScope()
    if k == 0:
        scope.cancel()
    async with anyio.create_task_group() as tg:
        if k:
            tg.start_soon(lambda: cancel_after(scope, k, wait=wait, wait_at=wait_at))
        with scope:
            await call()
    return not scope.cancelled_caught
