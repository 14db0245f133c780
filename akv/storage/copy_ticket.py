"""The completion of one copy batch: a thread-safe ticket that async waiters await without a thread.

A :class:`CopyTicket` is settled once, by the stream worker's thread (or by
:meth:`~akv.storage.CopyExecutor.close`). Blocking callers wait on a
``threading.Event``; async callers, on any anyio backend (asyncio, uvloop,
trio), share one event per event loop that the settling thread sets with one
non-blocking thread-safe call (``loop.call_soon_threadsafe`` or
``TrioToken.run_sync_soon``), so thousands of waiters cost no threads and the
copy thread never waits on a busy loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import anyio.lowlevel
import structlog
import torch

log = structlog.get_logger(
    "akv", component="stream_worker"
)  # lazy: bound at first use, after the application configured structlog


class CopyTicket:
    """One submitted copy batch: a thread-safe completion plus a CUDA fence.

    Completion reaches async waiters without a thread each: the first
    :meth:`wait_async` of an event loop registers one event for that loop, every
    later waiter of the loop awaits the same event, and the worker thread wakes
    them all with one non-blocking thread-safe call per loop
    (``loop.call_soon_threadsafe`` on asyncio and uvloop,
    ``TrioToken.run_sync_soon`` on trio).

    Attributes:
        seq_no: Submission number, 1 for the first batch of an executor.
        num_blocks: Block pairs copied by the batch, all phases
            (``d2h_blocks + device-to-device pairs + h2d_blocks``).
        nbytes: Bytes written (``num_blocks * bytes_per_block``; 0 in metadata mode).
        d2h_blocks: Pairs of the device-to-host phase (demotion, swap-out).
        h2d_blocks: Pairs of the host-to-device phase (promotion, swap-in).
        fence: On CUDA, a ``torch.cuda.Event`` recorded on the copy stream after
            the copies, already recorded when :meth:`CopyExecutor.submit`
            returns; a consumer orders its stream after the copies with
            ``torch.cuda.current_stream().wait_event(ticket.fence)`` before it
            reads a destination or writes a source block. ``None`` on CPU and
            in metadata mode (wait on the ticket instead).
    """

    __slots__ = (
        "_callbacks",
        "_done",
        "_exc",
        "_lock",
        "_loop_waiters",
        "d2h_blocks",
        "fence",
        "h2d_blocks",
        "nbytes",
        "num_blocks",
        "seq_no",
    )

    def __init__(
        self,
        *,
        seq_no: int,
        num_blocks: int,
        nbytes: int,
        fence: torch.cuda.Event | None,
        d2h_blocks: int = 0,
        h2d_blocks: int = 0,
    ) -> None:
        self.seq_no = seq_no
        self.num_blocks = num_blocks
        self.nbytes = nbytes
        self.d2h_blocks = d2h_blocks
        self.h2d_blocks = h2d_blocks
        self.fence = fence
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[CopyTicket], object]] = []
        self._loop_waiters: list[_LoopWaiters] = []  # one entry per event loop with async waiters
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True once the batch has finished or failed (non-blocking)."""
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        """The batch's exception if it failed; ``None`` if it succeeded or is still pending."""
        return self._exc

    def wait(self, timeout_s: float | None = None) -> None:
        """Block the calling thread until the batch is done.

        Args:
            timeout_s: Seconds to wait at most; ``None`` waits forever.

        Raises:
            TimeoutError: Not done within ``timeout_s``.
            BaseException: The copy's own exception, re-raised, if it failed.
        """
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"copy batch {self.seq_no} not done after {timeout_s} s")
        if self._exc is not None:
            raise self._exc

    async def wait_async(self) -> None:
        """Wait without blocking the event loop and without a worker thread (anyio: asyncio, uvloop, trio).

        Returns at once, without a checkpoint, if the batch is already done.
        Otherwise the caller awaits the event its loop shares with every other
        waiter of this ticket; the worker thread sets it with one thread-safe
        call per loop when the batch finishes or fails. Cancellation is safe:
        the cancelled waiter leaves, the last one of a loop unregisters the
        loop's event, and later waiters are still woken. Every batch finishes
        or fails (:meth:`CopyExecutor.close` fails those it does not run), so
        no waiter is left hanging.

        Raises:
            BaseException: The copy's own exception, re-raised, if it failed
                (:class:`~akv.errors.ManagerClosed` for a batch that closing
                the executor did not run).
        """
        if not self._done.is_set():
            await self._wait_in_loop()
        if self._exc is not None:
            raise self._exc

    async def _wait_in_loop(self) -> None:
        native = anyio.lowlevel.current_token().native_token
        with self._lock:
            if self._done.is_set():
                return
            waiters = next((w for w in self._loop_waiters if w.native is native), None)
            if waiters is None:
                waiters = _LoopWaiters(native)
                self._loop_waiters.append(waiters)
            waiters.count += 1
        try:
            await waiters.event.wait()
        finally:
            with self._lock:
                waiters.count -= 1
                if waiters.count == 0 and waiters in self._loop_waiters:
                    self._loop_waiters.remove(waiters)

    def add_done_callback(self, fn: Callable[[CopyTicket], object]) -> None:
        """Call ``fn(ticket)`` once done, from the worker thread (or now if already done).

        ``fn`` must be quick and thread-safe, e.g. ``loop.call_soon_threadsafe``
        or an ``anyio.from_thread`` call; its exceptions are logged and otherwise ignored.
        """
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        _call_quietly(fn, self)

    def _finish(self, exc: BaseException | None) -> None:
        with self._lock:
            self._exc = exc
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
            loops, self._loop_waiters = self._loop_waiters, []
        for waiters in loops:
            waiters.wake(self.seq_no)
        for fn in callbacks:
            _call_quietly(fn, self)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc else "done")
        return f"CopyTicket(seq_no={self.seq_no}, num_blocks={self.num_blocks}, {state})"


