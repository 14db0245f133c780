"""A manager's parts built at entry: the copy executor (waiting for its copy process) and the pool shard actors.

Used by :meth:`KVCacheManager.__aenter__ <akv.manager.KVCacheManager>`, in
that order: the executor first (every shard submits its copies to it), then
one :class:`~akv.actors.pool_shard.PoolShardActor` per shard range of the
config, each over its own :class:`~akv.core.shard_state.ShardState`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from akv.actors.pool_shard import PoolShardActor
from akv.config import KVCacheConfig
from akv.core.shard_state import ShardState
from akv.errors import InvalidInput
from akv.storage import CopyExecutor, KVStorage

__all__ = ["build_shards", "start_executor"]


async def start_executor(storage: KVStorage | None, log: Any) -> CopyExecutor:
    """The stream worker's executor over ``storage``; with a copy process, once the child is ready.

    The wait runs on a worker thread (0.1–0.3 s for the child to start).
    A child that cannot start or stays silent leaves the copies on the
    worker thread, logged as ``copy_process.unavailable`` on ``log``.

    Raises:
        InvalidInput: See :class:`~akv.storage.CopyExecutor`.
        anyio's cancellation: Cancelled while waiting; the executor is closed.
    """
    executor = CopyExecutor(storage)
    try:
        await anyio.to_thread.run_sync(executor.wait_process_ready)
    except BaseException:  # cancelled while the copy process started
        executor.close(drain=False)
        raise
    if executor.process_unavailable is not None:
        log.warning("copy_process.unavailable", reason=executor.process_unavailable, fallback="thread")
    return executor


def build_shards(
    cfg: KVCacheConfig,
    executor: CopyExecutor,
    wake_eviction: Callable[[], None],
    *,
    sync_copies: bool,
    **actor_options: Any,
) -> list[PoolShardActor]:
    """One pool shard actor per shard range of ``cfg`` (blocks and host slots), submitting to ``executor``.

    Args:
        cfg: The manager's config.
        executor: Where the shards' copy batches go.
        wake_eviction: Wakes the eviction loop (see :class:`PoolShardActor`).
        sync_copies: Metadata mode: copies complete inside ``submit``.
        actor_options: ``logger``, ``copy_bytes``, ``tracer`` for every actor.

    Raises:
        InvalidInput: The host cannot allocate a shard's block metadata.
    """
    shards: list[PoolShardActor] = []
    host_ranges = cfg.host_shard_ranges()
    for index, block_ids in enumerate(cfg.shard_ranges()):
        try:
            state = ShardState(
                index,
                block_ids,
                cfg.block_size,
                enable_prefix_cache=cfg.enable_prefix_cache,
                eviction_policy=cfg.eviction_policy,
                null_block_id=cfg.null_block_id,
                host_ids=host_ranges[index],
                host_base=cfg.host_block_base,
                sync_copies=sync_copies,
            )
        except MemoryError:
            raise InvalidInput(
                f"cannot allocate the block metadata of {len(block_ids):,} blocks "
                f"(states, refcounts and {cfg.block_size} token ids per block) on the host"
            ) from None
        shards.append(
            PoolShardActor(
                state,
                executor,
                watermarks=cfg.watermark_blocks(len(block_ids)),
                wake_eviction=wake_eviction,
                debug_invariants=cfg.debug_invariants,
                inbox_capacity=cfg.inbox_capacity,
                **actor_options,
            )
        )
    return shards
