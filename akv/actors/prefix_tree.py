"""Prefix-tree actor: sole owner of the radix tree (the prefix cache index).

It serves batches of tree operations from the pool shards (match, insert,
remove) and pure lookups from the manager (for cache-aware routers). It asks
no other actor, so it can never be part of an ask cycle.
"""

from __future__ import annotations

from typing import Any

from akv.actors.runtime import Actor
from akv.core.radix_tree import RadixTree
from akv.core.shard_state import apply_tree_ops


class PrefixTreeActor(Actor):
    """Owns a :class:`~akv.core.radix_tree.RadixTree`.

    Messages: a list of tree operations (see :mod:`akv.core.shard_state`),
    answered with the list of their results; or ``("snapshot",)`` answered
    with every block id in the tree (for consistency checks).
    """

    def __init__(self, inbox_capacity: int, logger: Any = None) -> None:
        super().__init__("prefix_tree", inbox_capacity, logger)
        self.tree = RadixTree()

    async def handle(self, msg: Any) -> Any:
        """Apply one batch of tree operations in order."""
        if isinstance(msg, tuple) and msg and msg[0] == "snapshot":
            self.tree.check()
            return self.tree.block_ids()
        return apply_tree_ops(self.tree, msg)
