"""Submission of copy batches to the stream worker (a mixin of :class:`~akv.storage.stream_worker.CopyExecutor`).

Validation, numbering and queueing: each submit checks its batch, takes the
next ``seq_no`` under the executor's lock and hands the batch on, in that
order, to the copy stream (CUDA, enqueued here), the copy process (a pipe
write) or the worker thread's queue. Metadata mode numbers the batch and
completes it at once. How the batches then run is
:mod:`akv.storage.stream_worker`'s part.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from akv.errors import ActorCrashed, InvalidInput, ManagerClosed
from akv.storage.copy_ticket import CopyTicket
from akv.storage.tensor_args import IndexLike
from akv.storage.tier_copy import TierBatch, check_tier_batch, own_tier_batch, tier_batch_sizes

if TYPE_CHECKING:
    import queue

    from akv.storage.kv_pool import KVStorage
    from akv.storage.process_lane import ProcessLane
    from akv.storage.tier_cuda import CudaTierCopier

#: The actor name in the stream worker's :class:`~akv.errors.ActorCrashed`.
STREAM_WORKER = "stream worker"


@dataclass(slots=True)
class CopyJob:
    """A numbered batch queued for the worker thread (its ticket settles when the batch has run)."""

    ticket: CopyTicket
    batch: TierBatch | None  # CPU: the validated batch (CPU int64 ids); None on CUDA (already enqueued)
    keepalive: tuple[torch.Tensor, ...] = ()  # CUDA: index tensors the enqueued copies read


class CopySubmission:
    """The submit side of :class:`~akv.storage.stream_worker.CopyExecutor` (uses its attributes)."""

    storage: KVStorage | None
    completed_seq_no: int
    _lock: threading.Lock
    _next_seq_no: int
    _closed: bool
    _failure: BaseException | None
    _queue: queue.SimpleQueue
    _lane: ProcessLane | None
    _cuda_copier: CudaTierCopier | None
    _stream: torch.cuda.Stream | None

    def submit(self, src_ids: IndexLike, dst_ids: IndexLike) -> CopyTicket:
        """Queue one batch ``cache[:, dst] = cache[:, src]`` in every layer; non-blocking, thread-safe.

        Validation runs here, so bad input raises before anything is queued.
        On CUDA the copies are also enqueued on the copy stream here (ordered
        after the caller's current stream); see the module docstring. The same
        as :meth:`submit_tiers` with the device-to-device phase only.

        Args:
            src_ids: ``(m,)`` source block ids (list or int32/int64 tensor).
            dst_ids: ``(m,)`` destination block ids, pairwise with ``src_ids``.

        Returns:
            The batch's ticket; batches complete in ``seq_no`` order.

        Raises:
            InvalidInput: See :meth:`KVStorage.check_copy_ids` (with storage).
            ManagerClosed: :meth:`close` was called.
            ActorCrashed: An earlier batch failed inside the worker.
        """
        if self.storage is None:
            if len(src_ids) != len(dst_ids):
                raise InvalidInput(f"src_ids has {len(src_ids)} ids but dst_ids has {len(dst_ids)}")
            return self._submit_metadata(0, len(src_ids), 0)
        return self._submit_batch(check_tier_batch(self.storage, d2d_src_ids=src_ids, d2d_dst_ids=dst_ids))

    def submit_tiers(
        self,
        *,
        d2h_src_ids: IndexLike = (),
        d2h_dst_slots: IndexLike = (),
        d2d_src_ids: IndexLike = (),
        d2d_dst_ids: IndexLike = (),
        h2d_src_slots: IndexLike = (),
        h2d_dst_ids: IndexLike = (),
    ) -> CopyTicket:
        """Queue one cross-tier batch: device → host, then device → device, then host → device.

        Non-blocking and thread-safe, like :meth:`submit`; the phases run in
        that order inside the one ticket (:mod:`akv.storage.tier_copy`), so a
        device block demoted by the first phase may be a destination of the
        last. Host slots are indices into :attr:`KVStorage.host`
        (``0 .. num_host_blocks - 1``), not tree ids. On CUDA every phase is
        enqueued on the copy stream here and ``ticket.fence`` orders a
        consumer after all of them (:mod:`akv.storage.tier_cuda`).

        Args:
            d2h_src_ids: ``(a,)`` device block ids to copy out (demotion, swap-out).
            d2h_dst_slots: ``(a,)`` host slots they go to, distinct.
            d2d_src_ids: ``(b,)`` device block ids (copy-on-write sources).
            d2d_dst_ids: ``(b,)`` device block ids, distinct, none a source.
            h2d_src_slots: ``(c,)`` host slots to copy in (promotion, swap-in).
            h2d_dst_ids: ``(c,)`` device block ids they go to, distinct.

        Returns:
            The batch's ticket: ``num_blocks = a + b + c``, ``d2h_blocks = a``,
            ``h2d_blocks = c``, ``nbytes = num_blocks * bytes_per_block``.

        Raises:
            InvalidInput: See :func:`~akv.storage.tier_copy.check_tier_batch`;
                in metadata mode only mismatched lengths. Nothing is queued.
            ManagerClosed: :meth:`close` was called.
            ActorCrashed: An earlier batch failed inside the worker, or
                enqueueing this one on the device failed (the executor is
                then broken).
        """
        phases = {
            "d2h_src_ids": d2h_src_ids,
            "d2h_dst_slots": d2h_dst_slots,
            "d2d_src_ids": d2d_src_ids,
            "d2d_dst_ids": d2d_dst_ids,
            "h2d_src_slots": h2d_src_slots,
            "h2d_dst_ids": h2d_dst_ids,
        }
        if self.storage is None:
            return self._submit_metadata(*tier_batch_sizes(**phases))
        return self._submit_batch(check_tier_batch(self.storage, **phases))

    def submit_own(self, *phases: IndexLike) -> CopyTicket:
        """Queue a pool shard's own batch (six lists of ints or int64 arrays, as :meth:`submit_tiers` names them, in order).

        For the manager's batches, built from its block states: ids are
        range-checked, destinations are not searched for repeats
        (:func:`~akv.storage.tier_copy.own_tier_batch`). Otherwise as
        :meth:`submit_tiers`.

        Raises:
            InvalidInput: Lengths differ or an id is out of range.
            ManagerClosed: :meth:`close` was called.
            ActorCrashed: An earlier batch failed.
        """
        if self.storage is None:
            return self._submit_metadata(len(phases[0]), len(phases[2]), len(phases[4]))
        return self._submit_batch(own_tier_batch(self.storage, *phases))

    def _submit_metadata(self, num_d2h: int, num_d2d: int, num_h2d: int) -> CopyTicket:
        """Metadata mode: number the batch and complete it at once."""
        with self._lock:
            self._check_open_locked()
            ticket = CopyTicket(
                seq_no=self._next_seq_no,
                num_blocks=num_d2h + num_d2d + num_h2d,
                nbytes=0,
                fence=None,
                d2h_blocks=num_d2h,
                h2d_blocks=num_h2d,
            )
            self._next_seq_no += 1
            self.completed_seq_no = ticket.seq_no
        ticket._finish(None)
        return ticket

    def _submit_batch(self, batch: TierBatch) -> CopyTicket:
        """Number a validated batch and queue it (on CUDA: enqueue it on the copy stream first)."""
        storage = self.storage
        assert storage is not None, "a tensor batch without storage"
        counts = {"num_blocks": batch.num_blocks, "d2h_blocks": batch.num_d2h, "h2d_blocks": batch.num_h2d}
        nbytes = batch.num_blocks * storage.bytes_per_block
        with self._lock:
            self._check_open_locked()
            seq_no = self._next_seq_no
            if self._cuda_copier is not None:
                assert self._stream is not None, "CUDA path without a copy stream"
                try:
                    fence, keepalive = self._cuda_copier.enqueue(batch, self._stream)
                except Exception as err:  # a device error while enqueueing: unordered data from here on
                    self._failure = err
                    raise ActorCrashed(STREAM_WORKER, err) from err
                job = CopyJob(CopyTicket(seq_no=seq_no, nbytes=nbytes, fence=fence, **counts), None, keepalive)
            elif self._lane is not None:
                return self._send_locked(CopyTicket(seq_no=seq_no, nbytes=nbytes, fence=None, **counts), batch)
            else:
                job = CopyJob(CopyTicket(seq_no=seq_no, nbytes=nbytes, fence=None, **counts), batch)
            self._next_seq_no += 1
            self._queue.put(job)
        return job.ticket

    def _send_locked(self, ticket: CopyTicket, batch: TierBatch) -> CopyTicket:
        """Write a numbered batch to the copy process (the lock held: requests go out in ``seq_no`` order)."""
        assert self._lane is not None, "no copy process"
        try:
            self._lane.send(ticket, batch)
        except OSError as err:  # the child has exited: the worker thread breaks the executor at end of file
            raise ActorCrashed(STREAM_WORKER, self._failure or err) from err
        self._next_seq_no += 1
        return ticket

    def _check_open_locked(self) -> None:
        if self._closed:
            raise ManagerClosed("copy executor is closed")
        if self._failure is not None:
            raise ActorCrashed(STREAM_WORKER, self._failure) from self._failure
