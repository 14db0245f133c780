"""The copy executor's side of a copy process: the batches written and not yet answered, and their reader.

:class:`~akv.storage.stream_worker.CopyExecutor` numbers a batch and hands
it to :meth:`ProcessLane.send` under its lock, so requests reach the child in
``seq_no`` order; its worker thread runs :meth:`ProcessLane.serve`, which
reads the child's answers (:meth:`CopyProcess.completions`), settles each
ticket in order, and returns once the child has exited, with the tickets it
never answered and why it ended.

A child that stops answering (stopped with ``SIGSTOP``, wedged in the
kernel) is killed once ``stall_timeout_s`` passes without an answer while
batches wait for it, or after :meth:`ProcessLane.close`: its batches then
fail (and the manager with them) instead of every waiter hanging, and a
manager's exit waits for its copies, but not forever.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from akv.storage.copy_process import CopyProcess, process_supported
from akv.storage.copy_ticket import CopyTicket
from akv.storage.kv_pool import KVStorage
from akv.storage.tier_copy import TierBatch

#: Seconds the reader waits for answers before it looks at the clock (the stall check).
POLL_S = 0.5


class ProcessLane:
    """Batches in flight in one :class:`CopyProcess`, answered in submission order.

    Args:
        process: The started child.
        stall_timeout_s: Seconds without an answer, while batches are in
            flight or after :meth:`close`, before the child is killed (its
            unanswered batches then fail).
    """

    def __init__(self, process: CopyProcess, stall_timeout_s: float) -> None:
        self.process = process
        self.stall_timeout_s = stall_timeout_s
        self._closed_at = 0.0  # monotonic seconds of the first close()
        self._inflight: deque[CopyTicket] = deque()
        self._busy_since = 0.0  # monotonic seconds when the batches in flight began to wait (none before)
        self._drain_lock = threading.Lock()  # the final drain against a failed send taking its ticket back

    def send(self, ticket: CopyTicket, batch: TierBatch) -> None:
        """Write a numbered batch to the child (the caller holds the lock that orders ``seq_no``).

        Raises:
            OSError: The child has exited or the request pipe is closed;
                nothing is in flight for this ticket (the reader, ending at
                the same time, may have failed it already).
        """
        if not self._inflight:
            self._busy_since = time.monotonic()
        self._inflight.append(ticket)
        try:
            self.process.send(ticket.seq_no, batch)
        except OSError:
            with self._drain_lock:
                if self._inflight and self._inflight[-1] is ticket:
                    self._inflight.pop()
            raise

    def close(self, drain: bool) -> None:
        """Stop writing: the child exits after the batches written (``drain``) or is killed now. Idempotent."""
        self._closed_at = self._closed_at or time.monotonic()
        if drain:
            self.process.close_input()
        else:
            self.process.kill()

    def serve(self, settle: Callable[[CopyTicket, str | None], None]) -> tuple[list[CopyTicket], RuntimeError | None]:
        """Settle the child's answers until it exits, then close its pipes.

        Args:
            settle: Called for each answered ticket, in ``seq_no`` order, with
                the child's error message for it (``None``: copied).

        Returns:
            The tickets never answered, in order, and why the child ended:
            ``None`` if it ended as asked (closed, nothing in flight), else
            the error (killed, crashed, failed to start, or stalled after
            :meth:`close` and killed here).
        """
        process = self.process
        last_answer, stalled = time.monotonic(), False
        while (answers := process.completions(timeout_s=POLL_S)) is not None:
            now = time.monotonic()
            if answers:
                last_answer = now
            elif not stalled and now - max(last_answer, self._waiting_since()) > self.stall_timeout_s:
                stalled = True  # stopped or wedged: fail its batches rather than hang their waiters (or the exit)
                process.kill()
            for seq_no, message in answers:
                ticket = self._inflight.popleft()
                assert ticket.seq_no == seq_no, f"copy process answered {seq_no}, expected {ticket.seq_no}"
                settle(ticket, message)
        exit_text = process.describe_exit()
        process.close()
        with self._drain_lock:  # a send failing meanwhile finds its ticket in flight, or failed here
            unanswered = list(self._inflight)
            self._inflight.clear()
        error = None
        if stalled:
            error = RuntimeError(
                f"copy process gave no answer for {self.stall_timeout_s} s and was killed, "
                f"{len(unanswered)} batches unanswered"
            )
        elif unanswered or not self._closed_at:  # killed, or died: no copy runs from here on
            error = RuntimeError(f"the copy process {exit_text}, {len(unanswered)} batches unanswered")
        return unanswered, error

    def _waiting_since(self) -> float:
        """Monotonic seconds since an answer is owed (batches in flight, or a close); ``inf`` when none is."""
        owed = []
        if self._inflight:
            owed.append(self._busy_since)
        if self._closed_at:
            owed.append(self._closed_at)
        return min(owed, default=float("inf"))

    def __repr__(self) -> str:
        return f"ProcessLane({self.process!r}, in_flight={len(self._inflight)})"


def start_lane(
    storage: KVStorage, process: bool | None, stall_timeout_s: float
) -> tuple[ProcessLane | None, str | None]:
    """Start a copy process on ``storage``'s shared pools; the lane, or ``None`` and why not.

    Args:
        storage: CPU pools in shared memory with a host tier.
        process: ``False``: no child (``None, None``); ``None``: a child if
            one can start, else ``None`` and the reason (a frozen or embedded
            interpreter, an ``OSError`` starting it); ``True``: a child.
        stall_timeout_s: See :class:`ProcessLane`.

    Raises:
        OSError: ``process=True`` and the child could not be started.
    """
    if process is False:
        return None, None
    if not process_supported():
        frozen = "a frozen application: " if getattr(sys, "frozen", False) else ""
        return None, f"{frozen}sys.executable {sys.executable!r} is not a python interpreter to start"
    try:
        return ProcessLane(CopyProcess(storage), stall_timeout_s), None
    except OSError as err:
        if process:
            raise
        return None, f"cannot start the copy process: {err!r}"