class _LoopWaiters:
    """The async waiters of one ticket in one event loop: one event, one thread-safe wake-up.

    Created in the loop's thread by the loop's first waiter (``anyio.Event``
    binds to the running backend); ``count`` is guarded by the ticket's lock.
    ``native`` is anyio's native loop token: an ``asyncio`` loop (also uvloop)
    or a ``trio.lowlevel.TrioToken``.
    """

    __slots__ = ("count", "event", "native", "schedule")

    def __init__(self, native: object) -> None:
        self.native = native
        self.event = anyio.Event()
        self.count = 0
        self.schedule = _scheduler_of(native)

    def wake(self, seq_no: int) -> None:
        """From any thread: set the event inside its loop (a no-op if that loop has ended)."""
        try:
            self.schedule(self.event.set)
        except RuntimeError as err:  # asyncio "Event loop is closed", trio.RunFinishedError
            log.debug("copy.waiters_loop_gone", seq_no=seq_no, error=repr(err))


def loop_scheduler() -> Callable[[Callable[[], object]], object]:
    """The running event loop's non-blocking, thread-safe "run this soon" call.

    ``loop.call_soon_threadsafe`` on asyncio and uvloop, ``TrioToken.run_sync_soon``
    on trio: another thread hands the loop a callback without waiting for it,
    so a copy thread never blocks on a busy loop. Call it inside the loop; use
    the result from any thread (it raises ``RuntimeError`` once the loop ended).
    """
    return _scheduler_of(anyio.lowlevel.current_token().native_token)


def _scheduler_of(native: object) -> Callable[[Callable[[], object]], object]:
    schedule = getattr(native, "call_soon_threadsafe", None) or getattr(native, "run_sync_soon", None)
    if schedule is None:
        raise RuntimeError(f"no thread-safe scheduling call on event loop token {native!r}")
    return schedule


def _call_quietly(fn: Callable[[CopyTicket], object], ticket: CopyTicket) -> None:
    try:
        fn(ticket)
    except Exception as err:  # a callback must not kill the worker; report it and go on
        log.error("copy.done_callback_failed", seq_no=ticket.seq_no, error=repr(err), exc_info=err)
