"""Cross-tier copy batches: three phases (device→host, device→device, host→device), validated, run on the CPU.

A batch, as :meth:`akv.storage.CopyExecutor.submit_tiers` takes it, runs its
phases in this order, each phase's pairs all at once:

(a) ``d2h``: ``host[:, d2h_dst_slots[i]] = device[:, d2h_src_ids[i]]``
    (demotion, swap-out);
(b) ``d2d``: ``device[:, d2d_dst_ids[i]] = device[:, d2d_src_ids[i]]``
    (copy-on-write; :meth:`KVStorage.copy_blocks` semantics);
(c) ``h2d``: ``device[:, h2d_dst_ids[i]] = host[:, h2d_src_slots[i]]``
    (promotion, swap-in);

in every layer, K and V. Device ids lie in ``[0, num_blocks)`` (never the
null block), host slots in ``[0, host.num_blocks)``. Within a phase the
destinations are distinct, and in (b) no id is both source and destination,
so a phase's result does not depend on the order of its pairs. Across phases
ids may repeat, and the order is the point: a device block that (a) demotes
may be a destination of (c) in the same batch, which then overwrites it only
after (a) has read it.

:class:`TierCopier` runs batches on the CPU (the worker thread of the
executor): (a) and (c) through :mod:`akv.storage.row_copy` (one memory pass),
(b) through :meth:`KVStorage._copy_unchecked` as before. The CUDA path is
:mod:`akv.storage.tier_cuda`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from akv.errors import InvalidInput
from akv.storage.kv_pool import KVStorage
from akv.storage.row_copy import copy_rows, plan_row_copy
from akv.storage.tensor_args import IndexLike, ids_and_list, row_view


@dataclass(frozen=True, slots=True)
class TierBatch:
    """A validated cross-tier batch: each field a CPU int64 ``(m,)`` tensor, pairwise per phase.

    Attributes:
        d2h_src_ids: Phase (a) device block ids read.
        d2h_dst_slots: Phase (a) host slots written, distinct.
        d2d_src_ids: Phase (b) device block ids read.
        d2d_dst_ids: Phase (b) device block ids written, distinct, none a source.
        h2d_src_slots: Phase (c) host slots read.
        h2d_dst_ids: Phase (c) device block ids written, distinct.
    """

    d2h_src_ids: torch.Tensor
    d2h_dst_slots: torch.Tensor
    d2d_src_ids: torch.Tensor
    d2d_dst_ids: torch.Tensor
    h2d_src_slots: torch.Tensor
    h2d_dst_ids: torch.Tensor

    @property
    def num_d2h(self) -> int:
        """Pairs of phase (a)."""
        return self.d2h_src_ids.numel()

    @property
    def num_d2d(self) -> int:
        """Pairs of phase (b)."""
        return self.d2d_src_ids.numel()

    @property
    def num_h2d(self) -> int:
        """Pairs of phase (c)."""
        return self.h2d_src_slots.numel()

    @property
    def num_blocks(self) -> int:
        """Pairs of all three phases (blocks written)."""
        return self.num_d2h + self.num_d2d + self.num_h2d


def _length(ids: IndexLike, what: str) -> int:
    """``len(ids)``, or InvalidInput for something without a length."""
    try:
        return len(ids)
    except TypeError:
        raise InvalidInput(f"{what} must be a 1-D tensor or a sequence of ints, got {type(ids).__name__}") from None


def _pairs(storage: KVStorage, src: IndexLike, dst: IndexLike, phase: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Check one cross-tier phase: lengths, ranges, distinct destinations."""
    host = storage.host
    d2h = phase == "d2h"
    src_what, dst_what = ("d2h_src_ids", "d2h_dst_slots") if d2h else ("h2d_src_slots", "h2d_dst_ids")
    if host is None:
        if _length(src, src_what) or _length(dst, dst_what):
            raise InvalidInput(f"{src_what}/{dst_what} given but the storage has no host tier (num_host_blocks=0)")
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    src_limit, dst_limit = (storage.num_blocks, host.num_blocks) if d2h else (host.num_blocks, storage.num_blocks)
    src_t, dst_t = _ids(src, src_limit, src_what), _ids(dst, dst_limit, dst_what)
    if len(src_t) != len(dst_t):
        raise InvalidInput(f"{src_what} has {len(src_t)} ids but {dst_what} has {len(dst_t)}")
    n = len(dst_t)
    if n > 1 and (len(set(dst_t.tolist())) if n <= _NUMPY_MIN else len(np.unique(dst_t.numpy()))) != n:
        raise InvalidInput(f"{dst_what} contains duplicates: {dst_t.tolist()}")
    return src_t, dst_t


