"""Runs of blocks, the nodes of :class:`~akv.core.radix_tree.RadixTree`, and the tree's read-only queries.

A :class:`Run` holds consecutive full blocks of one prefix: their tokens in
one ``bytearray`` (int32 little-endian, ``4 * block_size`` bytes per block)
and their block ids (device locations, :mod:`akv.core.location`) in one
``array('q')``. The helpers here convert callers' tokens and ids to those
forms and compare whole runs in bulk (one ``bytes ==``; numpy finds the first
differing block when it fails). :class:`RunQueries` is the tree's read-only
half (membership, paths, chains, the consistency check), kept apart from the
mutations in :mod:`akv.core.radix_tree`.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Iterator

import numpy as np

from akv.core.location import Location, Medium

#: From this many ids on, :meth:`RunQueries._leading` groups them by run with numpy.
_GROUP_MIN = 64


class Run:
    """A run of blocks: one node of the tree; a namespace's root when ``parent`` is None (then it holds no block).

    Args:
        nid: The node's index in the tree's node list (what the per-block
            arrays store).
        parent: The run whose last block this run hangs below, or None.
        namespace: A root's namespace (None for other runs).
    """

    __slots__ = ("blocks", "children", "namespace", "nid", "parent", "tokens")

    def __init__(self, nid: int, parent: Run | None, namespace: Hashable = None) -> None:
        self.nid = nid
        self.parent = parent
        self.namespace = namespace
        self.tokens = bytearray()  # int32 LE token ids of the run, 4 * block_size bytes per block
        self.blocks = array("q")  # the run's block ids (device locations), in order
        self.children: dict[bytes, Run] = {}  # first block's token bytes -> child


def as_bytes(tokens) -> bytes:
    """int32 little-endian bytes of ``tokens``.

    Args:
        tokens: Bytes-like (taken as is) or an integer numpy array of token
            ids, shape ``(n,)`` (converted to int32 LE).

    Returns:
        ``4 * n`` bytes (``tokens`` itself if it is ``bytes``).
    """
    if type(tokens) is bytes:
        return tokens
    if isinstance(tokens, np.ndarray):
        return (tokens if tokens.dtype == np.dtype("<i4") else tokens.astype("<i4")).tobytes()
    return bytes(tokens)


def as_ids(block_ids) -> array:
    """``block_ids`` as a new ``array('q')``.

    Args:
        block_ids: A sequence of ints or an integer numpy array, shape ``(n,)``.

    Raises:
        TypeError: An element is not an integer.
        OverflowError: An element does not fit in int64.
    """
    if isinstance(block_ids, np.ndarray):
        out = array("q")
        out.frombytes(block_ids.astype(np.int64, copy=False).tobytes())
        return out
    return array("q", block_ids)


def leading_equal(a, a_off: int, b, b_off: int, count: int, width: int) -> int:
    """Leading equal blocks of two token buffers: one ``==`` of the whole span, numpy rows if it fails.

    Args:
        a, b: Bytes-like token buffers.
        a_off, b_off: Byte offsets of the spans compared.
        count: Blocks in each span (both buffers hold them).
        width: Bytes per block (``4 * block_size``).

    Returns:
        How many of the ``count`` blocks are equal before the first that differs.
    """
    if not count or a[a_off : a_off + count * width] == b[b_off : b_off + count * width]:
        return count
    x = np.frombuffer(a, np.uint8, count * width, a_off).reshape(count, width)
    y = np.frombuffer(b, np.uint8, count * width, b_off).reshape(count, width)
    return int((x != y).any(axis=1).argmax())


def leading_equal_ids(a: array, a_off: int, b: array, b_off: int, count: int) -> int:
    """Leading equal ids of two ``array('q')`` spans (``count`` ids from ``a_off`` and ``b_off``).

    Returns:
        How many of the ``count`` ids are equal before the first that differs.
    """
    if not count or a[a_off : a_off + count] == b[b_off : b_off + count]:
        return count
    x = np.frombuffer(a, np.int64, count, 8 * a_off)
    y = np.frombuffer(b, np.int64, count, 8 * b_off)
    return int((x != y).argmax())


def block_keys(tokens, block_size: int, num_blocks: int) -> list[bytes]:
    """Per-block token bytes of the first ``num_blocks`` full blocks of ``tokens`` (for tests and tools).

    Args:
        tokens: int32 numpy array of token ids, shape ``(n,)`` with
            ``n >= num_blocks * block_size``.
        block_size: Tokens per block.
        num_blocks: Full blocks to cut.

    Returns:
        ``num_blocks`` byte strings of ``4 * block_size`` bytes each.
    """
    width = 4 * block_size
    raw = as_bytes(tokens[: num_blocks * block_size])
    return [raw[i : i + width] for i in range(0, num_blocks * width, width)]


class RunQueries:
    """Read-only queries of :class:`~akv.core.radix_tree.RadixTree` (a mixin; uses its attributes)."""

    __slots__ = ()

    def __getstate__(self) -> dict:
        """State for ``copy``/``pickle``: the slots but the memoryviews (rebuilt by ``__setstate__``)."""
        return {name: getattr(self, name) for name in self.__slots__ if not name.endswith("_mv")}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._node_mv, self._pos_mv = memoryview(self._node_of), memoryview(self._pos_of)

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._width // 4

    def __len__(self) -> int:
        """Number of blocks in the tree."""
        return self._size

    def __contains__(self, block_id: int) -> bool:
        return 0 <= block_id < len(self._node_mv) and self._node_mv[block_id] >= 0

    @property
    def num_nodes(self) -> int:
        """Runs (nodes holding blocks) in the tree; ``len(tree) / num_nodes`` is the mean run length."""
        return len(self._nodes) - len(self._free_nids) - len(self._roots)

    def _place(self, namespace: Hashable, block_id: int | None, create: bool) -> tuple[Run | None, int]:
        """``(node, position)`` of ``block_id`` (the namespace's root and -1 for None); ``(None, -1)`` if absent."""
        if block_id is None:
            return (self._root(namespace) if create else self._roots.get(namespace)), -1
        if not 0 <= block_id < len(self._node_mv) or self._node_mv[block_id] < 0:
            return None, -1
        return self._nodes[self._node_mv[block_id]], self._pos_mv[block_id]

    def is_leaf(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the tree and has no children."""
        node, pos = self._place(None, block_id, create=False)
        return node is not None and not node.children and pos == len(node.blocks) - 1

    def block_ids(self) -> list[int]:
        """Every block id in the tree, ascending."""
        return np.flatnonzero(self._node_of >= 0).tolist()

    def location(self, block_id: int) -> Location:
        """Where ``block_id``'s K/V is: its device block, or its host slot (``block_id - host_base``).

        Raises:
            KeyError: ``block_id`` is not in the tree.
        """
        node, pos = self._place(None, block_id, create=False)
        if node is None:
            raise KeyError(block_id)
        hb = self._host_base
        if hb is not None and block_id >= hb:
            return Location(medium=Medium.HOST, index=block_id - hb)
        return Location.device(node.blocks[pos])

    def _runs(self, block_id: int) -> tuple[Hashable, list[tuple[Run, int]]]:
        """The namespace and ``(node, blocks taken)`` from ``block_id``'s node up to the root's child."""
        node, pos = self._place(None, block_id, create=False)
        if node is None:
            raise KeyError(block_id)
        runs = [(node, pos + 1)]
        node = node.parent
        while node.parent is not None:
            runs.append((node, len(node.blocks)))
            node = node.parent
        return node.namespace, runs

    def runs(self, *, tokens: bool = False) -> Iterator[tuple]:
        """Every run of the tree, each after the run it hangs below (a depth-first walk). O(blocks).

        Args:
            tokens: Also yield the run's tokens.

        Yields:
            ``(namespace, parent_block_id, block_ids)``: the namespace as passed
            to :meth:`insert`, the block the run continues (``None`` below the
            root) and the run's block ids in chain order (a new list); with
            ``tokens``, a fourth item: the run's int32 LE token bytes
            (``4 * block_size`` per block, a new ``bytes``).
        """
        for namespace, root in self._roots.items():
            stack: list[tuple[Run, int | None]] = [(child, None) for child in root.children.values()]
            while stack:
                node, parent = stack.pop()
                blocks = node.blocks.tolist()
                yield (namespace, parent, blocks, bytes(node.tokens)) if tokens else (namespace, parent, blocks)
                stack.extend((child, blocks[-1]) for child in node.children.values())

    def path(self, block_id: int) -> list[int]:
        """Block ids from the namespace root down to ``block_id`` (inclusive). O(depth).

        Raises:
            KeyError: ``block_id`` is not in the tree.
        """
        out: list[int] = []
        for node, taken in reversed(self._runs(block_id)[1]):
            out.extend(node.blocks[:taken])
        return out

    def ancestors(self, block_ids: Iterable[int]) -> set[int]:
        """Every block above any of ``block_ids`` (their paths without themselves), each once.

        Walks up run by run and stops at a run already taken whole, so
        pinned blocks sharing a long prefix cost O(distinct runs + blocks
        returned), not O(pins x depth) as :meth:`path` per block would.

        Raises:
            KeyError: One of ``block_ids`` is not in the tree.
        """
        out: set[int] = set()
        for node, k in self._leading(block_ids, 0).items():
            if k:
                out.update(node.blocks[:k].tolist())
        return out

    def ancestry(self, block_ids: Iterable[int]) -> list[int]:
        """``block_ids`` and every block above them, each once, each before its parent (deepest first).

        The order in which a finished chain enters an eviction order, so that
        children are evicted before their parents. Runs are emitted by depth,
        deepest first (a run's depth: the blocks above its first one), each
        run's taken blocks last to first. O(distinct runs log runs + blocks returned).

        Raises:
            KeyError: One of ``block_ids`` is not in the tree.
        """
        need = self._leading(block_ids, 1)
        depth: dict[Run, int] = {}
        for node in need:
            up, chain = node, []
            while up.parent is not None and up not in depth:
                chain.append(up)
                up = up.parent
            d = depth.get(up, 0)
            for run in reversed(chain):
                d += len(run.parent.blocks)
                depth[run] = d
        out: list[int] = []
        for node in sorted(need, key=depth.__getitem__, reverse=True):
            out.extend(node.blocks[need[node] - 1 :: -1])
        return out

    def _leading(self, block_ids: Iterable[int], inclusive: int) -> dict[Run, int]:
        """Run -> how many of its leading blocks lie on the paths to ``block_ids`` (with them when ``inclusive``).

        Many ids (the blocks pending copies pin: a promoted prompt's chain)
        are grouped by run with numpy first, so Python walks distinct runs only.
        """
        if isinstance(block_ids, np.ndarray) or (isinstance(block_ids, list) and len(block_ids) > _GROUP_MIN):
            return self._leading_grouped(np.asarray(block_ids, dtype=np.int64), inclusive)
        need: dict[Run, int] = {}  # a run's ancestors are taken whole once the run is in
        for b in block_ids:
            node, pos = self._place(None, b, create=False)
            if node is None:
                raise KeyError(b)
            known = node in need
            if pos + inclusive > need.get(node, 0):
                need[node] = pos + inclusive
            if known:
                continue
            node = node.parent
            while node.parent is not None and need.get(node, 0) < len(node.blocks):
                need[node] = len(node.blocks)
                node = node.parent
        return need

    def _leading_grouped(self, ids: np.ndarray, inclusive: int) -> dict[Run, int]:
        """:meth:`_leading` for an int64 array: the deepest position per run in one numpy pass, then runs upward."""
        need: dict[Run, int] = {}
        if not len(ids):
            return need
        node_of = self._node_of
        bad = (ids < 0) | (ids >= len(node_of))
        if bad.any() or (node_of[ids] < 0).any():
            raise KeyError(int(ids[bad][0]) if bad.any() else int(ids[node_of[ids] < 0][0]))
        nids, inverse = np.unique(node_of[ids], return_inverse=True)
        deepest = np.zeros(len(nids), dtype=np.int64)
        np.maximum.at(deepest, inverse, self._pos_of[ids].astype(np.int64) + inclusive)
        nodes = self._nodes
        for nid, k in zip(nids.tolist(), deepest.tolist(), strict=True):
            node = nodes[nid]
            if k > need.get(node, 0):
                need[node] = k
            node = node.parent
            while node.parent is not None and need.get(node, 0) < len(node.blocks):
                need[node] = len(node.blocks)
                node = node.parent
        return need

    def chain(self, block_id: int) -> tuple[Hashable, bytes]:
        """The namespace and the tokens from the root down to ``block_id``; read-only. O(depth).

        What a block's content key is computed from
        (:func:`akv.core.block_key.chain_keys_raw`).

        Returns:
            ``(namespace, tokens)``: the namespace the chain hangs under (as
            passed to :meth:`insert`) and the int32 LE bytes of every block
            of the chain, root first, ``block_id``'s last
            (``4 * block_size`` bytes per block).

        Raises:
            KeyError: ``block_id`` is not in the tree.
        """
        namespace, runs = self._runs(block_id)
        w = self._width
        return namespace, b"".join(bytes(node.tokens[: taken * w]) for node, taken in reversed(runs))

    def parent_of(self, block_id: int) -> tuple[int | None, Hashable]:
        """``block_id``'s parent block and, for a chain's first block, its namespace. O(1).

        Returns:
            ``(parent block id, None)``, or ``(None, namespace)`` for the first
            block of a chain (its parent is the namespace's root).

        Raises:
            KeyError: ``block_id`` is not in the tree.
        """
        node, pos = self._place(None, block_id, create=False)
        if node is None:
            raise KeyError(block_id)
        if pos:
            return node.blocks[pos - 1], None
        parent = node.parent
        return (parent.blocks[-1], None) if parent.parent is not None else (None, parent.namespace)

    def holds(self, block_ids: np.ndarray) -> np.ndarray:
        """Whether each of ``block_ids`` (an int array, ids >= 0) is in the tree: bool ``(n,)``. O(n)."""
        inside = block_ids < len(self._node_of)
        out = np.zeros(len(block_ids), dtype=bool)
        out[inside] = self._node_of[block_ids[inside]] >= 0
        return out

    def block_tokens(self, block_ids: Iterable[int]) -> np.ndarray:
        """The token ids of blocks in the tree: int32 ``(n, block_size)``, in order. O(n) plus O(1) per run.

        What a block moved between tiers is described by in a cache event
        (its device block may hold other tokens by then).

        Raises:
            KeyError: A block is not in the tree.
        """
        ids = np.asarray(block_ids, dtype=np.int64)
        w = self._width
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self._node_of) or (self._node_of[ids] < 0).any()):
            raise KeyError(f"a block of {ids.tolist()[:8]} is not in the tree")
        out = np.empty((len(ids), w), dtype=np.uint8)
        nids, pos = self._node_of[ids], self._pos_of[ids]
        order = np.argsort(nids, kind="stable")
        cuts = np.flatnonzero(np.diff(nids[order])) + 1
        for group in np.split(order, cuts) if len(ids) else ():
            rows = np.frombuffer(self._nodes[nids[group[0]]].tokens, dtype=np.uint8).reshape(-1, w)
            out[group] = rows[pos[group]]
            del rows  # the run's bytearray may grow again
        return out.view("<i4")

    def subtree(self, block_id: int) -> list[int]:
        """``block_id`` and every block below it, each after all of its descendants. O(subtree).

        What :meth:`~akv.core.radix_tree.RadixTree.remove_leaves` takes to
        remove the subtree whole.

        Raises:
            KeyError: ``block_id`` is not in the tree.
        """
        node, pos = self._place(None, block_id, create=False)
        if node is None:
            raise KeyError(block_id)
        out = _post_order(list(node.children.values()))
        out.extend(reversed(node.blocks[pos:]))
        return out

    def removal_order(self, namespaces: Iterable[Hashable] | None = None) -> list[int]:
        """The blocks under ``namespaces`` (every namespace: None), each after all of its descendants. O(blocks).

        What :meth:`~akv.core.radix_tree.RadixTree.remove_leaves` takes to
        remove whole subtrees (each block is a leaf when its turn comes).
        """
        roots = self._roots
        spaces = list(roots) if namespaces is None else [ns for ns in namespaces if ns in roots]
        return _post_order([roots[ns] for ns in spaces][::-1])

    def check(self) -> None:
        """Consistency check: runs, children keys, parents, the per-block arrays and the size agree. O(blocks).

        Raises:
            AssertionError: Naming the inconsistent node or block.
        """
        w, total = self._width, 0
        for nid, node in enumerate(self._nodes):
            if node is None:
                continue
            if node.nid != nid:
                raise AssertionError(f"node {nid} names itself {node.nid}")
            if node.parent is None:
                if self._roots.get(node.namespace) is not node or len(node.blocks):
                    raise AssertionError(f"node {nid}: a root that is not its namespace's, or holds blocks")
            elif not node.blocks or node.parent.children.get(bytes(node.tokens[:w])) is not node:
                raise AssertionError(f"node {nid}: empty, or not its parent's child under its first block")
            elif self._nodes[node.parent.nid] is not node.parent:
                raise AssertionError(f"node {nid}: its parent is not in the tree")
            if len(node.tokens) != w * len(node.blocks):
                raise AssertionError(f"node {nid}: {len(node.tokens)} token bytes for {len(node.blocks)} blocks")
            for key, child in node.children.items():
                if child.parent is not node or child.tokens[:w] != key:
                    raise AssertionError(f"node {nid}: child {child.nid} under another key or parent")
            blocks = np.frombuffer(node.blocks, dtype=np.int64) if node.blocks else np.zeros(0, np.int64)
            if (blocks < 0).any() or (blocks >= len(self._node_of)).any():
                raise AssertionError(f"node {nid}: block ids outside the per-block arrays")
            if not (self._node_of[blocks] == nid).all() or not (self._pos_of[blocks] == np.arange(len(blocks))).all():
                raise AssertionError(f"node {nid}: the per-block arrays do not point at its run {blocks.tolist()}")
            total += len(blocks)
        if int(np.count_nonzero(self._node_of >= 0)) != total or total != self._size:
            raise AssertionError(
                f"{np.count_nonzero(self._node_of >= 0)} mapped blocks, {total} in runs, size {self._size}"
            )
        for nid in self._free_nids:
            if self._nodes[nid] is not None:
                raise AssertionError(f"node {nid} is both free and in use")


def _post_order(runs: list) -> list[int]:
    """The blocks of ``runs`` and their subtrees, each after all of its descendants (the last run's first)."""
    out: list[int] = []
    stack = [(run, False) for run in runs]
    while stack:
        run, expanded = stack.pop()
        if expanded:
            out.extend(reversed(run.blocks))
            continue
        stack.append((run, True))
        stack.extend((child, False) for child in run.children.values())
    return out
