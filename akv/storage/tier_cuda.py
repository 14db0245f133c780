"""Cross-tier batches on CUDA: every phase enqueued on the copy stream inside ``submit``, ordered by the stream alone.

:meth:`CudaTierCopier.enqueue` runs on the submitting thread, under the
executor's lock, and enqueues on the executor's copy stream, in order: a wait
on an event recorded on the submitter's current stream, phase (a) device →
host, phase (b) device → device, phase (c) host → device (see
:mod:`akv.storage.tier_copy`), then the ticket's ``fence`` event. Nothing is
left for the CPU to do but ``fence.synchronize()`` in the worker thread.

How the data moves, per layer, on the ``(2, n, row)`` integer views
(:func:`~akv.storage.tensor_args.row_view`; pairs sorted by host slot, so that
consecutive slots form runs):

- (a), few runs (at most :data:`DMA_MAX_RUNS`): ``index_select`` gathers the
  device blocks into a device buffer, then one ``cudaMemcpyAsync`` per run and
  per K/V plane writes it into the pinned host pool (both sides contiguous, so
  torch issues a plain DMA, no temporary);
- (c), few runs: one DMA per run and plane from the pinned host pool into a
  device buffer, then ``index_copy_`` scatters it into the device blocks;
- (a) and (c) with more runs: zero-copy kernels. Pinned memory that
  ``cudaHostAlloc`` returned is mapped into the device's address space at the
  same address (unified virtual addressing, every 64-bit CUDA platform), so a
  CUDA tensor aliasing the host pool (:func:`device_view`) lets
  ``index_select`` / ``index_copy_`` read or write host slots directly over
  PCIe: two kernels per layer whatever the fragmentation of the slots (SGLang
  HiCache's "kernel" I/O backend does the same with its own kernels). The
  host pool is registered with ``cudaHostRegister``, whose memory the device
  reaches at the host address where
  ``cudaDevAttrCanUseHostPointerForRegisteredMem`` is set (discrete GPUs on
  64-bit Linux); elsewhere pass ``zero_copy=False`` to the executor. If torch
  cannot build the alias, every batch takes the DMA route
  (:attr:`CudaTierCopier.zero_copy` says which).
- (b) is :meth:`KVStorage._copy_unchecked`, as for ``submit(src, dst)``.

**Ordering argument.** (1) The copy stream first waits on an event recorded on
the submitter's current stream, so every phase sees every write issued there
before ``submit`` (the model runner's K/V writes). (2) The three phases of a
batch and all batches are enqueued on the one copy stream, in submission order
(the executor's lock covers numbering and enqueueing); a stream runs its work
in order, so phase (a) reads a device block before phase (c) of the same or
a later batch overwrites it, and a host slot written by (a) is read by a later
(c) only after the write. (3) Only work on the copy stream touches the host
pool between ``submit`` and the fence: there is no CPU-side gather or scatter
(a CPU step could not run before a DMA that ``submit`` already enqueued, nor
be ordered against later batches' DMAs), so host memory sees exactly stream
order. (4) The fence is recorded after phase (c) before ``submit`` returns, so
a consumer stream that waits on it (``wait_event(ticket.fence)``) is ordered
after both directions; a wait on an event not yet recorded would be a silent
no-op. (5) The ticket is done only after the worker thread's
``fence.synchronize()``, so when the core changes a block's location, the host
copy is complete and visible to the CPU. (6) No pageable memory: the host pool
and the uploaded index tensors are pinned (a ``non_blocking`` copy from
pageable memory would be synchronous and staged); device buffers are allocated
on the copy stream, so the caching allocator hands their memory only to later
work of that stream; the pinned index tensors stay referenced by the job until
the fence has been synchronized.
"""

from __future__ import annotations

import numpy as np
import torch

from akv.storage.kv_pool import KVStorage
from akv.storage.row_copy import run_starts, runs_of
from akv.storage.tensor_args import row_view
from akv.storage.tier_copy import TierBatch

#: Host-slot runs up to which a phase uses DMA (``2 * num_layers * runs``
#: copies) rather than zero-copy kernels (``2 * num_layers``); to be tuned on
#: a GPU with ``stress/bench_tier_copy.py``.
DMA_MAX_RUNS = 4


