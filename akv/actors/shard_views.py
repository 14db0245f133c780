"""Read-only views of a pool shard for callers: one sequence, one block (what ``Inspect`` and ``InspectBlock`` reply).

Functions of the shard's :class:`~akv.core.shard_state.ShardState`, run by
the :class:`~akv.actors.pool_shard.PoolShardActor` inside its message, so
they read a consistent state and return frozen values.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from akv.core.block_key import chain_keys_raw, chain_suffix
from akv.core.block_pool import STATE_NAMES
from akv.core.reservation import row_reserved
from akv.core.shard_state import ShardState
from akv.errors import InvalidInput
from akv.results import BlockInfo

__all__ = ["SequenceInfo", "inspect_block", "inspect_sequence"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceInfo:
    """Snapshot of one sequence.

    Attributes:
        seq_id: The sequence.
        shard: Its shard index.
        num_tokens: Tokens in its history.
        num_computed: Tokens committed by the runner.
        num_cached_tokens: Prompt tokens served from the prefix cache at admission.
        num_published_blocks: Leading blocks in the prefix cache as its own.
        block_ids: Its block table (logical order).
        token_ids: Its token history.
        parent_id: Parent if forked.
        max_tokens: Tokens its reservation covers (prompt plus
            ``max_new_tokens``), or None without one.
        reserved_blocks: Free blocks earmarked for it now.
    """

    seq_id: Hashable
    shard: int
    num_tokens: int
    num_computed: int
    num_cached_tokens: int
    num_published_blocks: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    parent_id: Hashable | None
    max_tokens: int | None = None
    reserved_blocks: int = 0


def inspect_sequence(state: ShardState, seq_id: Hashable) -> SequenceInfo:
    """A :class:`SequenceInfo` of live ``seq_id``.

    Raises:
        UnknownSequence: ``seq_id`` is not live in this shard.
    """
    seq = state.get(seq_id)
    tables, row = state.tables, seq.row
    max_tokens = int(tables.max_tokens[row])
    return SequenceInfo(
        seq_id=seq.seq_id,
        shard=state.shard_index,
        num_tokens=seq.num_tokens,
        num_computed=seq.num_computed,
        num_cached_tokens=seq.num_cached_tokens,
        num_published_blocks=seq.num_published,
        block_ids=tuple(seq.block_ids.tolist()),
        token_ids=tuple(state.token_ids(seq).tolist()),
        parent_id=seq.parent_id,
        max_tokens=max_tokens or None,
        reserved_blocks=row_reserved(tables, row, state.block_size),
    )


def inspect_block(state: ShardState, block_id: int) -> BlockInfo:
    """State, refcount and, for a published block, the content key computed from its chain in the tree.

    Raises:
        InvalidInput: ``block_id`` is not one of the shard's device blocks.
    """
    pool, block_size = state.pool, state.block_size
    if type(block_id) is not int or not pool.owns(block_id):
        raise InvalidInput(f"block {block_id!r} is not a block of shard {state.shard_index}")
    key, depth, namespace = None, 0, None
    tree = state.tree
    if block_id in tree:
        # Tree namespaces are (shard index, namespace) (ShardState.namespace_key); keys carry no shard.
        (_, namespace), raw = tree.chain(block_id)
        depth = len(raw) // (4 * block_size)
        key = chain_keys_raw(raw, block_size, chain_suffix(namespace))[-1]
    return BlockInfo(
        block_id=block_id,
        shard=state.shard_index,
        state=STATE_NAMES[pool.state(block_id)],
        refcount=pool.refcount(block_id),
        key=key,
        depth=depth,
        num_tokens_in_chain=depth * block_size,
        namespace=namespace,
    )
