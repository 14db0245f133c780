"""Moves of cached blocks between tiers in the prefix tree: a block keeps its node and changes its id.

A block's id in :class:`~akv.core.radix_tree.RadixTree` says where its K/V
is (:mod:`akv.core.location`): below the tree's ``host_base`` a device block
id, from ``host_base`` on a host-tier slot (``host_base + slot``). A block
that changes tier keeps its place in its run and its tokens; only its id
there changes, so its key, its children and every match through it are
unchanged. :class:`TierMoves` holds the two moves:

- :meth:`TierMoves.demote_leaves`: device blocks that are *device leaves*
  (no child, or only host children) take host ids, in the given order, so a
  chain demoted deepest first moves whole. Device blocks stay
  ancestor-closed: every device block's parent is a device block, and a
  match returns its device hits first, then its host hits.
- :meth:`TierMoves.relocate`: any blocks take new ids (a promotion moves a
  matched path's host blocks to fresh device blocks).

Both work a segment at a time (consecutive positions of one run, the shape of
a chain's tail or a matched path), with one slice assignment per segment and
one numpy assignment per segment for the per-block arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from akv.core.radix_runs import as_ids


class TierMoves:
    """Tier moves of :class:`~akv.core.radix_tree.RadixTree` (a mixin; uses its attributes)."""

    __slots__ = ()

    def is_host(self, block_id: int) -> bool:
        """Whether ``block_id`` names a host-tier slot (it is at least the tree's ``host_base``)."""
        return self._host_base is not None and block_id >= self._host_base

    def _segments(self, old: np.ndarray, step: int) -> tuple[list[int], list[int], list[int]]:
        """Cut ``old`` (ids in the tree) into runs of one node's positions advancing by ``step``.

        Returns:
            ``(starts, nids, positions)``: segment start indices (with ``len(old)``
            appended), and each segment's node and first position.
        """
        nids = self._node_of[old]
        pos = self._pos_of[old]
        n = len(old)
        brk = np.ones(n, dtype=bool)
        brk[1:] = (nids[1:] != nids[:-1]) | (pos[1:] != pos[:-1] + step)
        at = np.flatnonzero(brk)
        starts = at.tolist()
        starts.append(n)
        return starts, nids[at].tolist(), pos[at].tolist()

    def _check_fresh(self, new: np.ndarray) -> None:
        """Raise ``ValueError`` unless the ``new`` ids are non-negative, distinct and not in the tree (grows the arrays)."""
        if not len(new):
            return
        if new.min() < 0:
            raise ValueError(f"negative new id in {new.tolist()[:8]}")
        if new.max() >= len(self._node_of):
            self._grow(int(new.max()))
        if (self._node_of[new] >= 0).any() or len(np.unique(new)) != len(new):
            raise ValueError(f"a new id of {new.tolist()[:8]} is already in the tree, or listed twice")

    def _move(self, node, lo: int, old_seg: np.ndarray, new_seg: np.ndarray) -> None:
        """Give ``node``'s blocks at positions ``lo ..`` (ascending) the ids ``new_seg``; unmap ``old_seg``."""
        node.blocks[lo : lo + len(new_seg)] = as_ids(new_seg)
        self._node_of[old_seg] = -1
        self._node_of[new_seg] = node.nid
        self._pos_of[new_seg] = np.arange(lo, lo + len(new_seg), dtype=np.int32)

    def relocate(self, old_ids: Sequence[int], new_ids: Sequence[int]) -> None:
        """Give blocks new ids in place (``old_ids[i]`` becomes ``new_ids[i]``); nothing else changes.

        O(n) plus one slice assignment per segment of consecutive positions
        (a matched path root first is one segment per run).

        Args:
            old_ids: Distinct blocks in the tree.
            new_ids: Distinct ids not in the tree, one per old id.

        Raises:
            ValueError: An old id is not in the tree, a new one is (or is
                negative), an id is listed twice, or the lengths differ; the
                tree is left as it was.
        """
        old = np.asarray(old_ids, dtype=np.int64)
        new = np.asarray(new_ids, dtype=np.int64)
        if len(old) != len(new):
            raise ValueError(f"{len(old)} blocks moved to {len(new)} new ids")
        if not len(old):
            return
        if old.min() < 0 or old.max() >= len(self._node_of) or (self._node_of[old] < 0).any():
            raise ValueError(f"a block of {old.tolist()[:8]} is not in the tree")
        if len(np.unique(old)) != len(old):
            raise ValueError(f"a block of {old.tolist()[:8]} is listed twice")
        self._check_fresh(new)
        starts, nids, pos = self._segments(old, 1)
        for k, (s, e) in enumerate(pairwise(starts)):
            self._move(self._nodes[nids[k]], pos[k], old[s:e], new[s:e])

    def demote_leaves(
        self, block_ids: Sequence[int], new_ids: Sequence[int], *, check: bool = True
    ) -> tuple[list[int], list[int], list[int]]:
        """Move device leaves to host ids, in order; refuse the blocks that are not device leaves at their turn.

        A block is a device leaf when the block after it in its run, or every
        child below a run's last block, is a host block (or there is none).
        Blocks are taken in order and the ``k``-th block moved takes
        ``new_ids[k]``; a segment of one run's consecutive positions listed
        deepest first (a freed chain's eviction order) moves in one piece.

        Args:
            block_ids: Device blocks (distinct; ids not in the tree are refused).
            new_ids: Host ids not in the tree, at least as many as will move
                (``len(block_ids)`` is always enough); the unused tail is
                left out of the tree.
            check: Check ``new_ids`` (distinct, not in the tree); a caller
                that takes them from a pool of free ids may skip it.

        Returns:
            ``(moved, new, refused)``: the blocks moved, their new ids (the
            first ``len(moved)`` of ``new_ids``), and the blocks refused, in order.

        Raises:
            ValueError: The tree has no ``host_base``, or a new id is in the
                tree, negative or listed twice (checked before anything moves).
        """
        if self._host_base is None:
            raise ValueError("a tree without host ids cannot demote")
        ids = np.asarray(block_ids, dtype=np.int64)
        new = np.asarray(new_ids, dtype=np.int64)
        n = len(ids)
        if not n:
            return [], [], []
        if check:
            self._check_fresh(new)
        elif len(new) and new.max() >= len(self._node_of):
            self._grow(int(new.max()))
        valid = (ids >= 0) & (ids < len(self._node_of))
        inside = ids[valid]
        if len(inside) and (self._node_of[inside] < 0).any():
            valid[valid] = self._node_of[inside] >= 0
        moved: list[int] = []
        refused: list[int] = ids[~valid].tolist()
        inside = ids[valid]
        if not len(inside):
            return moved, [], refused
        starts, nids, pos = self._segments(inside, -1)
        lst = inside.tolist()
        taken = 0
        for j, (s, e) in enumerate(pairwise(starts)):
            node = self._nodes[nids[j]]
            if taken >= len(new) or not self._below_is_host(node, pos[j]):
                refused += lst[s:e]
                continue
            k = min(e - s, len(new) - taken)
            seg_new = new[taken : taken + k][::-1]  # positions ascending: the deepest block takes the first id
            self._move(node, pos[j] - k + 1, inside[s : s + k][::-1], seg_new)
            moved += lst[s : s + k]
            refused += lst[s + k : e]
            taken += k
        return moved, new[:taken].tolist(), refused

    def _below_is_host(self, node, pos: int) -> bool:
        """Whether everything directly below ``node``'s block at ``pos`` is a host block (or nothing is)."""
        hb = self._host_base
        if pos + 1 < len(node.blocks):
            return node.blocks[pos + 1] >= hb
        return all(child.blocks[0] >= hb for child in node.children.values())
