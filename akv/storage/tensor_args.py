"""Argument checks and byte views shared by the storage modules: dtype names, index tensors, ranges.

Everything here raises :class:`~akv.errors.InvalidInput` for bad caller input
and touches no tensor data. :func:`raw_bytes` and :func:`row_view` give the
bytewise views the copies run on (a copy of K/V never converts values, so it
may move them as bytes, or as the widest integer that divides a row).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from akv.errors import InvalidInput

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

#: Block ids or host slots: a 1-D int32/int64 tensor or a sequence of ints.
IndexLike = torch.Tensor | Sequence[int]

# Widest integer dtype first: a row of n bytes is viewed as n / itemsize elements of it.
_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def torch_dtype(name: str) -> torch.dtype:
    """Resolve a dtype name from :class:`akv.config.ModelShape` to a torch dtype.

    Args:
        name: ``float32``, ``float16``, ``bfloat16`` or ``float8_e4m3fn``.

    Returns:
        The matching ``torch.dtype``.

    Raises:
        InvalidInput: Unknown name; the message lists the known ones.
    """
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise InvalidInput(f"unknown dtype {name!r}; known: {', '.join(_TORCH_DTYPES)}") from None


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """View float8 as uint8 (CPU ``index_copy_`` has no float8 kernel); copies are bytewise anyway."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def row_view(cache: torch.Tensor) -> torch.Tensor:
    """View a contiguous layer tensor as ``(2, n, row)`` of the widest integer dtype dividing a row.

    A row is one block's K (or V) plane of one layer, ``block_size *
    num_kv_heads * head_dim`` elements, contiguous in the layout
    ``(2, n, block_size, num_kv_heads, head_dim)``. Copying int64 words
    instead of bf16 elements moves the same bytes with a quarter of the
    elements (CUDA index kernels spend one thread per element).

    Args:
        cache: ``(2, n, block_size, num_kv_heads, head_dim)``, contiguous, any dtype.

    Returns:
        ``(2, n, row_bytes / itemsize)``, sharing ``cache``'s memory.
    """
    row_bytes = cache[0, 0].numel() * cache.element_size()
    as_bytes = cache.view(torch.uint8) if cache.element_size() > 1 else raw_bytes(cache)
    for dtype in _WIDE_DTYPES:
        size = dtype.itemsize
        if row_bytes % size == 0 and (as_bytes.data_ptr() % size == 0):
            return as_bytes.view(cache.shape[0], cache.shape[1], row_bytes).view(dtype)
    raise AssertionError("unreachable: uint8 divides every row")


def index_tensor(ids: IndexLike, what: str) -> torch.Tensor:
    """Return ``ids`` as a 1-D int64 tensor (on its own device), or raise InvalidInput."""
    if not isinstance(ids, torch.Tensor):
        return torch.tensor(index_list(ids, what), dtype=torch.int64)
    if ids.dtype not in (torch.int32, torch.int64):
        raise InvalidInput(f"{what} must have dtype int32 or int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidInput(f"{what} must be 1-D, got shape {tuple(ids.shape)}")
    return ids.to(torch.int64)


def index_list(ids: Sequence[int], what: str) -> list[int]:
    """Return a sequence of ints as a list of Python ints, or raise InvalidInput."""
    try:
        return [operator.index(i) for i in ids]
    except TypeError as exc:
        raise InvalidInput(f"{what} must be ints (int32 or int64 tensor or a sequence of ints): {exc}") from None


def check_range(ids: torch.Tensor, limit: int, what: str) -> None:
    """Raise InvalidInput unless every id lies in ``[0, limit)`` (host sync if on a device)."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= limit:
        raise InvalidInput(f"{what} out of range: min {lo}, max {hi}, must lie in [0, {limit})")


def ids_and_list(ids: IndexLike, limit: int, what: str) -> tuple[torch.Tensor, list[int]]:
    """``ids`` as a contiguous CPU int64 tensor of its own and a list of ints, each in ``[0, limit)``.

    The tensor never shares memory with a tensor the caller passed: a queued
    copy reads it later, on the worker thread, and must see the ids that were
    validated, whatever the caller does with its tensor after ``submit``.
    Checked on Python ints: a copy batch is small (CoW: a few blocks per step)
    and ``min``/``max``/set arithmetic cost microseconds where ``torch.unique``
    or ``isin`` cost tens of them; submit runs on the event loop.

    Raises:
        InvalidInput: Not ints, not 1-D, or an id outside ``[0, limit)``.
    """
    if isinstance(ids, torch.Tensor):
        tensor = index_tensor(ids, what).cpu().clone(memory_format=torch.contiguous_format)
        values = tensor.tolist()
    else:
        values = index_list(ids, what)
        tensor = torch.tensor(values, dtype=torch.int64)
    if values and (min(values) < 0 or max(values) >= limit):
        raise InvalidInput(f"{what} out of range: min {min(values)}, max {max(values)}, must lie in [0, {limit})")
    return tensor, values
