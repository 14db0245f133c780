"""The audit gate: every manager call of the stress tasks passes it, so the harness can stop them all.

An audit (:func:`akv.stress.audit.audit`) needs a quiescent manager: no call in
flight. The tasks' calls enter the gate before they are sent and leave it when
they return; :meth:`Gate.drain` closes it and waits until the last call in
flight has left, the audit runs, :meth:`Gate.open` lets the held calls go.
"""

from __future__ import annotations

import anyio


class Gate:
    """Every manager call passes it; the harness closes it to audit a quiescent point.

    ``await enter()`` before a call (waits while closed), ``leave()`` after;
    :meth:`drain` closes the gate and returns once no call is in flight.
    """

    def __init__(self) -> None:
        self._open = anyio.Event()
        self._open.set()
        self._idle = anyio.Event()
        self._idle.set()
        self._busy = 0

    async def enter(self) -> None:
        """Wait while closed, then count one call in flight."""
        while not self._open.is_set():
            await self._open.wait()
        if self._busy == 0:
            self._idle = anyio.Event()
        self._busy += 1

    def leave(self) -> None:
        """One call is done."""
        self._busy -= 1
        if self._busy == 0:
            self._idle.set()

    async def drain(self) -> None:
        """Close the gate and wait until no call is in flight."""
        if self._open.is_set():
            self._open = anyio.Event()
        await self._idle.wait()

    def open(self) -> None:
        """Let the held calls go."""
        self._open.set()
