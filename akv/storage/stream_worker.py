"""The stream worker's execution engine: block copies in submission order, off the event loop.

:class:`CopyExecutor` takes batches of block copies and runs them strictly in
submission order; each submit returns a :class:`CopyTicket` to wait on
(blocking, or ``await`` without blocking the loop or holding a thread; see
:mod:`akv.storage.copy_ticket`). :meth:`CopyExecutor.submit` takes
``(src, dst)`` device block pairs (:meth:`KVStorage.copy_blocks` semantics,
copy-on-write); :meth:`CopyExecutor.submit_tiers` takes a batch of three
phases run in order, device → host, device → device, host → device
(:mod:`akv.storage.tier_copy`), for the host tier. The manager runs the worker
loop in a thread of its own; this module holds no event-loop state.

On CUDA, copies run on a dedicated ``torch.cuda.Stream``. They are *enqueued
by* :meth:`~CopyExecutor.submit` (kernel launches are asynchronous, so this
does not wait for the GPU): the copy stream first waits on an event recorded
on the submitter's current stream (so the copies see every write issued
before ``submit``), then the copies, then the ticket's ``fence`` event. The
worker thread only ``fence.synchronize()``-s and marks tickets done. Enqueueing
in ``submit`` rather than in the thread is deliberate: ``cudaStreamWaitEvent``
on an event that has not been recorded yet is a no-op, so a fence recorded
later by the thread could silently fail to order a model runner that waits on
it right after ``submit``. Here ``ticket.fence`` is recorded before ``submit``
returns. Cross-tier phases are enqueued the same way, all on the copy stream,
with no CPU-side step; :mod:`akv.storage.tier_cuda` gives the ordering
argument.

On CPU with a host tier in shared memory (what
:meth:`KVStorage.from_config` allocates on Linux), a child process runs the
copies (:mod:`akv.storage.copy_process`): ``submit`` writes the batch to it,
and the worker thread reads its answers and settles the tickets. Otherwise
(no host tier, or private memory) the worker thread runs the copies with
numpy and torch ops, the phases of a batch in order. With
``CopyExecutor(None)`` (metadata-only pools) every batch completes inside
``submit`` and no tensor is touched.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from akv.errors import ActorCrashed, InvalidInput, ManagerClosed
from akv.storage.copy_process import CopyProcess, process_supported
from akv.storage.copy_submit import STREAM_WORKER, CopyJob, CopySubmission
from akv.storage.copy_ticket import CopyTicket
from akv.storage.kv_pool import KVStorage
from akv.storage.process_lane import ProcessLane, start_lane
from akv.storage.tier_copy import TierCopier
from akv.storage.tier_cuda import CudaTierCopier

_STOP = object()


class CopyExecutor(CopySubmission):
    """Runs block-copy batches in submission order on one thread (and one CUDA stream).

    Two ways to run the worker: :meth:`start` (a daemon ``threading.Thread``),
    or hand :meth:`run_forever` to someone else's thread, e.g. the async actor
    doing ``await anyio.to_thread.run_sync(executor.run_forever)`` and later
    ``executor.close()`` from the event loop, which makes ``run_forever``
    return after the queued batches.

    A failure inside the worker (device error, OOM; bad input is rejected by
    :meth:`submit`) fails that batch and breaks the executor: later batches
    would copy from unordered data, so they fail with
    :class:`~akv.errors.ActorCrashed` and so does every later ``submit``.

    Args:
        storage: The tensors to copy in; ``None`` for metadata-only mode, where
            batches complete inside ``submit`` (block counts kept, ``nbytes`` 0).
        zero_copy: On CUDA, let fragmented cross-tier phases run as kernels on
            a device alias of the pinned host pool (see
            :mod:`akv.storage.tier_cuda`); ``False``: DMA only. Ignored on CPU.
        process: On CPU, run the copies in a child process
            (:mod:`akv.storage.copy_process`); ``None`` (default): when the
            pools are in shared memory with a host tier and the child can be
            started (else on the worker thread, and :attr:`process_unavailable`
            says why); ``False``: on the worker thread.
        stall_timeout_s: Seconds the copy process may go without answering
            while batches wait for it, or after :meth:`close`, before it is
            killed (a stopped or wedged child must not hang the copies'
            waiters or the manager's exit); its unanswered batches then fail
            with :class:`~akv.errors.ActorCrashed`, and the executor breaks.

    Raises:
        InvalidInput: ``process=True`` without CPU pools in shared memory
            with a host tier, or in a frozen or embedded interpreter.
        OSError: ``process=True`` and the copy process could not be started.

    Attributes:
        completed_seq_no: ``seq_no`` of the last batch that finished or failed
            (0 before any); monotone, readable from any thread.
        process_unavailable: Why ``process=None`` fell back to the worker
            thread with shared pools (a frozen interpreter, an ``OSError``
            starting the child), else ``None``.
    """

    def __init__(
        self,
        storage: KVStorage | None,
        *,
        zero_copy: bool = True,
        process: bool | None = None,
        stall_timeout_s: float = 60.0,
    ) -> None:
        self.storage = storage
        self.completed_seq_no = 0
        self._queue: queue.SimpleQueue[CopyJob | object] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards seq numbering, enqueue order and state flags
        self._next_seq_no = 1
        self._closed = False
        self._abort = False
        self._claimed = False  # some thread runs (or ran) the worker loop
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._cuda = storage is not None and storage.device.type == "cuda"
        shared = (
            storage is not None
            and storage.arena is not None
            and storage.host is not None
            and storage.host.arena is not None
        )
        if process and not (shared and process_supported()):
            raise InvalidInput("process=True needs CPU pools in shared memory with a host tier and a python executable")
        self._lane, self.process_unavailable = start_lane(storage, process, stall_timeout_s) if shared else (None, None)
        self._cpu_copier = (
            TierCopier(storage) if storage is not None and not self._cuda and self._lane is None else None
        )
        self._cuda_copier = CudaTierCopier(storage, zero_copy) if storage is not None and self._cuda else None
        #: Called from the worker thread with the :class:`ActorCrashed` of a failed
        #: batch (a device error), once per failed batch; the manager fails itself.
        self.on_failure: Callable[[ActorCrashed], object] | None = None
        self._stream = torch.cuda.Stream(storage.device) if self._cuda else None

    def wait_process_ready(self, timeout_s: float = 30.0) -> bool:
        """Before the first batch: wait for the copy process to say it is ready, else fall back to the thread.

        Blocking (the manager calls it on a worker thread). A child that
        exits first (``sys.executable`` is a program but no Python with
        numpy) or stays silent for ``timeout_s`` is killed; the copies then
        run on the worker thread and :attr:`process_unavailable` says why.

        Returns:
            Whether the copies run in a child process.

        Raises:
            InvalidInput: A batch was already submitted.
        """
        lane = self._lane
        if lane is None:
            return False
        if self._next_seq_no != 1:
            raise InvalidInput("wait_process_ready must come before the first batch")
        reason = lane.process.wait_ready(timeout_s)
        if reason is None:
            return True
        lane.process.close()  # killed by wait_ready, or exited
        with self._lock:
            self._lane = None
            self._cpu_copier = TierCopier(self.storage) if self.storage is not None else None
            self.process_unavailable = reason
        return False

    @property
    def _process(self) -> CopyProcess | None:
        """The child running the CPU copies, or ``None`` (worker thread, CUDA, metadata)."""
        return self._lane.process if self._lane is not None else None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The dedicated copy stream on CUDA, else ``None``."""
        return self._stream

    def start(self) -> None:
        """Run the worker loop on a new daemon thread.

        Raises:
            RuntimeError: The worker loop is already running.
            ManagerClosed: The executor is closed.
        """
        with self._lock:
            if self._closed:
                raise ManagerClosed("copy executor is closed")
            self._claim_locked()
            self._thread = threading.Thread(target=self._loop, name="akv-copy-executor", daemon=True)
        self._thread.start()

    def run_forever(self) -> None:
        """Run the worker loop in the calling thread until :meth:`close`.

        Returns after the batches queued before ``close`` have finished (or
        failed, with ``close(drain=False)`` or after a failure). Returns at once
        if the loop already ran to completion (e.g. inside ``close``).

        Raises:
            RuntimeError: The worker loop is already running elsewhere.
        """
        with self._lock:
            if self._claimed and self._closed:
                return
            self._claim_locked()
        self._loop()

    def _claim_locked(self) -> None:
        if self._claimed:
            raise RuntimeError("copy executor worker is already running")
        self._claimed = True

    @property
    def zero_copy(self) -> bool:
        """On CUDA, whether the host pool is aliased on the device (fragmented phases run as kernels).

        ``False`` on CPU, in metadata mode and without a host tier; see
        :mod:`akv.storage.tier_cuda`.
        """
        return self._cuda_copier is not None and self._cuda_copier.zero_copy

    def close(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop accepting batches, finish (or fail) the queued ones, stop the worker.

        Idempotent. Joins the thread :meth:`start` created; a :meth:`run_forever`
        running in another thread returns on its own once the queue is done. If
        no worker loop ever ran, the queued batches are processed here, in the
        calling thread.

        Args:
            drain: ``True`` runs the queued batches; ``False`` fails those not
                yet started with :class:`~akv.errors.ManagerClosed` (on CUDA
                copies already enqueued on the stream cannot be recalled, so
                they are still waited for).
            timeout_s: Seconds to wait for the :meth:`start` thread; ``None``
                waits as long as it takes.
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
            self._abort = self._abort or not drain
            run_here = not self._claimed
            self._claimed = True
            if self._lane is not None:
                self._lane.close(drain)  # drain: the child exits after the batches written
        if run_here:
            self._loop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _loop(self) -> None:
        if self._lane is not None:
            self._answers_loop(self._lane)
            return
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            assert isinstance(job, CopyJob), f"unexpected queue item {job!r}"
            self._run(job)

    def _run(self, job: CopyJob) -> None:
        exc: BaseException | None = None
        try:
            self._execute(job)
        except (ActorCrashed, ManagerClosed) as err:
            exc = err
        except Exception as err:  # reported through the ticket; breaks the executor
            exc = ActorCrashed(STREAM_WORKER, err)
            exc.__cause__ = err
            with self._lock:
                self._failure = err
        job.keepalive = ()
        if isinstance(exc, ActorCrashed) and exc.cause is not None and self.on_failure is not None:
            self.on_failure(exc)  # before the ticket settles: its waiters see a failed manager
        self.completed_seq_no = job.ticket.seq_no
        job.ticket._finish(exc)

    def _answers_loop(self, lane: ProcessLane) -> None:
        """Settle the tickets the copy process answers, in order, until it exits; then fail the unanswered."""
        unanswered, ended = lane.serve(self._settle_answer)
        with self._lock:
            aborted, failure = self._abort, self._failure or ended
        if failure is not None and not aborted:
            self._crash(failure)
        for ticket in unanswered:
            if aborted:
                exc: BaseException = ManagerClosed(f"copy executor closed before batch {ticket.seq_no} ran")
            else:
                exc = ActorCrashed(STREAM_WORKER, failure)
                exc.__cause__ = failure
            self.completed_seq_no = ticket.seq_no
            ticket._finish(exc)

    def _settle_answer(self, ticket: CopyTicket, message: str | None) -> None:
        exc = None
        if message is not None:
            exc = self._crash(RuntimeError(f"copy process failed batch {ticket.seq_no}: {message}"))
        self.completed_seq_no = ticket.seq_no
        ticket._finish(exc)

    def _crash(self, err: BaseException) -> ActorCrashed:
        """Break the executor with ``err`` (once) and tell :attr:`on_failure`; the error for the batch."""
        exc = ActorCrashed(STREAM_WORKER, err)
        exc.__cause__ = err
        with self._lock:
            first = self._failure is None
            self._failure = self._failure or err
        if first and self.on_failure is not None:
            self.on_failure(exc)
        return exc

    def _execute(self, job: CopyJob) -> None:
        if self._failure is not None:
            raise ActorCrashed(STREAM_WORKER, self._failure) from self._failure
        if job.ticket.fence is not None:  # CUDA: enqueued by submit; cannot be recalled
            job.ticket.fence.synchronize()
        elif self._abort:
            raise ManagerClosed(f"copy executor closed before batch {job.ticket.seq_no} ran")
        elif job.batch is not None and self._cpu_copier is not None:
            self._cpu_copier.run(job.batch)

    def __repr__(self) -> str:
        mode = "metadata" if self.storage is None else str(self.storage.device)
        if self._process is not None:
            mode += f", {self._process!r}"
        return f"CopyExecutor({mode}, completed_seq_no={self.completed_seq_no}, closed={self._closed})"
