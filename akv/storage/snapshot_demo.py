"""Snapshots without a manager: a random but valid record, a reader over tensors, a demo writer.

For tests, benchmarks and ``akv snapshot demo``; the manager builds its record
from its prefix tree instead.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from akv.config import KVCacheConfig
from akv.core.block_key import KEY_BYTES
from akv.errors import InvalidInput
from akv.storage.kv_pool import torch_dtype
from akv.storage.snapshot_dir import ReadBlocks, save_snapshot
from akv.storage.snapshot_record import SnapshotBlocks

#: The namespaces :func:`demo_blocks` draws from: one of each kind of plain value.
DEMO_NAMESPACES: tuple[Hashable, ...] = (None, ("lora", 7), b"\x00tenant", "ns-\u00e9", -(2**70))


def demo_blocks(
    num_blocks: int,
    *,
    block_size: int,
    vocab_size: int,
    seed: int = 0,
    namespaces: Sequence[Hashable] = DEMO_NAMESPACES,
) -> SnapshotBlocks:
    """A random forest of ``num_blocks`` blocks with correct keys and tree-like statistics.

    Each block starts a new prompt (probability 0.2) in a random namespace or
    continues one of the 8 blocks before it, in its namespace; hits and
    release stamps are then raised so that no parent is colder than a child,
    as in a real prefix tree.

    Args:
        num_blocks: Blocks (>= 0).
        block_size: Tokens per block.
        vocab_size: Token ids are drawn from ``[0, vocab_size)``.
        seed: Seed of the numpy generator.
        namespaces: The namespace table (at least one plain value or ``None``).

    Returns:
        A record that passes :meth:`SnapshotBlocks.check`.

    Raises:
        InvalidInput: A bad count or an empty namespace table.
    """
    if type(num_blocks) is not int or num_blocks < 0 or not namespaces:
        raise InvalidInput("num_blocks must be an int >= 0 and namespaces not empty")
    rng = np.random.default_rng(seed)
    parent = np.full(num_blocks, -1, dtype=np.int64)
    namespace = rng.integers(0, len(namespaces), num_blocks).astype(np.int32)
    for row in range(1, num_blocks):
        if rng.random() >= 0.2:
            parent[row] = rng.integers(max(0, row - 8), row)
            namespace[row] = namespace[parent[row]]
    num_hits = rng.integers(0, 4, num_blocks).astype(np.int64)
    last_release = rng.permutation(num_blocks).astype(np.int64)
    for row in range(num_blocks - 1, -1, -1):
        up = parent[row]
        if up >= 0:
            num_hits[up] = max(num_hits[up], num_hits[row])
            last_release[up] = max(last_release[up], last_release[row] + 1)
    draft = SnapshotBlocks(
        block_size=block_size,
        namespaces=tuple(namespaces),
        keys=np.zeros((num_blocks, KEY_BYTES), dtype=np.uint8),
        parent=parent,
        namespace=namespace,
        tokens=rng.integers(0, vocab_size, (num_blocks, block_size)).astype(np.int32),
        num_hits=num_hits,
        last_release=last_release,
        medium=np.zeros(num_blocks, dtype=np.uint8),
    )
    return SnapshotBlocks(
        **{name: getattr(draft, name) for name in SnapshotBlocks.__slots__ if name != "keys"},
        keys=draft.recompute_keys(),
    )


def tensor_reader(kv_caches: Sequence[torch.Tensor], block_ids: np.ndarray) -> ReadBlocks:
    """A ``read_blocks`` over per-layer pool tensors: record row ``i`` is block ``block_ids[i]``.

    Args:
        kv_caches: One tensor per layer, ``(2, num_blocks, block_size,
            num_kv_heads, head_dim)``, K then V.
        block_ids: ``(n,)`` int64 block id of each record row.

    Returns:
        ``read_blocks(layer, rows)``: a gathered copy ``(2, len(rows), ...)``.
    """
    ids = torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64))

    def read_blocks(layer: int, rows: np.ndarray) -> torch.Tensor:
        cache = kv_caches[layer]
        return cache.index_select(1, ids[torch.from_numpy(rows)].to(cache.device))

    return read_blocks


def demo_layers(config: KVCacheConfig, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """Random K/V for ``num_blocks`` blocks, one CPU tensor per layer of ``config.model``.

    Returns:
        ``num_layers`` tensors ``(2, num_blocks, block_size, num_kv_heads,
        head_dim)`` of the model's dtype, standard normal values.
    """
    generator = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, config.block_size, config.model.num_kv_heads, config.model.head_dim)
    dtype = torch_dtype(config.model.dtype)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(config.model.num_layers)]


def save_demo_snapshot(directory: str | os.PathLike, config: KVCacheConfig, num_blocks: int, seed: int = 0) -> int:
    """Save a random snapshot of ``num_blocks`` blocks (with K/V when ``config.storage == "tensors"``).

    Args:
        directory: The snapshot directory.
        config: Fingerprint, block size, vocabulary and storage mode.
        num_blocks: Blocks.
        seed: Seed of the record and the tensors.

    Returns:
        The generation written.

    Raises:
        InvalidInput: A bad count.
        SnapshotError: cause ``"io"``.
    """
    blocks = demo_blocks(num_blocks, block_size=config.block_size, vocab_size=config.vocab_size, seed=seed)
    reader = None
    if config.storage == "tensors":
        reader = tensor_reader(demo_layers(config, num_blocks, seed), np.arange(num_blocks, dtype=np.int64))
    return save_snapshot(directory, config, blocks, reader)
