"""Run-compressed radix tree over full blocks: the prefix cache index.

One node holds a *run* of blocks: consecutive full blocks of one prefix with
no branch between them (SGLang's ``RadixCache`` shape,
``python/sglang/srt/mem_cache/radix_cache.py``, at block granularity). A
node's children hang below its **last** block and are keyed by their first
block's token ids (int32 little-endian bytes, ``4 * block_size`` of them); a
prefix that diverges inside a run splits the node there. A block's identity is
the exact tokens of its block and of every block above it, so the same
``block_size`` tokens under another prefix never hit, and a hit compares the
stored tokens themselves, never a hash of them: no collision can serve another
prompt's K/V. The content key (:mod:`akv.core.block_key`) is derived from
those tokens on demand (:meth:`RadixTree.chain`). Namespaces (tenant, adapter,
model epoch, shard) get separate roots, which hold no block.

Per node (a :class:`~akv.core.radix_runs.Run`): its tokens in one
``bytearray``, its blocks' locations (today their device block ids,
:mod:`akv.core.location`) in one ``array('q')``. Per block
id, two int32 numpy arrays (grown on demand) give its node and its position in
the node's run, so a split re-points the tail with one numpy assignment.
Matching compares a whole run with one ``bytes ==`` (numpy finds the first
differing block when it fails) and returns block ids by slicing runs; removal
of a leaf node's tail blocks truncates the run in bulk. Nodes are never handed
out: callers pass and receive block ids.

Only leaves are removed (a node's last block, when the node has no children),
so no cached block becomes unreachable while it occupies memory. A node left
with one child after a removal is *not* merged with it: merging would re-point
the child's whole run and save one dict lookup per match through it, and such
nodes are few (2,000 conversation-trace prompts through a ``ShardState``,
sampled every 100: 2.4 % of runs at 83,576 blocks, 9.2 % at 222,868, with
680-750 blocks per run); SGLang does not merge on eviction either. Nodes are
garbage-collector-tracked objects, but there is one per run (hundreds for
hundreds of thousands of blocks), not one per block.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

import numpy as np

from akv.core.radix_runs import Run, RunQueries, as_bytes, as_ids, block_keys, leading_equal, leading_equal_ids
from akv.core.radix_tiers import TierMoves

__all__ = ["RadixTree", "block_keys"]


class RadixTree(RunQueries, TierMoves):
    """Run-compressed, block-granular radix tree mapping token prefixes to cached block ids.

    Tokens are passed as int32 little-endian bytes (or an integer numpy
    array, converted to those), ``4 * block_size`` bytes per full block.
    Block ids are ints ``>= 0``.

    Args:
        block_size: Tokens per block (>= 1).
        host_base: The first id that names a host-tier slot (ids from here
            on are host blocks, ``host_base + slot``; see
            :mod:`akv.core.radix_tiers`), or None: every id is a device block.

    Raises:
        ValueError: ``block_size`` is not an int >= 1, or ``host_base`` is
            not None or an int >= 1.
    """

    __slots__ = (
        "_free_nids",
        "_host_base",
        "_node_mv",
        "_node_of",
        "_nodes",
        "_pos_mv",
        "_pos_of",
        "_roots",
        "_size",
        "_width",
    )

    def __init__(self, block_size: int, host_base: int | None = None) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if host_base is not None and (type(host_base) is not int or host_base < 1):
            raise ValueError(f"host_base must be None or an int >= 1, got {host_base!r}")
        self._host_base = host_base
        self._width = 4 * block_size
        self._roots: dict[Hashable, Run] = {}
        self._nodes: list[Run | None] = []
        self._free_nids: list[int] = []
        #: int32 per block id: the node holding it (-1: not in the tree), and its position in the run.
        self._node_of = np.full(64, -1, dtype=np.int32)
        self._pos_of = np.zeros(64, dtype=np.int32)
        # memoryviews of the same arrays: scalar reads and writes at list speed (numpy's own are ~4x slower)
        self._node_mv = memoryview(self._node_of)
        self._pos_mv = memoryview(self._pos_of)
        self._size = 0

    def _grow(self, max_block_id: int) -> None:
        cap = len(self._node_of)
        new = max(max_block_id + 1, 2 * cap, 64)
        node_of = np.full(new, -1, dtype=np.int32)
        node_of[:cap] = self._node_of
        pos_of = np.zeros(new, dtype=np.int32)
        pos_of[:cap] = self._pos_of
        self._node_of, self._pos_of = node_of, pos_of
        self._node_mv, self._pos_mv = memoryview(node_of), memoryview(pos_of)

    def _new_node(self, parent: Run | None, namespace: Hashable = None) -> Run:
        if self._free_nids:
            nid = self._free_nids.pop()
            node = self._nodes[nid] = Run(nid, parent, namespace)
        else:
            node = Run(len(self._nodes), parent, namespace)
            self._nodes.append(node)
        return node

    def _root(self, namespace: Hashable) -> Run:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_node(None, namespace)
        return root

    def match(self, namespace: Hashable, tokens, below: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of ``tokens``. O(matched bytes), one dict lookup per run.

        Args:
            namespace: Root to search under.
            tokens: The prompt's full blocks: int32 LE bytes (or an integer
                numpy array), ``4 * block_size`` bytes per block; a partial
                last block is ignored.
            below: Match ``tokens`` below this block instead of the
                namespace's root (to extend an earlier match); nothing matches
                below a block that is not in the tree.

        Returns:
            The matched block ids in logical order (possibly empty).
        """
        node, pos = self._place(namespace, below, create=False)
        out: list[int] = []
        if node is None:
            return out
        buf, w = as_bytes(tokens), self._width
        n = len(buf) // w
        i = 0
        while i < n:
            if pos + 1 == len(node.blocks):
                child = node.children.get(buf[i * w : (i + 1) * w])
                if child is None:
                    break
                node, pos = child, -1
            m = min(len(node.blocks) - pos - 1, n - i)
            t = leading_equal(node.tokens, (pos + 1) * w, buf, i * w, m, w)
            out.extend(node.blocks[pos + 1 : pos + 1 + t])
            i, pos = i + t, pos + t
            if t < m:
                break
        return out

    def lookup(self, namespace: Hashable, tokens) -> int:
        """Number of leading blocks of ``tokens`` that would hit (see :meth:`match`); no side effects."""
        return len(self.match(namespace, tokens))

    def insert(self, namespace: Hashable, parent_block_id: int | None, tokens, block_ids) -> int:
        """Publish a chain of blocks below ``parent_block_id`` (the root if None).

        Walks down from the parent, a run at a time; where the chain's tokens
        are cached under the *same* block ids it is already published; where
        they are cached under *another* block id (the same tokens computed
        twice) the chain ends: that block and everything after it stay
        private, so every node's ancestors are exactly the blocks its
        sequences hold. The rest is added in one piece: appended in place to a
        childless run it continues (amortized O(1) per block), else a new
        child (splitting the run first if the chain leaves it midway).

        Args:
            namespace: Root the chain hangs under (created if new).
            parent_block_id: The block the chain continues, or None.
            tokens: The chain's tokens: int32 LE bytes (or an integer numpy
                array), exactly ``4 * block_size`` bytes per block.
            block_ids: The chain's block ids (ints, or an integer numpy array).

        Returns:
            How many leading blocks of ``block_ids`` are now in the tree as
            themselves (0 if the parent is not in the tree).

        Raises:
            ValueError: ``tokens`` does not hold one block per id, a block id
                is negative, or one is already in the tree under another place
                (or listed twice); the tree is left as it was (a new
                namespace's root, which holds no block, stays).
        """
        buf, ids, w = as_bytes(tokens), as_ids(block_ids), self._width
        n = len(ids)
        if len(buf) != n * w:
            raise ValueError(f"{len(buf) / w:g} blocks of tokens for {n} blocks")
        if not n:
            return 0
        node, pos = self._place(namespace, parent_block_id, create=True)
        if node is None:
            return 0
        if min(ids) < 0:
            raise ValueError(f"negative block id in {ids.tolist()}")
        i = 0
        while i < n:
            if pos + 1 == len(node.blocks):
                child = node.children.get(buf[i * w : (i + 1) * w])
                if child is None:
                    break
                node, pos = child, -1
            m = min(len(node.blocks) - pos - 1, n - i)
            t = leading_equal(node.tokens, (pos + 1) * w, buf, i * w, m, w)
            same = leading_equal_ids(node.blocks, pos + 1, ids, i, t)
            if same < t:
                return i + same
            i, pos = i + t, pos + t
            if t < m:
                break
        if i < n:
            self._attach(node, pos, buf[i * w :], ids[i:])
        return n

    def _attach(self, node: Run, pos: int, buf: bytes, new: array) -> None:
        """Add the new blocks ``new`` (tokens ``buf``) below ``node``'s block at ``pos``; validated first.

        Raises:
            ValueError: A block of ``new`` is in the tree or listed twice (nothing changed).
        """
        w, n = self._width, len(new)
        if max(new) >= len(self._node_of):
            self._grow(max(new))
        extend = pos + 1 == len(node.blocks) and not node.children and node.parent is not None
        base = len(node.blocks) if extend else 0
        arr = np.frombuffer(new, dtype=np.int64)
        offsets = np.arange(base, base + n, dtype=np.int32)
        if (self._node_of[arr] >= 0).any():
            self._refuse(new)
        self._pos_of[arr] = offsets
        if n > 1 and not np.array_equal(self._pos_of[arr], offsets):  # a later duplicate overwrote an earlier one
            self._refuse(new)
        if not extend:
            if pos + 1 < len(node.blocks):
                self._split(node, pos + 1)
            child = self._new_node(node)
            node.children[buf[:w]] = child
            node = child
        node.tokens += buf
        node.blocks.extend(new)
        self._node_of[arr] = node.nid
        self._size += n

    def _refuse(self, new: array):
        """Raise the error for the first block of ``new`` that is in the tree or listed twice."""
        seen: set[int] = set()
        for b in new:
            if b in seen:
                raise ValueError(f"block {b} is listed twice in one chain")
            if self._node_mv[b] >= 0:
                raise ValueError(f"block {b} is already in the prefix cache elsewhere")
            seen.add(b)
        raise AssertionError(f"no block of {new.tolist()} is in the tree or listed twice")

    def _split(self, node: Run, at: int) -> None:
        """Move ``node``'s blocks from position ``at`` on (and its children) to a new only child."""
        w = self._width
        tail = self._new_node(node)
        tail.tokens = node.tokens[at * w :]
        tail.blocks = node.blocks[at:]
        tail.children = node.children
        for c in tail.children.values():
            c.parent = tail
        node.children = {bytes(tail.tokens[:w]): tail}
        del node.tokens[at * w :]
        del node.blocks[at:]
        moved = np.frombuffer(tail.blocks, dtype=np.int64)
        self._node_of[moved] = tail.nid
        self._pos_of[moved] -= at

    def insert_blocks(self, items: Sequence[tuple[Hashable, int | None, bytes, int]]) -> list[int]:
        """Publish single blocks, each below its parent: a decode step's newly full blocks.

        Each item ``(namespace, parent_block_id | None, token bytes, block_id)``
        is exactly ``insert(namespace, parent_block_id, tokens, [block_id])``,
        in order, without the per-call overhead (one call for the step
        instead of one per sequence). The common case, a block continuing a
        childless run, is appended in place: O(1) amortized.

        Returns:
            Per item, 1 if its block is now in the tree as itself, else 0.

        Raises:
            ValueError: A token string is not one block, or a block id is
                negative or already in the tree under another place; the
                blocks this call added are taken out again.
        """
        out: list[int] = []
        added: list[int] = []
        w = self._width
        for namespace, parent, key, block_id in items:
            node, pos = self._place(namespace, parent, create=True)
            if node is None:
                out.append(0)
                continue
            if block_id >= len(self._node_mv):
                self._grow(block_id)
            nb = len(node.blocks)
            if len(key) != w:
                found = None
            elif pos + 1 < nb:
                found = node.blocks[pos + 1] if node.tokens[(pos + 1) * w : (pos + 2) * w] == key else None
            else:
                child = node.children.get(key)
                found = None if child is None else child.blocks[0]
            if found is not None:
                out.append(1 if found == block_id else 0)
                continue
            if len(key) != w or block_id < 0 or self._node_mv[block_id] >= 0:
                self.remove_leaves(added[::-1])
                if len(key) != w:
                    raise ValueError(f"{len(key)} bytes of tokens for block {block_id}, not {w}")
                raise ValueError(f"block {block_id} is negative or already in the prefix cache elsewhere")
            if pos + 1 == nb and not node.children and node.parent is not None:
                node.tokens += key  # extends the run in place
                node.blocks.append(block_id)
                self._node_mv[block_id] = node.nid
                self._pos_mv[block_id] = nb
                self._size += 1
            else:
                self._attach(node, pos, key, array("q", (block_id,)))
            added.append(block_id)
            out.append(1)
        return out

    def remove_leaves(self, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Remove the given blocks, each of which must be a leaf when its turn comes.

        Blocks are processed in order, so a parent listed after its last child
        is removed too. The victims are cut into segments of one node's
        consecutive positions, deepest first (the order a freed sequence's
        blocks are evicted in); a segment ending at a childless node's last
        block is truncated in bulk, any other is taken a block at a time.

        Returns:
            ``(removed, refused)``: block ids removed, and ids that were not
            leaves (or not in the tree) and so were kept.
        """
        removed: list[int] = []
        refused: list[int] = []
        n = len(block_ids)
        if not n:
            return removed, refused
        try:
            ids = np.array(block_ids, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):  # ids beyond int64: none of them is in the tree
            for b in block_ids:
                self._remove_one(b, removed, refused)
            return removed, refused
        valid = (ids >= 0) & (ids < len(self._node_of))
        safe = np.where(valid, ids, 0)
        nids = np.where(valid, self._node_of[safe], -1)
        pos = self._pos_of[safe]
        brk = np.ones(n, dtype=bool)
        brk[1:] = (nids[1:] != nids[:-1]) | (pos[1:] != pos[:-1] - 1) | (nids[1:] < 0)
        first = brk.nonzero()[0]
        starts = first.tolist()
        starts.append(n)
        lst = block_ids if type(block_ids) is list else ids.tolist()
        for s, e, nid, top in zip(starts, starts[1:], nids[first].tolist(), pos[first].tolist()):
            if nid >= 0 and self._truncate_tail(lst[s], nid, top, e - s):
                self._node_of[ids[s:e]] = -1
                removed.extend(lst[s:e])
            else:
                for b in lst[s:e]:
                    self._remove_one(b, removed, refused)
        return removed, refused

    def _truncate_tail(self, top_block: int, nid: int, top: int, count: int) -> bool:
        """Cut ``count`` blocks ending at ``top_block`` (position ``top``) off node ``nid`` if they are its leaf tail."""
        node = self._nodes[nid]
        if node is None or node.children or top != len(node.blocks) - 1 or node.blocks[top] != top_block:
            return False
        self._cut(node, top - count + 1)
        return True

    def _remove_one(self, block_id, removed: list[int], refused: list[int]) -> None:
        node, pos = self._place(None, block_id, create=False) if type(block_id) is int else (None, -1)
        if node is None or node.children or pos != len(node.blocks) - 1:
            refused.append(block_id)
            return
        self._node_mv[block_id] = -1
        self._cut(node, pos)
        removed.append(block_id)

    def _cut(self, node: Run, start: int) -> None:
        """Drop ``node``'s blocks from ``start`` on (the caller unmaps them); an emptied node leaves its parent."""
        w = self._width
        self._size -= len(node.blocks) - start
        if start == 0:
            del node.parent.children[bytes(node.tokens[:w])]
            self._nodes[node.nid] = None
            self._free_nids.append(node.nid)
            node.parent = None
            return
        del node.tokens[start * w :]
        del node.blocks[start:]
