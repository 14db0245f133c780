"""Sequence state: identity, prefix-cache bookkeeping, and its row of the shard's tables.

The per-token data of a sequence does not live here: its block table and
token counts are a row of the shard's :class:`~akv.core.block_table.BlockTables`
(so a decode step updates a whole batch with vectorized operations), and its
token ids live in the shard's per-block token array, beside the blocks that
hold their K/V (see :class:`~akv.core.shard_state.ShardState`).
"""

from __future__ import annotations

from collections.abc import Hashable

from akv.core.block_table import BlockTableRow


class Sequence:
    """One generation stream (prompt plus generated tokens) and its blocks.

    Attributes:
        seq_id: Caller-chosen id (any hashable: request id, ``"req-7/beam-2"``).
        namespace: Prefix-cache namespace (tenant, adapter, model epoch).
        block_ids: Block table (a row of the shard's tables): block ids in
            logical order; block ``i`` holds tokens ``[i*block_size, (i+1)*block_size)``.
        num_published: Leading blocks that are in the prefix cache as this
            sequence's own blocks.
        publish_stopped: A leading block duplicated a cached one under another
            id; nothing after it is published.
        num_prompt_tokens: Prompt length at admission (tokens).
        num_cached_tokens: Prompt tokens served from the prefix cache.
        parent_id: The sequence this one was forked from, or None.
    """

    __slots__ = (
        "block_ids",
        "namespace",
        "num_cached_tokens",
        "num_prompt_tokens",
        "num_published",
        "parent_id",
        "publish_stopped",
        "seq_id",
    )

    def __init__(self, seq_id: Hashable, namespace: Hashable, num_prompt_tokens: int, block_ids: BlockTableRow) -> None:
        self.seq_id = seq_id
        self.namespace = namespace
        self.block_ids = block_ids
        self.num_published = 0
        self.publish_stopped = False
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.parent_id: Hashable | None = None

    @property
    def row(self) -> int:
        """Index of this sequence's row in the shard's tables."""
        return self.block_ids.row

    @property
    def num_tokens(self) -> int:
        """Tokens in the history (prompt plus appended)."""
        return int(self.block_ids.owner.num_tokens[self.block_ids.row])

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        self.block_ids.owner.num_tokens[self.block_ids.row] = value

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V the model runner has committed."""
        return int(self.block_ids.owner.num_computed[self.block_ids.row])

    @num_computed.setter
    def num_computed(self, value: int) -> None:
        self.block_ids.owner.num_computed[self.block_ids.row] = value

    def fork(self, child_id: Hashable, block_ids: BlockTableRow) -> Sequence:
        """A child sharing this sequence's history, its row copied into the empty row ``block_ids``.

        Both rows are marked as possibly sharing their tail block. The caller
        increfs the blocks.
        """
        child = Sequence.__new__(Sequence)
        child.seq_id = child_id
        child.namespace = self.namespace
        self.block_ids.copy_to(block_ids)
        owner = block_ids.owner
        owner.shared_tail[self.block_ids.row] = True
        owner.shared_tail[block_ids.row] = True
        child.block_ids = block_ids
        child.num_published = self.num_published
        child.publish_stopped = self.publish_stopped
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.parent_id = self.seq_id
        return child
