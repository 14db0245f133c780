"""Sending a step's parts to their shards: exactly one ``Step`` message per shard, all parts or none.

Used by :meth:`KVCacheManager._step_sharded <akv.manager.KVCacheManager>` once
:class:`~akv.core.shard_map.ShardMap` has split a step, under the manager's
sharded lock (so no other step reaches a shard before this one is decided).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from akv.actors.messages import Step, StepVote
from akv.actors.pool_shard import PoolShardActor
from akv.core.step import StepRequest

__all__ = ["apply_parts"]


async def apply_parts(
    shards: Sequence[PoolShardActor], parts: Sequence[tuple[int, StepRequest]], context: Any
) -> tuple[list[tuple[int, tuple[Any, Any]]], bool]:
    """Apply every part of a split step through its shard, or none (one message per shard).

    One part is one plain :class:`Step` (its shard validates and applies it,
    raising its input error with nothing applied). Several share a
    :class:`StepVote`: each shard validates its part and votes, the last voter
    applies every part, or none if a part was refused; that refusal (the
    lowest refused part's) is raised here. If every shard can serve now
    (``Actor.can_serve_now``), the messages are served on this task with no
    await in between; otherwise they go through the shards' inboxes inside a
    shielded scope (all parts or none even if the caller is cancelled; the
    caller re-raises a cancellation afterwards).

    Args:
        shards: The pool shard actors, by shard index.
        parts: ``(shard index, StepRequest)`` pairs, one per shard, in shard order.
        context: The caller's OpenTelemetry context (the shards' spans are its children).

    Returns:
        ``(replies, direct)``: ``(shard index, (StepOutcome, copy ticket or None))``
        per part in part order, and whether they were served on this task.

    Raises:
        AkvError: The input error of a refused part (nothing applied anywhere).
        ActorCrashed, ManagerClosed: A shard is not running.
    """
    direct = all(shards[shard].can_serve_now for shard, _ in parts)
    if len(parts) == 1:
        shard, request = parts[0]
        msg = Step(request, context)
        if direct:
            return [(shard, shards[shard].serve(msg))], True
        with anyio.CancelScope(shield=True):
            return [(shard, await shards[shard].ask(msg))], False
    vote = StepVote(len(parts))
    msgs = [(shards[shard], Step(request, context, vote, i)) for i, (shard, request) in enumerate(parts)]
    if direct:  # every part served on this task with no await in between: all or nothing
        for actor, msg in msgs:
            actor.serve(msg)
    else:
        with anyio.CancelScope(shield=True):  # all shards' parts, or none
            for actor, msg in msgs:
                await actor.ask(msg)
    if vote.error is not None:
        raise vote.error
    return [(shard, vote.results[i]) for i, (shard, _) in enumerate(parts)], direct
