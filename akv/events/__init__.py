"""Cache events: typed, sequenced batches of changes to a manager's cached keys (docs/events.md).

- :mod:`akv.events.types`: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
  the gap marker ``EventsDropped``, ``EventBatch`` and the snapshot entry ``CachedKey``.
- :mod:`akv.events.jsonl`: the JSON form of a batch and JSON-lines files of batches.
- :mod:`akv.events.log`: ``EventLog``, numbering and the replay window.
- :mod:`akv.events.hub`: ``EventHub`` and its bounded ``Subscription`` streams.
- :mod:`akv.events.key_index`: ``KeyIndex``, a shard's block ids to content keys.
- :mod:`akv.events.index`: ``InstanceIndex``, one instance's keys rebuilt from its batches
  (what :class:`akv.routing.CacheAwareRouter` keeps per instance).
"""

from akv.events.hub import DEFAULT_BUFFER, EventHub, Subscription
from akv.events.index import InstanceIndex
from akv.events.jsonl import from_json, read_jsonl, to_json, write_jsonl
from akv.events.key_index import KeyIndex
from akv.events.log import DEFAULT_WINDOW, EventLog
from akv.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedKey,
    CacheEvent,
    EventBatch,
    EventsDropped,
)

__all__ = [
    "DEFAULT_BUFFER",
    "DEFAULT_WINDOW",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheEvent",
    "CachedKey",
    "EventBatch",
    "EventHub",
    "EventLog",
    "EventsDropped",
    "InstanceIndex",
    "KeyIndex",
    "Subscription",
    "from_json",
    "read_jsonl",
    "to_json",
    "write_jsonl",
]