def _ids(ids: IndexLike, limit: int, what: str) -> torch.Tensor:
    """``ids`` as a CPU int64 tensor of its own, each in ``[0, limit)``, or InvalidInput.

    A long list of ints (a demotion batch: thousands) is checked with numpy,
    about 20x faster than :func:`~akv.storage.tensor_args.ids_and_list`'s
    Python ints; anything else (tensors, short or mixed lists) takes that path.
    """
    if type(ids) is list and len(ids) > _NUMPY_MIN:
        arr = np.array(ids)  # Python ints give int64; floats, bools or huge ints another dtype
        if arr.ndim == 1 and arr.dtype.kind == "i":
            arr = arr.astype(np.int64, copy=False)
            if arr.min() < 0 or arr.max() >= limit:
                raise InvalidInput(f"{what} out of range: min {arr.min()}, max {arr.max()}, must lie in [0, {limit})")
            return torch.from_numpy(arr)
    return ids_and_list(ids, limit, what)[0]


#: From this many ids on, a phase's ids are checked with numpy.
_NUMPY_MIN = 32


def check_tier_batch(
    storage: KVStorage,
    *,
    d2h_src_ids: IndexLike = (),
    d2h_dst_slots: IndexLike = (),
    d2d_src_ids: IndexLike = (),
    d2d_dst_ids: IndexLike = (),
    h2d_src_slots: IndexLike = (),
    h2d_dst_ids: IndexLike = (),
) -> TierBatch:
    """Validate a three-phase batch against ``storage`` (and its host tier) without touching a tensor.

    Args:
        storage: The device pool; ``storage.host`` is the host tier.
        d2h_src_ids, d2h_dst_slots: Phase (a) pairs: ``(a,)`` device ids and
            ``(a,)`` host slots (int32/int64 tensors or sequences of ints).
        d2d_src_ids, d2d_dst_ids: Phase (b) pairs: ``(b,)`` device ids each.
        h2d_src_slots, h2d_dst_ids: Phase (c) pairs: ``(c,)`` host slots and
            ``(c,)`` device ids.

    Returns:
        The batch as CPU int64 tensors.

    Raises:
        InvalidInput: A phase's lengths differ; a device id is outside
            ``[0, num_blocks)`` (the null block is never copied) or a host
            slot outside ``[0, host.num_blocks)``; a phase's destinations
            repeat; an id of (b) is both source and destination; host pairs
            are given without a host tier. Costs O(a + b + c) Python ints.
    """
    d2h = _pairs(storage, d2h_src_ids, d2h_dst_slots, "d2h")
    d2d = storage.check_copy_ids(d2d_src_ids, d2d_dst_ids)
    h2d = _pairs(storage, h2d_src_slots, h2d_dst_ids, "h2d")
    return TierBatch(*d2h, *d2d, *h2d)


