"""Cache event types: what changed in the set of cached content keys, in vLLM's field names.

The events follow ``vllm/distributed/kv_events.py`` (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, a batch with a timestamp), with akv's
additions: a ``namespace`` on :class:`BlockStored` (vLLM has ``lora_id``; an
akv namespace is any plain value, :mod:`akv.core.ids`), a sequence number on
every :class:`EventBatch`, and the gap marker :class:`EventsDropped`.

Keys (``block_hashes``, ``parent_block_hash``) are the 16-byte content keys of
:mod:`akv.core.block_key`. As in vLLM, one :class:`BlockStored` names a run of
blocks of one chain: ``block_hashes[0]``'s parent is ``parent_block_hash``
(``None`` for the first block of a prompt), ``block_hashes[i]``'s parent is
``block_hashes[i - 1]``, and ``token_ids`` holds the run's tokens back to back
(``block_size`` per key). Every key appears in exactly one event of a batch
per store or removal, so an index keyed by ``(medium, key)`` stays exact.

Every event validates its fields on construction and raises
:class:`~akv.errors.InvalidInput`, so a batch decoded from a file or a socket
is either well formed or refused whole.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from akv.core.block_key import KEY_BYTES
from akv.core.ids import describe, plain_id
from akv.errors import InvalidInput

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheEvent",
    "CachedKey",
    "EventBatch",
    "EventsDropped",
]

_TOKEN_LIMIT = 2**31  # token ids are keyed as int32 (akv.core.block_key)


def check_key(value: object, what: str, *, allow_none: bool = False) -> None:
    """Raise unless ``value`` is a 16-byte content key (or ``None`` where allowed).

    Raises:
        InvalidInput: ``value`` is not ``bytes`` of :data:`~akv.core.block_key.KEY_BYTES`.
    """
    if value is None and allow_none:
        return
    if type(value) is not bytes or len(value) != KEY_BYTES:
        raise InvalidInput(f"{what} must be {KEY_BYTES} bytes (a content key), got {describe(value)}")


def _check_keys(values: object, what: str) -> None:
    """Raise unless ``values`` is a non-empty list of content keys."""
    if type(values) is not list or not values:
        raise InvalidInput(f"{what} must be a non-empty list of {KEY_BYTES}-byte keys, got {describe(values)}")
    for value in values:
        check_key(value, f"a key in {what}")


def check_medium(medium: object) -> None:
    """Raise :class:`~akv.errors.InvalidInput` unless ``medium`` is a non-empty ``str``."""
    if type(medium) is not str or not medium:
        raise InvalidInput(f"medium must be a non-empty str (e.g. 'device', 'host'), got {describe(medium)}")


def _check_seq(value: object, what: str) -> None:
    if type(value) is not int or value < 1:
        raise InvalidInput(f"{what} must be an int >= 1, got {describe(value)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Blocks of one chain entered the cache of ``medium``.

    Attributes:
        block_hashes: Content keys of the run, parent first, each 16 bytes.
        parent_block_hash: Key of the block before ``block_hashes[0]`` in its
            chain, or ``None`` when ``block_hashes[0]`` is a prompt's first block.
        token_ids: The run's token ids back to back, ``block_size *
            len(block_hashes)`` ints in ``[0, 2**31)``.
        block_size: Tokens per block.
        medium: The tier holding the blocks: ``"device"``, ``"host"``, later ``"remote"``.
        namespace: The prefix-cache namespace, ``None`` or a plain value
            (:mod:`akv.core.ids`; numpy scalars are normalized).

    Raises:
        InvalidInput: A field is malformed (see each attribute).
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str
    namespace: Hashable = None

    def __post_init__(self) -> None:
        _check_keys(self.block_hashes, "block_hashes of BlockStored")
        check_key(self.parent_block_hash, "parent_block_hash of BlockStored", allow_none=True)
        if type(self.block_size) is not int or self.block_size < 1:
            raise InvalidInput(f"block_size of BlockStored must be an int >= 1, got {describe(self.block_size)}")
        tokens = self.token_ids
        if type(tokens) is not list or len(tokens) != self.block_size * len(self.block_hashes):
            raise InvalidInput(
                f"token_ids of BlockStored must be a list of block_size * len(block_hashes) = "
                f"{self.block_size * len(self.block_hashes)} ints, got {describe(tokens)}"
            )
        if not set(map(type, tokens)) <= {int} or min(tokens) < 0 or max(tokens) >= _TOKEN_LIMIT:
            raise InvalidInput(f"token_ids of BlockStored must be ints in [0, 2**31), got {describe(tokens)}")
        check_medium(self.medium)
        object.__setattr__(self, "namespace", plain_id(self.namespace, "namespace of BlockStored", allow_none=True))


def stored_unchecked(
    block_hashes: list[bytes],
    parent_block_hash: bytes | None,
    token_ids: list[int],
    block_size: int,
    medium: str,
    namespace: Hashable,
) -> BlockStored:
    """A :class:`BlockStored` of fields akv has already validated, built without the checks.

    For :class:`~akv.events.key_index.KeyIndex`, whose keys it computed and
    whose tokens, namespaces and medium it checked: per decode step this saves
    about 2 µs a block (``stress/bench_events.py``). Never for outside input.
    """
    event = _new(BlockStored)
    _set(event, "block_hashes", block_hashes)
    _set(event, "parent_block_hash", parent_block_hash)
    _set(event, "token_ids", token_ids)
    _set(event, "block_size", block_size)
    _set(event, "medium", medium)
    _set(event, "namespace", namespace)
    return event


_new, _set = object.__new__, object.__setattr__  # frozen slots: the dataclass's own __setattr__ refuses


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    """Blocks left the cache of ``medium`` (evicted, demoted away from it, or retired by an epoch).

    Attributes:
        block_hashes: Content keys removed, each 16 bytes.
        medium: The tier they left.

    Raises:
        InvalidInput: A field is malformed.
    """

    block_hashes: list[bytes]
    medium: str

    def __post_init__(self) -> None:
        _check_keys(self.block_hashes, "block_hashes of BlockRemoved")
        check_medium(self.medium)


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    """Every cached key of every medium was dropped (a prefix-cache reset)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EventsDropped:
    """Gap marker: this subscriber missed the batches ``from_seq..to_seq`` (inclusive).

    Never published by a cache; an :class:`~akv.events.hub.EventHub` hands it
    to a subscriber whose buffer was full, alone in a batch whose ``seq`` is
    ``to_seq``. The subscriber's index is stale until it resynchronizes.

    Attributes:
        from_seq: First missed sequence number (>= 1).
        to_seq: Last missed sequence number (>= ``from_seq``).

    Raises:
        InvalidInput: Not ints with ``1 <= from_seq <= to_seq``.
    """

    from_seq: int
    to_seq: int

    def __post_init__(self) -> None:
        _check_seq(self.from_seq, "from_seq of EventsDropped")
        _check_seq(self.to_seq, "to_seq of EventsDropped")
        if self.to_seq < self.from_seq:
            raise InvalidInput(f"EventsDropped: to_seq {self.to_seq} is before from_seq {self.from_seq}")


