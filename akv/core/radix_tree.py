"""Radix tree over full blocks: the prefix cache index.

Each node stands for one full, immutable block. Its identity is the exact
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

from collections.abc import Hashable, Sequence


class _Node:
    __slots__ = ("key", "parent", "children", "block_id")

    def __init__(self, key: bytes | None, parent: _Node | None, block_id: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.block_id = block_id


class RadixTree:
    """Block-granular radix tree mapping token prefixes to cached block ids.

    Keys are per-block token bytes: ``tokens[i*bs:(i+1)*bs]`` as little-endian
    int32 (see :func:`block_keys`).
    """

    __slots__ = ("_roots", "_by_block")

    def __init__(self) -> None:
        self._roots: dict[Hashable, _Node] = {}
        self._by_block: dict[int, _Node] = {}

    def __len__(self) -> int:
        """Number of blocks in the tree."""
        return len(self._by_block)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._by_block

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
        for key in keys:
            node = node.children.get(key)
            if node is None:
                break
            out.append(node.block_id)
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
                id is already in the tree under another place.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if parent_block_id is None:
            node = self._roots.get(namespace)
            if node is None:
                node = self._roots[namespace] = _Node(None, None, -1)
        else:
            node = self._by_block.get(parent_block_id)
            if node is None:
                return 0
        done = 0
        by_block = self._by_block
        for key, block_id in zip(keys, block_ids):
            child = node.children.get(key)
            if child is None:
                if block_id in by_block:
                    raise ValueError(f"block {block_id} is already in the prefix cache elsewhere")
                child = _Node(key, node, block_id)
                node.children[key] = child
                by_block[block_id] = child
            elif child.block_id != block_id:
                break
            node = child
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
        by_block = self._by_block
        for block_id in block_ids:
            node = by_block.get(block_id)
            if node is None or node.children:
                refused.append(block_id)
                continue
            parent = node.parent
            del parent.children[node.key]
            del by_block[block_id]
            node.parent = None
            removed.append(block_id)
        return removed, refused

    def lookup(self, namespace: Hashable, keys: Sequence[bytes]) -> int:
        """Number of leading blocks of ``keys`` that would hit; no side effects."""
        return len(self.match(namespace, keys))

    def is_leaf(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the tree and has no children."""
        node = self._by_block.get(block_id)
        return node is not None and not node.children

    def block_ids(self) -> list[int]:
        """Every block id in the tree (any order)."""
        return list(self._by_block)

    def path(self, block_id: int) -> list[int]:
        """Block ids from the namespace root down to ``block_id`` (inclusive).

        Raises:
            KeyError: ``block_id`` is not in the tree.
        """
        node = self._by_block[block_id]
        out = []
        while node.parent is not None:
            out.append(node.block_id)
            node = node.parent
        out.reverse()
        return out

    def check(self) -> None:
        """Consistency check: parent/child links and the block index agree.

        Raises:
            AssertionError: Naming the inconsistent block.
        """
        seen = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.parent is not node or child.key != key:
                    raise AssertionError(f"block {child.block_id}: broken parent link")
                if self._by_block.get(child.block_id) is not child:
                    raise AssertionError(f"block {child.block_id}: not indexed")
                seen += 1
                stack.append(child)
        if seen != len(self._by_block):
            raise AssertionError(f"{len(self._by_block)} indexed blocks but {seen} reachable")


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
    raw = tokens[: num_blocks * block_size].tobytes()
    return [raw[i : i + width] for i in range(0, num_blocks * width, width)]
