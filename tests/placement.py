"""Prompts placed on a chosen shard: prefix-affine placement sends a prompt to its first block's shard.

``ShardMap.affine_shard`` picks the shard from the first block's content key
(xxh3_128), so a test that wants a layout picks prompts whose first block
belongs where it wants them; this module finds them.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from akv.core.shard_map import ShardMap


def affine_shard(prompt: list[int], num_shards: int, *, block_size: int = 4, namespace: Hashable = None) -> int | None:
    """The shard an admission of ``prompt`` goes to when that shard has room (None: shorter than a block)."""
    shard_map = ShardMap([1] * num_shards, block_size, 0)
    return shard_map.affine_shard(namespace, np.array(prompt, dtype=np.int32))


def on_shard(
    shard: int,
    num_tokens: int,
    num_shards: int,
    *,
    start: int = 0,
    block_size: int = 4,
    namespace: Hashable = None,
    vocab_size: int = 1000,
) -> list[int]:
    """``list(range(s, s + num_tokens))`` (mod ``vocab_size``) for the first ``s >= start`` placed on ``shard``.

    Args:
        shard: The shard wanted.
        num_tokens: Prompt length, at least ``block_size``.
        num_shards: Shards of the manager.
        start: First token id tried; prompts from far-apart starts share no prefix.
        block_size: Tokens per block.
        namespace: The prompt's namespace.
        vocab_size: Token ids stay below it.
    """
    for s in range(start, start + vocab_size):
        prompt = [(s + j) % vocab_size for j in range(num_tokens)]
        if affine_shard(prompt, num_shards, block_size=block_size, namespace=namespace) == shard:
            return prompt
    raise AssertionError(f"no prompt from {start} is placed on shard {shard} of {num_shards}")