#: The events a cache publishes (an :class:`EventsDropped` only ever comes from a hub).
CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
#: Every event type, by its JSON ``type`` name.
EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared, EventsDropped)
}
_CACHE_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


def check_cache_events(events: tuple, what: str) -> None:
    """Raise unless every element of ``events`` is a :data:`CacheEvent`.

    Raises:
        InvalidInput: An element is another object (an :class:`EventsDropped` included).
    """
    for event in events:
        if type(event) not in _CACHE_EVENT_TYPES:
            raise InvalidInput(f"{what}: {describe(event)} is not a BlockStored, BlockRemoved or AllBlocksCleared")


@dataclass(frozen=True, slots=True, kw_only=True)
class EventBatch:
    """The events of one step or one background action, with its sequence number.

    Attributes:
        seq: Sequence number, consecutive per manager from 1 (0 names the
            empty state before the first batch). A gap marker's batch has
            ``seq == to_seq`` of its marker.
        ts: Wall-clock time of publishing, seconds since the epoch (finite).
        events: The events, in the order they happened: cache events, or one
            :class:`EventsDropped` alone.

    Raises:
        InvalidInput: A field is malformed, the batch is empty, or a gap
            marker is not alone or does not end at ``seq``.
    """

    seq: int
    ts: float
    events: tuple

    def __post_init__(self) -> None:
        _check_seq(self.seq, "seq of EventBatch")
        if type(self.ts) not in (float, int) or not math.isfinite(self.ts):
            raise InvalidInput(f"ts of EventBatch must be a finite number of seconds, got {describe(self.ts)}")
        if type(self.events) is not tuple or not self.events:
            raise InvalidInput(f"events of EventBatch must be a non-empty tuple, got {describe(self.events)}")
        first = self.events[0]
        if type(first) is EventsDropped:
            if len(self.events) != 1 or first.to_seq != self.seq:
                raise InvalidInput("an EventsDropped marker comes alone in a batch whose seq is its to_seq")
        else:
            check_cache_events(self.events, f"events of batch {self.seq}")

    @property
    def dropped(self) -> EventsDropped | None:
        """The gap marker when this batch is one, else ``None``."""
        first = self.events[0]
        return first if type(first) is EventsDropped else None


@dataclass(frozen=True, slots=True, kw_only=True)
class CachedKey:
    """One cached key of a snapshot (``cached_keys()``), what a router resynchronizes from.

    Attributes:
        block_hash: The key, 16 bytes.
        parent_block_hash: Its parent's key, or ``None`` for a prompt's first block.
        namespace: ``None`` or a plain value.
        medium: The tier holding it.

    Raises:
        InvalidInput: A field is malformed.
    """

    block_hash: bytes
    parent_block_hash: bytes | None
    namespace: Hashable
    medium: str

    def __post_init__(self) -> None:
        check_key(self.block_hash, "block_hash of CachedKey")
        check_key(self.parent_block_hash, "parent_block_hash of CachedKey", allow_none=True)
        check_medium(self.medium)
        object.__setattr__(self, "namespace", plain_id(self.namespace, "namespace of CachedKey", allow_none=True))