class _HostArray:
    """``__cuda_array_interface__`` (v2) of a pinned host tensor, holding the tensor alive."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": torch.empty(0, dtype=tensor.dtype).numpy().dtype.str,
            "data": (tensor.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor on ``device`` aliasing the pinned, contiguous ``host`` tensor (zero-copy), or ``None``.

    torch builds it from ``__cuda_array_interface__`` with ``at::from_blob``
    on ``device`` (older releases ask ``cudaPointerGetAttributes`` for the
    pointer's device instead, which for registered memory is the device that
    was current at registration: :class:`HostKVStorage` registers with
    ``device`` current). ``device`` is passed explicitly because without it
    older releases copy the interface's memory to the default device.

    Args:
        host: Pinned, contiguous CPU tensor of an integer dtype (a row view).
        device: The CUDA device that will run the kernels.

    Returns:
        The alias (same shape, dtype and address as ``host``), or ``None`` if
        ``host`` is not pinned or torch cannot alias it on ``device``.
    """
    if not host.is_pinned() or not host.is_contiguous():
        return None
    try:
        with torch.cuda.device(device):
            view = torch.as_tensor(_HostArray(host), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    if view.device != device or view.data_ptr() != host.data_ptr() or view.shape != host.shape:
        return None
    return view


def _by_slot(slots: torch.Tensor, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray, tuple[tuple[int, int, int], ...]]:
    """Pairs sorted by host slot, and the ``(first_slot, offset, length)`` runs of consecutive slots."""
    order = np.argsort(slots.numpy(), kind="stable")
    slots_sorted, ids_sorted = slots.numpy()[order], ids.numpy()[order]
    return slots_sorted, ids_sorted, runs_of(run_starts(slots_sorted), slots_sorted)


class CudaTierCopier:
    """Enqueues validated batches on a CUDA copy stream (see the module docstring).

    Args:
        storage: A CUDA pool, with or without a host tier (pinned).
        zero_copy: Alias the host pool on the device for fragmented phases;
            ``False`` takes the DMA route for every phase.

    Attributes:
        zero_copy: Whether the host pool is aliased on the device, so that
            fragmented phases run as kernels; without it they take one DMA
            per run of slots and plane.
    """

    def __init__(self, storage: KVStorage, zero_copy: bool = True) -> None:
        self.storage = storage
        self.device = storage.device
        self._dev_rows = [row_view(cache) for cache in storage.kv_caches]
        host = storage.host
        self._host_rows = [] if host is None else [row_view(cache) for cache in host.kv_caches]
        views = [device_view(rows, self.device) for rows in self._host_rows] if zero_copy else []
        self._host_views = views if views and all(v is not None for v in views) else None
        self.zero_copy = self._host_views is not None

    def enqueue(self, batch: TierBatch, stream: torch.cuda.Stream) -> tuple[torch.cuda.Event, tuple[torch.Tensor, ...]]:
        """Enqueue the three phases of ``batch`` on ``stream`` after the current stream's work; record the fence.

        Returns:
            ``(fence, keepalive)``: the event recorded after phase (c) and the
            pinned and device index tensors the enqueued work reads, to keep
            referenced until the fence has been synchronized.
        """
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # writes issued before submit
        fence = torch.cuda.Event(blocking=True)  # the worker thread sleeps in synchronize(), no spinning
        keep: list[torch.Tensor] = []
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if batch.num_d2h:
                self._d2h(batch.d2h_src_ids, batch.d2h_dst_slots, keep)
            if batch.num_d2d:
                src, dst = self._upload(batch.d2d_src_ids, keep), self._upload(batch.d2d_dst_ids, keep)
                self.storage._copy_unchecked(src, dst)
            if batch.num_h2d:
                self._h2d(batch.h2d_src_slots, batch.h2d_dst_ids, keep)
            fence.record(stream)
        return fence, tuple(keep)

    def _upload(self, ids: torch.Tensor | np.ndarray, keep: list[torch.Tensor]) -> torch.Tensor:
        """CPU int64 ids to the device, from pinned memory, on the current (copy) stream."""
        pinned = torch.as_tensor(ids, dtype=torch.int64).pin_memory()
        on_device = pinned.to(self.device, non_blocking=True)
        keep += (pinned, on_device)
        return on_device

    def _d2h(self, src_ids: torch.Tensor, dst_slots: torch.Tensor, keep: list[torch.Tensor]) -> None:
        slots, ids, runs = _by_slot(dst_slots, src_ids)
        ids_dev = self._upload(ids, keep)
        if self._host_views is not None and len(runs) > DMA_MAX_RUNS:
            slots_dev = self._upload(slots, keep)
            for dev, view in zip(self._dev_rows, self._host_views, strict=True):
                view.index_copy_(1, slots_dev, dev.index_select(1, ids_dev))
            return
        for dev, host in zip(self._dev_rows, self._host_rows, strict=True):
            staged = dev.index_select(1, ids_dev)  # (2, m, row) on the device, in slot order
            for slot, offset, length in runs:
                for kv in (0, 1):  # one contiguous plane each: a plain DMA into pinned memory
                    host[kv, slot : slot + length].copy_(staged[kv, offset : offset + length], non_blocking=True)

    def _h2d(self, src_slots: torch.Tensor, dst_ids: torch.Tensor, keep: list[torch.Tensor]) -> None:
        slots, ids, runs = _by_slot(src_slots, dst_ids)
        ids_dev = self._upload(ids, keep)
        if self._host_views is not None and len(runs) > DMA_MAX_RUNS:
            slots_dev = self._upload(slots, keep)
            for dev, view in zip(self._dev_rows, self._host_views, strict=True):
                dev.index_copy_(1, ids_dev, view.index_select(1, slots_dev))
            return
        for dev, host in zip(self._dev_rows, self._host_rows, strict=True):
            staged = torch.empty((2, len(ids), dev.shape[2]), dtype=dev.dtype, device=self.device)
            for slot, offset, length in runs:
                for kv in (0, 1):  # a plain DMA from pinned memory
                    staged[kv, offset : offset + length].copy_(host[kv, slot : slot + length], non_blocking=True)
            dev.index_copy_(1, ids_dev, staged)
