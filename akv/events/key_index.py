"""Per-shard index from published block ids to content keys: what turns a step's block ids into events.

A shard publishes and evicts *block ids*; events and routers speak *content
keys* (:mod:`akv.core.block_key`). A :class:`KeyIndex` keeps, for each block
id of the shard that is in the prefix cache, its key, its parent's key and its
namespace, so that a step's stored blocks get their keys chained from their
parents' (``block_key(parent_key, tokens, namespace)``, exactly
``chain_keys(prompt, block_size, namespace)`` along a prompt) and a removed
block's key is known after its tokens are gone.

Memory is fixed by the shard's size, not by traffic: ``(num_blocks, 16)``
uint8 keys, the same for parent keys, a flag per block and a list slot for
the namespace, all indexed by ``block_id - first_block_id`` (about 40 bytes
per block, 40 MiB for a million blocks).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from akv.core.block_key import KEY_BYTES, block_key_raw, chain_keys_raw, chain_suffix
from akv.core.ids import describe, plain_id
from akv.errors import InvalidInput

from .types import BlockRemoved, BlockStored, CachedKey, check_medium, stored_unchecked

__all__ = ["KeyIndex"]

_TOKEN_LIMIT = 2**31
_NO_KEY = bytes(KEY_BYTES)  # the parent-key slot of a prompt's first block


class KeyIndex:
    """Content keys of one shard's cached blocks, by block id.

    Args:
        num_blocks: Blocks of the shard (an int >= 1).
        block_size: Tokens per block (an int >= 1).
        first_block_id: The shard's first block id (its blocks are
            ``first_block_id .. first_block_id + num_blocks - 1``).

    Raises:
        InvalidInput: An argument is not an int in range.
    """

    __slots__ = ("_has_parent", "_keys", "_namespaces", "_parent_keys", "_stored", "block_size", "first_block_id")

    def __init__(self, num_blocks: int, block_size: int, *, first_block_id: int = 0) -> None:
        for name, value, low in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1)):
            if type(value) is not int or value < low:
                raise InvalidInput(f"{name} of KeyIndex must be an int >= {low}, got {describe(value)}")
        if type(first_block_id) is not int or first_block_id < 0:
            raise InvalidInput(f"first_block_id of KeyIndex must be an int >= 0, got {describe(first_block_id)}")
        self.block_size = block_size
        self.first_block_id = first_block_id
        self._keys = np.zeros((num_blocks, KEY_BYTES), dtype=np.uint8)  # (num_blocks, 16) content keys
        self._parent_keys = np.zeros((num_blocks, KEY_BYTES), dtype=np.uint8)  # (num_blocks, 16)
        self._has_parent = np.zeros(num_blocks, dtype=bool)  # False: a prompt's first block
        self._stored = np.zeros(num_blocks, dtype=bool)
        self._namespaces: list[Hashable] = [None] * num_blocks

    def __len__(self) -> int:
        """Blocks indexed (the shard's cached blocks)."""
        return int(np.count_nonzero(self._stored))

    def __contains__(self, block_id: object) -> bool:
        offset = block_id - self.first_block_id if type(block_id) is int else -1
        return 0 <= offset < len(self._stored) and bool(self._stored[offset])

    def key(self, block_id: int) -> bytes:
        """The key of a stored block.

        Raises:
            InvalidInput: ``block_id`` is not stored.
        """
        if block_id not in self:
            raise InvalidInput(f"block {describe(block_id)} is not in the key index")
        return self._keys[block_id - self.first_block_id].tobytes()

    def namespace(self, block_id: int) -> Hashable:
        """The namespace of a stored block (``None`` for one not stored). O(1)."""
        return self._namespaces[block_id - self.first_block_id]

    def _offsets(self, block_ids: Any, what: str) -> tuple[list[int], list[int]]:
        """``(block ids, offsets)`` of ``block_ids``: a list or tuple of ints, or a 1-D integer array, of this shard, distinct."""
        ids = None
        if isinstance(block_ids, np.ndarray):
            if block_ids.ndim == 1 and (block_ids.dtype.kind in "iu" or block_ids.size == 0):
                ids = [int(b) for b in block_ids.tolist()]
        elif type(block_ids) in (list, tuple) and set(map(type, block_ids)) <= {int}:
            ids = list(block_ids)
        if ids is None:
            raise InvalidInput(
                f"{what}: block ids must be a list of ints or a 1-D integer array, got {describe(block_ids)}"
            )
        first, size = self.first_block_id, len(self._stored)
        offsets = [b - first for b in ids]
        bad = [b for b, o in zip(ids, offsets) if not 0 <= o < size]
        if bad:
            raise InvalidInput(f"{what}: block ids {bad[:8]} are not blocks of this shard")
        if len(set(offsets)) != len(offsets):
            raise InvalidInput(f"{what}: a block id is listed twice in {describe(ids)}")
        return ids, offsets

    def _check_rows(self, token_rows: Any, n: int) -> np.ndarray:
        """``token_rows`` as int32 ``(n, block_size)``, validated."""
        rows = np.asarray(token_rows) if isinstance(token_rows, np.ndarray) else None
        if rows is None or rows.dtype.kind not in "iu" or rows.shape != (n, self.block_size):
            shape = getattr(token_rows, "shape", None)
            raise InvalidInput(
                f"token_rows must be an integer numpy array of shape ({n}, {self.block_size}), "
                f"got {type(token_rows).__name__} of shape {shape}"
            )
        if n and (int(rows.min()) < 0 or int(rows.max()) >= _TOKEN_LIMIT):
            raise InvalidInput("token_rows hold token ids outside [0, 2**31)")
        return rows.astype(np.int32, copy=False)

    def stored(
        self,
        block_ids: Sequence[int],
        parent_block_ids: Sequence[int | None],
        token_rows: np.ndarray,
        namespaces: Sequence[Hashable],
    ) -> list[bytes]:
        """Index newly published blocks; return their keys, each chained from its parent's.

        All or nothing: on an error nothing is indexed. O(n) hash calls.

        Args:
            block_ids: The blocks, ``n`` ints of this shard, none already stored.
            parent_block_ids: Per block, its parent block id (already stored,
                or listed earlier in this call), or ``None`` for a prompt's first block.
            token_rows: The blocks' tokens, integer ``(n, block_size)``.
            namespaces: Per block, ``None`` or a plain value (:mod:`akv.core.ids`).

        Returns:
            The ``n`` keys, 16 bytes each, in ``block_ids`` order.

        Raises:
            InvalidInput: A block is not of this shard, already stored or
                listed twice; a parent is not stored nor earlier in the call;
                the lengths differ; bad rows or namespaces.
        """
        return self._store(block_ids, parent_block_ids, token_rows, namespaces)[0]

    def _store(self, block_ids: Any, parent_block_ids: Any, token_rows: Any, namespaces: Any) -> tuple[list, list]:
        """:meth:`stored`, also returning the chain runs ``(start, end, parent key)`` the keys were hashed in."""
        ids, offsets = self._offsets(block_ids, "KeyIndex.stored")
        n = len(offsets)
        parents, namespaces = list(parent_block_ids), list(namespaces)
        if len(parents) != n or len(namespaces) != n:
            raise InvalidInput(
                f"KeyIndex.stored: {n} blocks but {len(parents)} parents and {len(namespaces)} namespaces"
            )
        rows = self._check_rows(token_rows, n)
        namespaces = [plain_id(ns, "a namespace of KeyIndex.stored", allow_none=True) for ns in namespaces]
        if n and self._stored[offsets].any():
            already = [b for b, o in zip(ids, offsets) if self._stored[o]]
            raise InvalidInput(f"KeyIndex.stored: blocks {already[:8]} are already stored")
        starts = [i for i in range(n) if not i or parents[i] != ids[i - 1] or namespaces[i] != namespaces[i - 1]]
        stored_parents, earlier_parents = self._run_parents(starts, parents, offsets)
        raw, width, bs = rows.astype("<i4", copy=False).tobytes(), 4 * self.block_size, self.block_size
        suffixes: dict[Hashable, bytes] = {}
        keys: list[bytes] = []
        parent_keys: list[bytes | None] = []
        runs: list[tuple[int, int, bytes | None]] = []
        for r, begin in enumerate(starts):  # a run: each block the parent of the next, one namespace: one hash pass
            stop = starts[r + 1] if r + 1 < len(starts) else n
            namespace = namespaces[begin]
            if namespace not in suffixes:
                suffixes[namespace] = chain_suffix(namespace)
            parent_key = stored_parents.get(r) or (keys[earlier_parents[r]] if r in earlier_parents else None)
            run = chain_keys_raw(raw[begin * width : stop * width], bs, suffixes[namespace], parent_key)
            keys += run
            parent_keys.append(parent_key)
            parent_keys += run[:-1]
            runs.append((begin, stop, parent_key))
        self._commit(offsets, keys, parent_keys, namespaces)
        return keys, runs

    def _run_parents(self, starts: list[int], parents: list, offsets: list[int]) -> tuple[dict, dict]:
        """The parents of the runs that have one: ``({run: parent key}, {run: parent's index in the call})``.

        The first for parents stored before (one gather: a decode step's blocks
        each start a run), the second for parents listed earlier in the call.

        Raises:
            InvalidInput: A parent is neither stored nor earlier in the call.
        """
        position = {o: i for i, o in enumerate(offsets)}
        first, size = self.first_block_id, len(self._stored)
        earlier: dict[int, int] = {}
        runs, stored_offsets = [], []
        for r, begin in enumerate(starts):
            parent = parents[begin]
            if parent is None:
                continue
            ok = isinstance(parent, (int, np.integer)) and type(parent) is not bool
            offset = int(parent) - first if ok else -1
            i = position.get(offset)
            if i is not None and i < begin:
                earlier[r] = i
            elif i is None and 0 <= offset < size:
                runs.append(r)
                stored_offsets.append(offset)
            else:
                raise InvalidInput(f"KeyIndex.stored: parent block {describe(parent)} is neither stored nor earlier")
        if stored_offsets and not self._stored[stored_offsets].all():
            bad = [o + first for o in stored_offsets if not self._stored[o]]
            raise InvalidInput(f"KeyIndex.stored: parent blocks {bad[:8]} are neither stored nor earlier")
        gathered = self._keys[stored_offsets].tobytes() if stored_offsets else b""
        return {r: gathered[KEY_BYTES * j : KEY_BYTES * (j + 1)] for j, r in enumerate(runs)}, earlier

    def _commit(self, offsets: list[int], keys: list[bytes], parent_keys: list, namespaces: list) -> None:
        """Write the new blocks' keys, parent keys and namespaces (vectorized but for the namespaces)."""
        n = len(offsets)
        self._keys[offsets] = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, KEY_BYTES)
        self._parent_keys[offsets] = np.frombuffer(
            b"".join(_NO_KEY if p is None else p for p in parent_keys), dtype=np.uint8
        ).reshape(n, KEY_BYTES)
        self._has_parent[offsets] = [p is not None for p in parent_keys]
        spaces = self._namespaces
        for offset, namespace in zip(offsets, namespaces):
            spaces[offset] = namespace
        self._stored[offsets] = True

    def removed(self, block_ids: Sequence[int]) -> list[bytes]:
        """Forget blocks that left the prefix cache; return their keys.

        All or nothing. O(n).

        Args:
            block_ids: Stored blocks of this shard, distinct.

        Returns:
            Their keys, in ``block_ids`` order.

        Raises:
            InvalidInput: A block is not stored, not of this shard, or listed twice.
        """
        ids, offsets = self._offsets(block_ids, "KeyIndex.removed")
        if offsets and not self._stored[offsets].all():
            missing = [b for b, o in zip(ids, offsets) if not self._stored[o]]
            raise InvalidInput(f"KeyIndex.removed: blocks {missing[:8]} are not stored")
        gathered = self.take(ids)[0].tobytes()
        return [gathered[KEY_BYTES * j : KEY_BYTES * (j + 1)] for j in range(len(offsets))]

    def take(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
        """Forget distinct stored blocks, e.g. moving to another index (a tier move); O(n), all or nothing.

        Returns:
            ``(keys, parent_keys, has_parent, namespaces)``: uint8 ``(n, 16)`` twice, bool
            ``(n,)`` (False: a prompt's first block), a list; in order; what :meth:`put` takes.

        Raises:
            InvalidInput: A block is not stored (nothing is forgotten).
        """
        offsets = np.asarray(block_ids, dtype=np.intp) - self.first_block_id
        if len(offsets) and not self._stored[offsets].all():
            raise InvalidInput(f"KeyIndex.take: a block of {block_ids[:8]} is not stored")
        spaces, namespaces = self._namespaces, []
        for offset in offsets.tolist():
            namespaces.append(spaces[offset])
            spaces[offset] = None
        self._stored[offsets] = False
        return self._keys[offsets], self._parent_keys[offsets], self._has_parent[offsets], namespaces

    def put(self, block_ids: list[int], entries: tuple[np.ndarray, np.ndarray, np.ndarray, list]) -> None:
        """Index blocks that moved here with the entries :meth:`take` returned (all or nothing, O(n)).

        Raises:
            InvalidInput: A block is stored already (nothing is indexed).
        """
        offsets = np.asarray(block_ids, dtype=np.intp) - self.first_block_id
        if len(offsets) and self._stored[offsets].any():
            raise InvalidInput(f"KeyIndex.put: a block of {block_ids[:8]} is stored already")
        self._keys[offsets], self._parent_keys[offsets], self._has_parent[offsets], namespaces = entries
        spaces = self._namespaces
        for offset, namespace in zip(offsets.tolist(), namespaces):
            spaces[offset] = namespace
        self._stored[offsets] = True

    def stored_mask(self, block_ids: np.ndarray) -> np.ndarray:
        """Whether each of the shard's ``block_ids`` (an int array) is stored: bool ``(n,)``. O(n)."""
        return self._stored[block_ids - self.first_block_id]

    def clear(self) -> int:
        """Forget every block (a prefix-cache reset); return how many were indexed."""
        count = len(self)
        self._stored[:] = False
        self._namespaces = [None] * len(self._stored)
        return count

    def cached(self) -> Iterator[tuple[bytes, bytes | None, Hashable, int]]:
        """Every indexed block as ``(key, parent_key | None, namespace, block_id)``, ascending block id."""
        for offset in np.flatnonzero(self._stored).tolist():
            parent = self._parent_keys[offset].tobytes() if self._has_parent[offset] else None
            yield self._keys[offset].tobytes(), parent, self._namespaces[offset], offset + self.first_block_id

    def cached_keys(self, medium: str = "device") -> list[CachedKey]:
        """:meth:`cached` as snapshot entries for a router's resync (see ``docs/events.md``)."""
        return [
            CachedKey(block_hash=k, parent_block_hash=p, namespace=ns, medium=medium) for k, p, ns, _ in self.cached()
        ]

    def stored_events(
        self,
        block_ids: Sequence[int],
        parent_block_ids: Sequence[int | None],
        token_rows: np.ndarray,
        namespaces: Sequence[Hashable],
        *,
        medium: str = "device",
    ) -> list[BlockStored]:
        """:meth:`stored`, and the :class:`BlockStored` events naming the keys.

        Consecutive blocks of one chain (each the parent of the next, one
        namespace) share an event, as in vLLM; every key is in exactly one event.

        Args:
            block_ids, parent_block_ids, token_rows, namespaces: As for :meth:`stored`.
            medium: The tier the blocks are in.

        Returns:
            The events, in ``block_ids`` order (empty for no blocks).

        Raises:
            InvalidInput: As :meth:`stored` (nothing is indexed).
        """
        check_medium(medium)
        keys, runs = self._store(block_ids, parent_block_ids, token_rows, namespaces)
        first, bs, spaces = self.first_block_id, self.block_size, self._namespaces
        ids = [int(b) for b in block_ids]
        tokens = np.asarray(token_rows).reshape(-1).tolist()
        return [
            stored_unchecked(
                keys[start:end], parent, tokens[start * bs : end * bs], bs, medium, spaces[ids[start] - first]
            )
            for start, end, parent in runs
        ]

    def stored_below(
        self, block_ids: list[int], parent_block_ids: list[int], token_rows: np.ndarray, namespaces: list, medium: str
    ) -> list[BlockStored]:
        """:meth:`stored_events` for one-block runs below stored parents (a decode step's newly full blocks).

        For the shard's own use (:mod:`akv.events.shard_events`): the ids, rows
        and namespaces come from its tree, so only what the tree cannot
        guarantee is checked (each parent stored, no block stored already).
        One hash call and one event per block, no per-run bookkeeping: about
        half the cost of :meth:`stored_events` for a decode step.

        Args:
            block_ids: ``n`` distinct blocks of this shard, none stored.
            parent_block_ids: Per block, its parent: a stored block not in ``block_ids``.
            token_rows: int32 ``(n, block_size)``: the blocks' tokens.
            namespaces: Per block, its plain namespace value.
            medium: The tier.

        Raises:
            InvalidInput: A parent is not stored or a block is stored already (nothing is indexed).
        """
        first, bs = self.first_block_id, self.block_size
        offsets = np.asarray(block_ids, dtype=np.intp) - first
        parents = np.asarray(parent_block_ids, dtype=np.intp) - first
        if not self._stored[parents].all() or self._stored[offsets].any():
            raise InvalidInput("KeyIndex.stored_below: a parent is not stored or a block is stored already")
        gathered = self._keys[parents].tobytes()
        raw = np.ascontiguousarray(token_rows, dtype="<i4").tobytes()
        width = 4 * bs
        suffixes: dict = {}
        keys: list[bytes] = []
        for i, namespace in enumerate(namespaces):
            suffix = suffixes.get(namespace)
            if suffix is None:
                suffix = suffixes[namespace] = chain_suffix(namespace)
            j = KEY_BYTES * i
            keys.append(block_key_raw(gathered[j : j + KEY_BYTES], raw[width * i : width * (i + 1)], suffix))
        n = len(keys)
        self._keys[offsets] = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, KEY_BYTES)
        self._parent_keys[offsets] = self._keys[parents]
        self._has_parent[offsets] = True
        spaces = self._namespaces
        for offset, namespace in zip(offsets.tolist(), namespaces):
            spaces[offset] = namespace
        self._stored[offsets] = True
        tokens = token_rows.tolist()
        return [
            stored_unchecked([key], gathered[KEY_BYTES * i : KEY_BYTES * (i + 1)], tokens[i], bs, medium, namespaces[i])
            for i, key in enumerate(keys)
        ]

    def removed_events(self, block_ids: Sequence[int], *, medium: str = "device") -> list[BlockRemoved]:
        """:meth:`removed`, and one :class:`BlockRemoved` naming the keys (none for no blocks).

        Raises:
            InvalidInput: As :meth:`removed`, or ``medium`` is not a non-empty
                ``str`` (nothing is forgotten).
        """
        check_medium(medium)
        keys = self.removed(block_ids)
        return [BlockRemoved(block_hashes=keys, medium=medium)] if keys else []
