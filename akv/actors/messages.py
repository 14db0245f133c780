"""Messages served by the pool shard actor (frozen, slotted dataclasses)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from akv.core.step import StepRequest


@dataclass(frozen=True, slots=True)
class Step:
    """Apply a :class:`~akv.core.step.StepRequest`; reply ``StepOutcome`` plus a copy ticket.

    ``context`` is the caller's OpenTelemetry context: the shard's span is its child.
    """

    request: StepRequest
    context: Any = None


@dataclass(frozen=True, slots=True)
class Validate:
    """Check a :class:`~akv.core.step.StepRequest` without applying it; reply None or raise.

    Raises what its :class:`Step` would: input errors, and ``PoolExhausted``
    for a fork whose copy-on-write earmark cannot be had (checked exactly), so
    a multi-shard step validated on every shard applies on every shard.
    """

    request: StepRequest


@dataclass(frozen=True, slots=True)
class Evict:
    """Evict up to ``max_blocks`` cached blocks; reply the number evicted."""

    max_blocks: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """Reply the number of leading full blocks of ``prompt`` (int32 ``(n,)``) cached now; no side effects."""

    namespace: Hashable
    prompt: np.ndarray


@dataclass(frozen=True, slots=True)
class Inspect:
    """Reply a :class:`~akv.actors.pool_shard.SequenceInfo` snapshot of one sequence."""

    seq_id: Hashable


@dataclass(frozen=True, slots=True)
class InspectBlock:
    """Reply a :class:`~akv.results.BlockInfo` snapshot of one block this shard owns (read-only)."""

    block_id: int


@dataclass(frozen=True, slots=True)
class Room:
    """Reply ``(need, free, evictable)`` blocks for appending ``num_tokens`` to ``seq_id`` (see ``ShardState.room``)."""

    seq_id: Hashable
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Stats:
    """Reply a :class:`~akv.actors.pool_shard.ShardStats` snapshot (after settling finished copies)."""


@dataclass(frozen=True, slots=True)
class Check:
    """Run the full consistency check of the shard and its prefix tree; reply None or raise."""
