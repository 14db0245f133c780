"""A safe prefix-cache reset of one shard: what ``clear_prefix_cache`` and ``bump_epoch`` do to a :class:`ShardState`.

A reset **retires** the blocks of the prefix tree (all of them, or those of
one namespace) while requests run:

- every retired block leaves the tree at once, so no prompt matches it again;
- a cached (unreferenced) retired block is freed at once, on either tier
  (with a host tier the tree holds host blocks too, :mod:`akv.core.tiers`);
- a referenced one stays valid for the sequences that hold it and is freed,
  not cached, when the last of them releases it (so is a block a pending copy
  still pins);
- the live sequences of a retired namespace never publish again (their
  ``publish_stopped`` is set, as for a chain that met a duplicate), so a block
  they fill after the reset is never matched either; their forks inherit it.

Synchronous and pure: the pool shard actor runs it for one message, and tests
run it on a bare :class:`~akv.core.shard_state.ShardState`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from akv.core.shard_state import ShardState

__all__ = ["ALL_NAMESPACES", "retire_blocks"]

#: The ``namespace`` of :func:`retire_blocks` that retires every namespace.
ALL_NAMESPACES = object()


def retire_blocks(state: ShardState, namespace: Hashable = ALL_NAMESPACES) -> tuple[list[int], int]:
    """Retire the prefix-cache blocks of ``namespace`` (or all) from ``state``; see the module docstring.

    O(blocks retired + live sequences).

    Args:
        state: The shard.
        namespace: A plain namespace value (:mod:`akv.core.ids`), already
            validated, or :data:`ALL_NAMESPACES`.

    Returns:
        ``(retired block ids, blocks freed now)``: every block that left the
        tree (children before parents; host ids too), and how many of them
        were cached (device and host blocks).
    """
    everything = namespace is ALL_NAMESPACES
    tree = state.tree
    order = tree.removal_order(None if everything else [state.namespace_key(namespace)])
    removed, refused = tree.remove_leaves(order)
    if refused:
        raise AssertionError(f"shard {state.shard_index}: a subtree removal refused blocks {refused[:8]}")
    hb = state.host_base
    if hb is None:
        freed = state.pool.unpublish(removed)
    else:  # the tree holds both tiers: host ids go back to the host tier
        freed = state.pool.unpublish([b for b in removed if b < hb])
        freed += state.host.unpublish([b for b in removed if b >= hb])
        if state.unready:
            state.unready.difference_update(removed)
    for seq in state.sequences.values():
        if everything or seq.namespace == namespace:
            seq.publish_stopped = True
            seq.num_published = 0
    return removed, freed