def own_tier_batch(storage: KVStorage, *phases: list[int] | np.ndarray) -> TierBatch:
    """A batch of the manager's own copies: six lists of ints (or int64 arrays), range-checked, not searched for repeats.

    The pool shards build their batches from their block states, where
    distinct destinations hold by construction (``check()`` and the state
    machines verify the states); :func:`check_tier_batch`'s repeat search
    (a sort per phase) would cost more than the bookkeeping it checks.

    Args:
        storage: The pools the ids index.
        phases: ``d2h_src_ids, d2h_dst_slots, d2d_src_ids, d2d_dst_ids,
            h2d_src_slots, h2d_dst_ids``, pairwise of equal length.

    Raises:
        InvalidInput: Lengths differ or an id is out of range (a bug in the
            caller: nothing is queued).
    """
    host_blocks = 0 if storage.host is None else storage.host.num_blocks
    limits = (storage.num_blocks, host_blocks, storage.num_blocks, storage.num_blocks, host_blocks, storage.num_blocks)
    arrays = []
    for ids, limit in zip(phases, limits, strict=True):
        arr = np.asarray(ids, dtype=np.int64)  # an int64 array is taken as it is (the caller made it for this batch)
        if len(arr) and (arr.min() < 0 or arr.max() >= limit):
            raise InvalidInput(f"copy ids out of range: min {arr.min()}, max {arr.max()}, must lie in [0, {limit})")
        arrays.append(arr)
    for src, dst in zip(arrays[::2], arrays[1::2]):
        if len(src) != len(dst):
            raise InvalidInput(f"a copy phase has {len(src)} sources but {len(dst)} destinations")
    return TierBatch(*map(torch.from_numpy, arrays))


def tier_batch_sizes(**phases: IndexLike) -> tuple[int, int, int]:
    """Metadata mode's only check: each phase's two lengths agree.

    Args:
        phases: The six keyword arguments of :func:`check_tier_batch`.

    Returns:
        ``(a, b, c)``: pairs per phase.

    Raises:
        InvalidInput: A phase's lengths differ.
    """
    sizes = []
    for src, dst in (
        ("d2h_src_ids", "d2h_dst_slots"),
        ("d2d_src_ids", "d2d_dst_ids"),
        ("h2d_src_slots", "h2d_dst_ids"),
    ):
        n_src, n_dst = _length(phases.get(src, ()), src), _length(phases.get(dst, ()), dst)
        if n_src != n_dst:
            raise InvalidInput(f"{src} has {n_src} ids but {dst} has {n_dst}")
        sizes.append(n_src)
    return sizes[0], sizes[1], sizes[2]


class TierCopier:
    """Runs validated batches on the CPU, on the calling thread (the executor's worker).

    Holds the row views (:func:`~akv.storage.tensor_args.row_view`) of both
    pools, made once. Phases (a) and (c) plan once per batch
    (:func:`~akv.storage.row_copy.plan_row_copy`, O(m log m)) and run the plan
    in every layer; phase (b) is :meth:`KVStorage._copy_unchecked`.

    Args:
        storage: A CPU pool, with or without a host tier.
    """

    def __init__(self, storage: KVStorage) -> None:
        self.storage = storage
        self._dev_rows = [row_view(cache) for cache in storage.kv_caches]
        host = storage.host
        self._host_rows = [] if host is None else [row_view(cache) for cache in host.kv_caches]
        self._row_bytes = self._dev_rows[0].shape[2] * self._dev_rows[0].element_size()

    def run(self, batch: TierBatch) -> None:
        """Copy phases (a), (b), (c) of ``batch`` in order, every layer, K and V."""
        if batch.num_d2h:
            plan = plan_row_copy(batch.d2h_dst_slots.numpy(), batch.d2h_src_ids.numpy(), self._row_bytes)
            for dev, host in zip(self._dev_rows, self._host_rows, strict=True):
                copy_rows(host, dev, plan)
        if batch.num_d2d:
            self.storage._copy_unchecked(batch.d2d_src_ids, batch.d2d_dst_ids)
        if batch.num_h2d:
            plan = plan_row_copy(batch.h2d_dst_ids.numpy(), batch.h2d_src_slots.numpy(), self._row_bytes)
            for dev, host in zip(self._dev_rows, self._host_rows, strict=True):
                copy_rows(dev, host, plan)
