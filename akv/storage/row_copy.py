"""Bytewise block copies between two CPU layer tensors in one memory pass: a plan per batch, run per layer.

A cross-tier copy moves whole blocks between the device pool and the host pool
(``(2, n, block_size, num_kv_heads, head_dim)`` per layer, K then V; see
:mod:`akv.storage.kv_pool` and :mod:`akv.storage.host_pool`). On the CPU the
obvious ``dst.index_copy_(1, dst_ids, src.index_select(1, src_ids))`` moves
every byte twice, and CPU ``index_copy_`` / ``index_put_`` are elementwise
kernels (about 6 GB/s on one core of the 2-core VM where ``slice.copy_``
does 25-40 GB/s). Fast single-pass primitives exist for three shapes of batch:

- ``runs``: pairs whose source and destination both advance by one form a run,
  copied as one slice (numpy's ``dst[:, d:d+k] = src[:, s:s+k]``, a memcpy
  that costs about 1.5 µs per call where ``torch.Tensor.copy_`` costs 4);
- ``gather``: destinations sorted into consecutive runs, each plane (K, V)
  filled with ``np.take(src[p], src_ids, axis=0, out=dst[p, d:d+k])``
  (memcpy per row, no temporary; 1.5-2.5x torch's ``index_select`` here);
- ``scatter``: sources sorted into consecutive runs, each written with numpy's
  fancy assignment ``dst[:, dst_ids] = src[:, s:s+k]`` (memcpy per row; numpy
  releases the GIL);
- ``chunked``: anything else: gather :data:`CHUNK_BYTES` at a time into a
  buffer that stays in the L2 cache, then scatter it, so memory sees one pass.

:func:`plan_row_copy` picks the kind with the lowest estimated cost per layer
(calls times :data:`CALL_COST_US`, plus the ``chunked`` buffer's pass; ties in
the order above); the plan depends on the ids only, so one plan serves every
layer. The module needs numpy only (no torch): the copy process
(:mod:`akv.storage.copy_child`) runs it on shared memory. Measured in
``stress/bench_tier_copy.py`` (docs/host_tier.md, "Copy throughput").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Bytes gathered per step of a ``chunked`` copy: half of one core's L2 on the
#: reference VM, so the scatter reads the buffer from cache.
CHUNK_BYTES = 512 * 1024

#: The plan kinds, in the order ties are broken.
KINDS = ("runs", "gather", "scatter", "chunked")

#: Estimated overhead of one call of each kind, in µs (a ``chunked`` step is two
#: calls), measured on the 2-core VM with ``stress/bench_tier_copy.py``'s
#: shapes: numpy slice assignment 1.5, numpy fancy assignment 3, ``np.take``
#: into both planes 4. The bytes themselves cost the same in every kind, except
#: the ``chunked`` buffer's second pass (:data:`BUFFER_BYTES_PER_US`).
CALL_COST_US = {"runs": 1.5, "gather": 4.0, "scatter": 3.0, "chunked": 7.0}

#: Bytes per µs of the ``chunked`` kind's extra pass through its L2-resident
#: buffer (20 GB/s, measured as above).
BUFFER_BYTES_PER_US = 20_000


@dataclass(frozen=True, slots=True)
class RowCopyPlan:
    """How to copy ``m`` rows ``dst[:, dst_ids[i]] = src[:, src_ids[i]]`` in one pass.

    Attributes:
        kind: ``"runs"``, ``"gather"``, ``"scatter"`` or ``"chunked"`` (see the
            module docstring).
        num_pairs: ``m``.
        runs: ``(dst_start, src_start, length)`` slices for ``runs``;
            ``(dst_start, offset, length)`` into :attr:`src_ids` for
            ``gather``; ``(src_start, offset, length)`` into :attr:`dst_ids`
            for ``scatter``; empty for ``chunked``.
        src_ids: ``(m,)`` int64 numpy array of source rows in the plan's order
            (by destination for ``gather`` and ``chunked``).
        dst_ids: ``(m,)`` int64 numpy array of destination rows in the plan's
            order (by source for ``scatter``, by destination for ``chunked``).
        chunk_rows: Pairs per step of a ``chunked`` copy.
    """

    kind: str
    num_pairs: int
    runs: tuple[tuple[int, int, int], ...]
    src_ids: np.ndarray
    dst_ids: np.ndarray
    chunk_rows: int


def run_starts(*sorted_ids: np.ndarray) -> np.ndarray:
    """Indices where a run of +1 steps (in every array at once) starts.

    Args:
        sorted_ids: One or more ``(m,)`` int64 arrays, ``m >= 1``, in the order
            the pairs will be copied.

    Returns:
        Ascending int64 indices, the first 0: a run ends where any array does
        not advance by exactly one.
    """
    steps = np.diff(sorted_ids[0]) == 1
    for ids in sorted_ids[1:]:
        steps &= np.diff(ids) == 1
    return _starts(steps)


def _starts(steps: np.ndarray) -> np.ndarray:
    """Run starts from the ``(m - 1,)`` booleans "pair i + 1 continues pair i's run"."""
    return np.flatnonzero(np.concatenate(([False], steps)) == 0)


def runs_of(
    starts: np.ndarray, first: np.ndarray, second: np.ndarray | None = None
) -> tuple[tuple[int, int, int], ...]:
    """Runs as ``(first[start], second[start] or start, length)`` for each start of :func:`run_starts`."""
    begin = starts.tolist()
    lengths = np.diff(starts, append=len(first)).tolist()
    other = begin if second is None else second[starts].tolist()
    return tuple(zip(first[starts].tolist(), other, lengths))


def plan_row_copy(dst_ids: np.ndarray, src_ids: np.ndarray, row_bytes: int, kind: str | None = None) -> RowCopyPlan:
    """Plan ``dst[:, dst_ids[i]] = src[:, src_ids[i]]`` for every ``i``, cheapest kind per layer.

    Args:
        dst_ids: ``(m,)`` int64 destination rows, pairwise distinct (checked by
            the caller; a repeated destination would make the result depend
            on the kind).
        src_ids: ``(m,)`` int64 source rows (repeats allowed).
        row_bytes: Bytes of one row of one plane (K or V), for the chunk size.
        kind: Force a kind (tests and benchmarks); ``None`` picks the cheapest.

    Returns:
        The plan. Costs O(m log m) (two stable sorts).

    Raises:
        ValueError: ``kind`` is not one of the four.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown row copy kind {kind!r}; known: {', '.join(KINDS)}")
    m = len(dst_ids)
    chunk_rows = max(1, CHUNK_BYTES // (2 * row_bytes))
    if m == 0:
        return RowCopyPlan(kind or "runs", 0, (), np.empty(0, dtype=np.int64), dst_ids, chunk_rows)
    if kind in (None, "runs") and (m == 1 or (np.all(np.diff(dst_ids) == 1) and np.all(np.diff(src_ids) == 1))):
        run = ((int(dst_ids[0]), int(src_ids[0]), m),)  # one run in the given order: no sort needed
        return RowCopyPlan("runs", m, run, np.ascontiguousarray(src_ids), dst_ids, chunk_rows)
    by_dst = np.argsort(dst_ids, kind="stable")
    d_sorted, s_by_d = dst_ids[by_dst], src_ids[by_dst]
    by_src = np.argsort(src_ids, kind="stable")
    s_sorted, d_by_s = src_ids[by_src], dst_ids[by_src]
    d_steps = np.diff(d_sorted) == 1
    gather = _starts(d_steps)
    both = _starts(d_steps & (np.diff(s_by_d) == 1))
    scatter = run_starts(s_sorted)
    calls = (len(both), len(gather), len(scatter), -(-m // chunk_rows))
    costs = [n * CALL_COST_US[k] for k, n in zip(KINDS, calls)]
    costs[3] += 2 * m * row_bytes / BUFFER_BYTES_PER_US
    if kind is None:
        kind = KINDS[costs.index(min(costs))]
    if kind == "runs":
        runs = runs_of(both, d_sorted, s_by_d)
    elif kind == "gather":
        runs = runs_of(gather, d_sorted)
    elif kind == "scatter":
        return RowCopyPlan(kind, m, runs_of(scatter, s_sorted), s_sorted, d_by_s, chunk_rows)
    else:
        runs = ()
    return RowCopyPlan(kind, m, runs, np.ascontiguousarray(s_by_d), d_sorted, chunk_rows)


def copy_rows(dst: Any, src: Any, plan: RowCopyPlan) -> None:
    """Run a plan on one layer: ``dst[:, d] = src[:, s]`` for each planned pair.

    Args:
        dst: ``(2, n_dst, row)`` numpy array, or CPU tensor (viewed through
            ``np.asarray``, no copy), e.g. a :func:`~akv.storage.tensor_args.row_view`.
        src: ``(2, n_src, row)``, the same dtype and row length; a different
            array from ``dst`` (numpy would copy an overlapping source first,
            but the plans assume no overlap).
    """
    kind = plan.kind
    dst_np, src_np = np.asarray(dst), np.asarray(src)
    if kind == "runs":
        for d, s, k in plan.runs:
            dst_np[:, d : d + k] = src_np[:, s : s + k]
    elif kind == "gather":
        ids = plan.src_ids
        for d, i, k in plan.runs:
            np.take(src_np[0], ids[i : i + k], axis=0, out=dst_np[0, d : d + k], mode="clip")
            np.take(src_np[1], ids[i : i + k], axis=0, out=dst_np[1, d : d + k], mode="clip")
    elif kind == "scatter":
        for s, i, k in plan.runs:
            dst_np[:, plan.dst_ids[i : i + k]] = src_np[:, s : s + k]
    elif plan.num_pairs:
        step = plan.chunk_rows
        buf = np.empty((2, min(step, plan.num_pairs), src_np.shape[2]), dtype=src_np.dtype)
        for i in range(0, plan.num_pairs, step):
            k = min(step, plan.num_pairs - i)
            ids = plan.src_ids[i : i + k]
            np.take(src_np[0], ids, axis=0, out=buf[0, :k], mode="clip")
            np.take(src_np[1], ids, axis=0, out=buf[1, :k], mode="clip")
            dst_np[:, plan.dst_ids[i : i + k]] = buf[:, :k]
