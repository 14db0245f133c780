"""Radix tree over full blocks: the prefix cache index.

Each node stands for one full, immutable block (a node *is* its block id). Its identity is the exact
tokens of its block *and* of every block above it (the path from its
namespace's root), so the same ``block_size`` tokens under another prefix never
hit. Children are keyed by the block's token ids as raw bytes, so a hit
compares the tokens themselves, not a hash of them (no collision can serve
another prompt's K/V). Namespaces (tenant, adapter, model epoch, shard) get
separate roots.

Matching costs ``O(matched blocks)`` dictionary lookups. Only leaves are
removed, so no cached block becomes unreachable while it occupies memory.
Nodes are never handed out: callers pass and receive block ids.

Modelled on SGLang's ``RadixCache`` (``python/sglang/srt/mem_cache/radix_cache.py``)
with one block per edge, like vLLM v1's block-hash chain.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Sequence

import numpy as np

_ID = struct.Struct("<q")


class RadixTree:
    """Block-granular radix tree mapping token prefixes to cached block ids.

    Keys are per-block token bytes: ``tokens[i*bs:(i+1)*bs]`` as little-endian
    int32 (see :func:`block_keys`).

    Layout: no node objects. An edge is one entry of a single dict from
    ``parent id (8 bytes) + block token bytes`` to the child's block id, and
    per-block dicts hold the parent id, the edge and the child count.
    Namespace roots get negative ids. Every container holds only ints and
    bytes, which CPython's cyclic garbage collector does not track, so a tree
    of millions of blocks adds no collector pauses (a node-object tree did:
    measured 7.1 us per block admitted, evicted and freed, against 2.9 us).
    """

    __slots__ = ("_child", "_edge", "_num_children", "_parent", "_roots")

    def __init__(self) -> None:
        self._roots: dict[Hashable, int] = {}
        self._child: dict[bytes, int] = {}
        self._parent: dict[int, int] = {}
        self._edge: dict[int, bytes] = {}
        self._num_children: dict[int, int] = {}

    def __len__(self) -> int:
        """Number of blocks in the tree."""
        return len(self._parent)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._parent

    def match(self, namespace: Hashable, keys: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``keys``. O(matched blocks).

        Args:
            namespace: Root to search under.
            keys: Per-block token bytes of the prompt's full blocks.

        Returns:
            The matched block ids in logical order (possibly empty).
        """
        node = self._roots.get(namespace)
        out: list[int] = []
        if node is None:
            return out
        child, pack = self._child, _ID.pack
        for key in keys:
            node = child.get(pack(node) + key)
            if node is None:
                break
            out.append(node)
        return out

    def insert(
        self,
        namespace: Hashable,
        parent_block_id: int | None,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
    ) -> int:
        """Publish a chain of blocks below ``parent_block_id`` (the root if None).

        Walks down from the parent; a missing child is created for the given
        block; an existing child holding the *same* block id is already
        published; an existing child holding *another* block id (the same
        tokens computed twice) ends the chain: that block and everything after
        it stay private, so every node's ancestors are exactly the blocks its
        sequences hold.

        Returns:
            How many leading blocks of ``block_ids`` are now in the tree as
            themselves (0 if the parent is not in the tree).

        Raises:
            ValueError: ``keys`` and ``block_ids`` differ in length, or a block
                id is already in the tree under another place (or listed
                twice); the blocks this call added are taken out again, so
                the tree is as it was.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if parent_block_id is None:
            node = self._roots.get(namespace)
            if node is None:
                node = self._roots[namespace] = -1 - len(self._roots)
                self._num_children[node] = 0
        else:
            node = parent_block_id
            if node not in self._parent:
                return 0
        done = 0
        first_new = None  # index of the first block this call adds (an error undoes from there)
        child, parent, edge, nchild, pack = self._child, self._parent, self._edge, self._num_children, _ID.pack
        for key, block_id in zip(keys, block_ids):
            e = pack(node) + key
            found = child.get(e)
            if found is None:
                if block_id in parent:
                    if first_new is not None:  # undo: this call's blocks, deepest first
                        self.remove_leaves([block_ids[i] for i in range(done - 1, first_new - 1, -1)])
                    raise ValueError(f"block {block_id} is already in the prefix cache elsewhere")
                if first_new is None:
                    first_new = done
                child[e] = block_id
                parent[block_id] = node
                edge[block_id] = e
                nchild[block_id] = 0
                nchild[node] += 1
            elif found != block_id:
                break
            node = block_id
            done += 1
        return done

    def remove_leaves(self, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Remove the given blocks, each of which must be a leaf when its turn comes.

        Blocks are processed in order, so a parent listed after its last child
        is removed too.

        Returns:
            ``(removed, refused)``: block ids removed, and ids that were not
            leaves (or not in the tree) and so were kept.
        """
        removed: list[int] = []
        refused: list[int] = []
        child, parent, edge, nchild = self._child, self._parent, self._edge, self._num_children
        for block_id in block_ids:
            if nchild.get(block_id, 1) != 0:
                refused.append(block_id)
                continue
            del child[edge.pop(block_id)]
            nchild[parent.pop(block_id)] -= 1
            del nchild[block_id]
            removed.append(block_id)
        return removed, refused

    def lookup(self, namespace: Hashable, keys: Sequence[bytes]) -> int:
        """Number of leading blocks of ``keys`` that would hit; no side effects."""
        return len(self.match(namespace, keys))

    def is_leaf(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the tree and has no children."""
        return self._num_children.get(block_id, 1) == 0 and block_id in self._parent

    def block_ids(self) -> list[int]:
        """Every block id in the tree (any order)."""
        return list(self._parent)

    def path(self, block_id: int) -> list[int]:
        """Block ids from the namespace root down to ``block_id`` (inclusive).

        Raises:
            KeyError: ``block_id`` is not in the tree.
        """
        out = [block_id]
        node = self._parent[block_id]
        while node >= 0:
            out.append(node)
            node = self._parent[node]
        out.reverse()
        return out

    def check(self) -> None:
        """Consistency check: edges, parents and child counts agree.

        Raises:
            AssertionError: Naming the inconsistent block.
        """
        counts: dict[int, int] = dict.fromkeys(self._roots.values(), 0)
        for block_id, parent in self._parent.items():
            e = self._edge.get(block_id)
            if e is None or self._child.get(e) != block_id or _ID.unpack(e[:8])[0] != parent:
                raise AssertionError(f"block {block_id}: edge and parent disagree")
            if parent >= 0 and parent not in self._parent:
                raise AssertionError(f"block {block_id}: parent {parent} is not in the tree")
            counts[parent] = counts.get(parent, 0) + 1
        if len(self._child) != len(self._parent):
            raise AssertionError(f"{len(self._child)} edges for {len(self._parent)} blocks")
        for node, n in self._num_children.items():
            if counts.get(node, 0) != n:
                raise AssertionError(f"node {node}: child count {n} but {counts.get(node, 0)} children")


def block_keys(tokens, block_size: int, num_blocks: int) -> list[bytes]:
    """Per-block keys of the first ``num_blocks`` full blocks of ``tokens``.

    Args:
        tokens: int32 numpy array of token ids, shape ``(n,)`` with
            ``n >= num_blocks * block_size``.
        block_size: Tokens per block.
        num_blocks: Full blocks to key.

    Returns:
        ``num_blocks`` byte strings of ``4 * block_size`` bytes each.
    """
    width = 4 * block_size
    head = tokens[: num_blocks * block_size]
    if head.dtype != np.int32:  # keys are defined on int32 bytes
        head = head.astype(np.int32)
    raw = head.tobytes()
    return [raw[i : i + width] for i in range(0, num_blocks * width, width)]
