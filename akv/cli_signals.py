"""SIGTERM for the ``akv`` commands: the run unwinds as on Ctrl-C (the manager shuts down), exit 143.

:func:`on_sigterm` is the handler :func:`akv.cli.main` installs while a
command runs. Where asyncio's runner handles SIGINT (cancelling the main task,
then ``KeyboardInterrupt``), SIGTERM raises SIGINT and takes that path. A
process that ignores SIGINT (a background job of a non-interactive shell)
has no such handler: SIGTERM then cancels the task a command runs in
(:func:`run_async`) itself, as asyncio's runner would; raising
``KeyboardInterrupt`` there instead would land in whatever code runs, an
actor's handler included, and fail the manager.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

#: Set once SIGTERM reached the command while it ran (the exit code is then 143).
terminated = threading.Event()

_main_task: asyncio.Task | None = None  # the asyncio task a command runs in, while it runs


def run_async(fn: Callable[..., Awaitable[T]], *args: Any, backend: str = "asyncio", **backend_options: Any) -> T:
    """``anyio.run(fn, *args)`` for a command, its task known to :func:`on_sigterm` (on asyncio and uvloop).

    Args:
        fn: The command's async function; ``args`` its arguments.
        backend: anyio backend name; ``backend_options`` its options (``use_uvloop``).

    Returns:
        What ``fn`` returned.

    Raises:
        BaseException: What ``fn`` raised; ``asyncio.CancelledError`` after a
            SIGTERM that cancelled it (:data:`terminated` is set then).
    """

    async def main() -> T:
        global _main_task
        try:
            task = asyncio.current_task()
        except RuntimeError:  # not asyncio (trio): SIGTERM raises KeyboardInterrupt there
            task = None
        _main_task = task
        try:
            return await fn(*args)
        finally:
            _main_task = None

    return anyio.run(main, backend=backend, backend_options=backend_options)


def on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM: unwind the command as Ctrl-C does (see the module docstring); a second one raises KeyboardInterrupt."""
    again = terminated.is_set()
    terminated.set()
    if callable(signal.getsignal(signal.SIGINT)):
        signal.raise_signal(signal.SIGINT)
        return
    task = _main_task
    if task is not None and not task.done() and not again:
        task.get_loop().call_soon_threadsafe(task.cancel)
        return
    raise KeyboardInterrupt
