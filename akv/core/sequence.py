"""Sequence state: token history, block table, computed and published counts.

Token ids are kept in a growable int32 numpy array (capacity doubles), so
appending is amortized O(1); the block table is a row of the shard's
:class:`~akv.core.block_table.BlockTables`.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from akv.core.block_table import BlockTableRow


class GrowableInt32:
    """Append-only int32 vector with amortized O(1) append.

    Args:
        initial: Initial contents (copied), any int array-like.
        capacity: Minimum initial capacity (elements).
    """

    __slots__ = ("_buf", "_len")

    def __init__(self, initial=(), capacity: int = 16) -> None:
        data = np.asarray(initial, dtype=np.int32).ravel()
        cap = max(capacity, 2 * len(data), 16)
        self._buf = np.empty(cap, dtype=np.int32)
        self._buf[: len(data)] = data
        self._len = len(data)

    def __len__(self) -> int:
        return self._len

    def view(self) -> np.ndarray:
        """The contents, shape ``(len,)`` int32; a view, valid until the next append."""
        return self._buf[: self._len]

    def tolist(self) -> list[int]:
        """The contents as Python ints."""
        return self._buf[: self._len].tolist()

    def append(self, value: int) -> None:
        """Append one element."""
        if self._len == len(self._buf):
            self._grow(self._len + 1)
        self._buf[self._len] = value
        self._len += 1

    def extend(self, values) -> None:
        """Append an int array-like."""
        values = np.asarray(values, dtype=np.int32).ravel()
        n = self._len + len(values)
        if n > len(self._buf):
            self._grow(n)
        self._buf[self._len : n] = values
        self._len = n

    def copy(self) -> GrowableInt32:
        """An independent copy."""
        return GrowableInt32(self.view(), capacity=len(self._buf))

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * len(self._buf))
        buf = np.empty(cap, dtype=np.int32)
        buf[: self._len] = self._buf[: self._len]
        self._buf = buf


class Sequence:
    """One generation stream (prompt plus generated tokens) and its blocks.

    Attributes:
        seq_id: Caller-chosen id (any hashable: request id, ``"req-7/beam-2"``).
        namespace: Prefix-cache namespace (tenant, adapter, model epoch).
        tokens: Token history, int32.
        block_ids: Block table (a row of the shard's tables): block ids in
            logical order; block ``i`` holds tokens ``[i*block_size, (i+1)*block_size)``.
        num_computed: Tokens whose K/V the model runner has committed.
        num_published: Leading blocks that are in the prefix cache as this
            sequence's own blocks.
        publish_stopped: A leading block duplicated a cached one under another
            id; nothing after it is published.
        num_prompt_tokens: Prompt length at admission.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        parent_id: The sequence this one was forked from, or None.
    """

    __slots__ = (
        "block_ids",
        "namespace",
        "num_cached_tokens",
        "num_computed",
        "num_prompt_tokens",
        "num_published",
        "parent_id",
        "prompt_keys",
        "publish_stopped",
        "seq_id",
        "tokens",
    )

    def __init__(self, seq_id: Hashable, namespace: Hashable, prompt: np.ndarray, block_ids: BlockTableRow) -> None:
        self.seq_id = seq_id
        self.namespace = namespace
        self.tokens = GrowableInt32(prompt, capacity=len(prompt) + 64)
        self.block_ids = block_ids
        self.num_computed = 0
        self.num_published = 0
        self.publish_stopped = False
        self.num_prompt_tokens = len(prompt)
        self.num_cached_tokens = 0
        self.parent_id: Hashable | None = None
        #: Radix-tree keys of the prompt's full blocks, computed once at admission.
        self.prompt_keys: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        """Tokens in the history (prompt plus appended)."""
        return len(self.tokens)

    def fork(self, child_id: Hashable, block_ids: BlockTableRow) -> Sequence:
        """A child sharing this sequence's history, its table copied into the empty row ``block_ids``.

        The caller increfs the blocks.
        """
        child = Sequence.__new__(Sequence)
        child.seq_id = child_id
        child.namespace = self.namespace
        child.tokens = self.tokens.copy()
        self.block_ids.copy_to(block_ids)
        child.block_ids = block_ids
        child.num_computed = self.num_computed
        child.num_published = self.num_published
        child.publish_stopped = self.publish_stopped
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.parent_id = self.seq_id
        child.prompt_keys = self.prompt_keys
        return child
