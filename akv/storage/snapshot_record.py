"""What a snapshot holds, independent of how the prefix tree stores it.

A :class:`SnapshotBlocks` is a column store of ``n`` saved full blocks in
topological order (every parent before its children), one row per block:

- ``keys`` ``(n, 16)`` uint8: the content keys of :mod:`akv.core.block_key`
  (xxh3_128, chained from the parent's key);
- ``parent`` ``(n,)`` int64: the row of the block's parent, ``-1`` for the
  first block of a prompt (a child of the tree's root);
- ``namespace`` ``(n,)`` int32: the row in ``namespaces``, a table of plain
  values (:mod:`akv.core.ids`);
- ``tokens`` ``(n, block_size)`` int32: the block's token ids;
- ``num_hits`` and ``last_release`` ``(n,)`` int64: the eviction statistics
  of :mod:`akv.core.eviction_policy`, so that a smaller pool keeps the hottest
  blocks (:func:`hottest_that_fit`);
- ``medium`` ``(n,)`` uint8: where the block lived, :data:`MEDIUM_DEVICE` or
  :data:`MEDIUM_HOST`.

The K/V of the blocks travel beside the record (one tensor per layer, see
:mod:`akv.storage.snapshot_dir`). Keys are not trusted: :meth:`SnapshotBlocks.check`
recomputes every key from its parent's key, tokens and namespace.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from akv.core.block_key import KEY_BYTES, block_key_raw, chain_suffix
from akv.core.eviction_policy import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES, KeyFunction
from akv.core.ids import MAX_ID_DEPTH, plain_id
from akv.errors import InvalidInput

#: ``medium`` of a block saved from the device pool.
MEDIUM_DEVICE = 0
#: ``medium`` of a block saved from the host tier.
MEDIUM_HOST = 1

#: Column name -> (numpy dtype, trailing shape as a function of block_size).
COLUMNS: dict[str, tuple[np.dtype, object]] = {  # 8-byte columns first: every column starts aligned
    "keys": (np.dtype(np.uint8), lambda bs: (KEY_BYTES,)),
    "parent": (np.dtype(np.int64), lambda bs: ()),
    "num_hits": (np.dtype(np.int64), lambda bs: ()),
    "last_release": (np.dtype(np.int64), lambda bs: ()),
    "namespace": (np.dtype(np.int32), lambda bs: ()),
    "tokens": (np.dtype(np.int32), lambda bs: (bs,)),
    "medium": (np.dtype(np.uint8), lambda bs: ()),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotBlocks:
    """The saved blocks of a snapshot, as numpy columns (see the module docstring for shapes and dtypes).

    Args:
        block_size: Tokens per block (>= 1).
        namespaces: The namespace table: plain values or ``None``.
        keys: ``(n, 16)`` uint8.
        parent: ``(n,)`` int64, ``-1`` or a smaller row.
        namespace: ``(n,)`` int32 rows of ``namespaces``.
        tokens: ``(n, block_size)`` int32.
        num_hits: ``(n,)`` int64, >= 0.
        last_release: ``(n,)`` int64, >= 0.
        medium: ``(n,)`` uint8, :data:`MEDIUM_DEVICE` or :data:`MEDIUM_HOST`.

    Raises:
        InvalidInput: A column of the wrong type, dtype or shape, or a
            namespace that is not a plain value. Contents are checked by
            :meth:`check`.
    """

    block_size: int
    namespaces: tuple[Hashable, ...]
    keys: np.ndarray
    parent: np.ndarray
    namespace: np.ndarray
    tokens: np.ndarray
    num_hits: np.ndarray
    last_release: np.ndarray
    medium: np.ndarray

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size < 1:
            raise InvalidInput(f"block_size must be an int >= 1, got {self.block_size!r}")
        if type(self.namespaces) is not tuple:
            raise InvalidInput(f"namespaces must be a tuple, got {type(self.namespaces).__name__}")
        object.__setattr__(
            self, "namespaces", tuple(plain_id(ns, "a snapshot namespace", allow_none=True) for ns in self.namespaces)
        )
        n = None
        for name, (dtype, trailing) in COLUMNS.items():
            column = getattr(self, name)
            if type(column) is not np.ndarray or column.dtype != dtype:
                raise InvalidInput(f"column {name} must be a numpy array of {dtype}, got {_describe_column(column)}")
            n = column.shape[0] if n is None and column.ndim else n
            if column.shape != (n, *trailing(self.block_size)):
                raise InvalidInput(
                    f"column {name} has shape {column.shape}, expected {(n, *trailing(self.block_size))}"
                )

    @property
    def num_blocks(self) -> int:
        """Saved blocks (``n``)."""
        return int(self.parent.shape[0])

    def check(self, vocab_size: int) -> str | None:
        """Check the contents: topological order, parents, namespaces, tokens, statistics, every key.

        ``O(n * block_size)``; the key check hashes each block once (about
        9 µs a block).

        Args:
            vocab_size: Token ids must lie in ``[0, vocab_size)``.

        Returns:
            ``None`` when consistent, else what is wrong (the first problem found).
        """
        n = self.num_blocks
        rows = np.arange(n, dtype=np.int64)
        bad = np.flatnonzero((self.parent < -1) | (self.parent >= rows))
        if bad.size:
            return f"block {bad[0]} has parent {self.parent[bad[0]]}: not -1 nor an earlier block"
        bad = np.flatnonzero((self.namespace < 0) | (self.namespace >= len(self.namespaces)))
        if bad.size:
            return f"block {bad[0]} has namespace row {self.namespace[bad[0]]} of a table of {len(self.namespaces)}"
        child = np.flatnonzero(self.parent >= 0)
        bad = child[self.namespace[child] != self.namespace[self.parent[child]]]
        if bad.size:
            return f"block {bad[0]} is not in its parent's namespace"
        if self.tokens.size and (self.tokens.min() < 0 or self.tokens.max() >= vocab_size):
            return f"a token id lies outside [0, {vocab_size})"
        for name in ("num_hits", "last_release"):
            if n and getattr(self, name).min() < 0:
                return f"a block has a negative {name}"
        if n and self.medium.max() > MEDIUM_HOST:
            return f"a block has medium {self.medium.max()} (0 device, 1 host)"
        keys = self.recompute_keys()
        bad = np.flatnonzero((keys != self.keys).any(axis=1))
        if bad.size:
            return f"block {bad[0]}'s key does not match its parent, tokens and namespace"
        return None

    def recompute_keys(self) -> np.ndarray:
        """Every block's key from its parent's recomputed key, its tokens and namespace.

        Only valid after the parent and namespace checks of :meth:`check`.

        Returns:
            ``(n, 16)`` uint8.
        """
        keys: list[bytes] = []
        parents = self.parent.tolist()
        suffixes = [chain_suffix(ns) for ns in self.namespaces]
        spaces = [suffixes[i] for i in self.namespace.tolist()]
        raw = np.ascontiguousarray(self.tokens, dtype="<i4").tobytes()
        width = 4 * self.tokens.shape[1] if self.tokens.ndim == 2 else 0
        for row in range(self.num_blocks):
            parent = parents[row]
            block = raw[row * width : (row + 1) * width]
            keys.append(block_key_raw(None if parent < 0 else keys[parent], block, spaces[row]))
        return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(self.num_blocks, KEY_BYTES)

    def take(self, rows: np.ndarray) -> SnapshotBlocks:
        """The record of a subset of blocks, parents renumbered.

        Args:
            rows: ``(m,)`` int64, increasing, ancestor-closed (every kept
                block's parent kept), e.g. the first result of :func:`hottest_that_fit`.

        Returns:
            A record of ``m`` blocks in the same order.

        Raises:
            InvalidInput: ``rows`` is not increasing, or not ancestor-closed.
        """
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and ((np.diff(rows) <= 0).any() or rows[0] < 0 or rows[-1] >= self.num_blocks):
            raise InvalidInput("rows must be increasing block rows of this record")
        new_row = np.full(self.num_blocks + 1, -1, dtype=np.int64)  # the extra last entry maps parent -1 to -1
        new_row[rows] = np.arange(rows.size, dtype=np.int64)
        old_parent = self.parent[rows]
        parent = new_row[old_parent]
        if ((parent < 0) & (old_parent >= 0)).any():
            raise InvalidInput("rows must be ancestor-closed: a kept block's parent is dropped")
        columns = {name: getattr(self, name)[rows] for name in COLUMNS}
        columns["parent"] = parent
        return SnapshotBlocks(block_size=self.block_size, namespaces=self.namespaces, **columns)


def _describe_column(column: object) -> str:
    if type(column) is np.ndarray:
        return f"an array of {column.dtype} {column.shape}"
    return type(column).__name__


def hottest_that_fit(
    blocks: SnapshotBlocks,
    max_blocks: int,
    key: KeyFunction = EVICTION_POLICIES[DEFAULT_EVICTION_POLICY].key,
) -> tuple[np.ndarray, int]:
    """The blocks a pool of ``max_blocks`` keeps: evict the coldest leaf until the rest fit.

    This is the prefix tree's own eviction replayed on the saved statistics:
    only a block with no kept child is ever dropped, the one with the smallest
    ``key(num_hits, last_release)`` first (ties: the later row first), so the
    kept set is ancestor-closed. When every parent's key is at least its
    children's (true of blocks saved from one tree, see
    :mod:`akv.core.eviction_policy`), the kept set is exactly the top
    ``max_blocks`` of the saved eviction order.

    ``O(n log n)``.

    Args:
        blocks: The saved blocks.
        max_blocks: Blocks that fit (an int >= 0).
        key: The eviction policy's key function (default: the default policy's).

    Returns:
        ``(rows, num_dropped)``: the kept rows as increasing int64 ``(m,)``,
        ``m = min(n, max_blocks)``, and ``n - m``.

    Raises:
        InvalidInput: ``max_blocks`` is not an int >= 0.
    """
    if type(max_blocks) is not int or max_blocks < 0:
        raise InvalidInput(f"max_blocks must be an int >= 0, got {max_blocks!r}")
    n = blocks.num_blocks
    num_dropped = max(0, n - max_blocks)
    if num_dropped == 0:
        return np.arange(n, dtype=np.int64), 0
    parents = blocks.parent.tolist()
    hits, releases = blocks.num_hits.tolist(), blocks.last_release.tolist()
    children = np.bincount(blocks.parent[blocks.parent >= 0], minlength=n).tolist()
    heap = [(key(hits[row], releases[row]), -row) for row in range(n) if children[row] == 0]
    heapq.heapify(heap)
    kept = np.ones(n, dtype=bool)
    for _ in range(num_dropped):
        _, neg_row = heapq.heappop(heap)
        kept[-neg_row] = False
        parent = parents[-neg_row]
        if parent >= 0:
            children[parent] -= 1
            if children[parent] == 0:
                heapq.heappush(heap, (key(hits[parent], releases[parent]), -parent))
    return np.flatnonzero(kept).astype(np.int64), num_dropped


def encode_namespace(value: Hashable) -> list:
    """A namespace as JSON: a type-tagged list that :func:`decode_namespace` turns back into the same value.

    ``["n"]`` for ``None``, ``["i", "<decimal>"]``, ``["s", "<text>"]``,
    ``["b", "<hex>"]``, ``["t", [<encoded elements>]]``.

    Args:
        value: ``None`` or a plain value (:mod:`akv.core.ids`).

    Returns:
        A JSON-serializable list.

    Raises:
        InvalidInput: ``value`` is not plain.
    """
    value = plain_id(value, "a snapshot namespace", allow_none=True)
    return _encode(value)


def _encode(value: Hashable) -> list:
    if value is None:
        return ["n"]
    if type(value) is int:
        return ["i", str(value)]
    if type(value) is str:
        return ["s", value]
    if type(value) is bytes:
        return ["b", value.hex()]
    return ["t", [_encode(item) for item in value]]


def decode_namespace(data: object, depth: int = 1) -> Hashable:
    """The plain value that :func:`encode_namespace` encoded.

    Args:
        data: A parsed JSON value.
        depth: Tuple nesting so far (refused beyond :data:`~akv.core.ids.MAX_ID_DEPTH`).

    Returns:
        ``None`` or a plain value.

    Raises:
        ValueError: ``data`` is not such an encoding (the caller names the file).
    """
    if type(data) is not list or not data or data[0] not in ("n", "i", "s", "b", "t"):
        raise ValueError(f"not a tagged namespace: {data!r:.60}")
    tag, rest = data[0], data[1:]
    if tag == "n" and not rest:
        return None
    if len(rest) != 1:
        raise ValueError(f"tagged namespace {tag!r} needs one value")
    (payload,) = rest
    if tag == "i" and type(payload) is str and payload.lstrip("-").isdigit() and payload.isascii():
        return int(payload)
    if tag == "s" and type(payload) is str:
        return payload
    if tag == "b" and type(payload) is str:
        return bytes.fromhex(payload)
    if tag == "t" and type(payload) is list and depth <= MAX_ID_DEPTH:
        return tuple(decode_namespace(item, depth + 1) for item in payload)
    raise ValueError(f"bad tagged namespace {data!r:.60}")
