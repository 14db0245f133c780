"""Snapshot save and load of a :class:`~akv.manager.KVCacheManager` (a mixin; docs/persistence.md).

Save: each shard exports its published full blocks at one message boundary
(its own consistent cut: prefix trees are shard-local, so a cut per shard is
a cut of the cache) and, when K/V are saved, holds them (eviction skips them
and they keep their place in the eviction order,
:mod:`akv.core.shard_export`); the record is merged (blocks cached in two
shards saved once) and written by :func:`akv.storage.snapshot_dir.save_snapshot`
in a worker thread, which copies the K/V out of the pool in batches of about
32 MiB while the shards keep serving steps; the holds end when it returns.

Load: the snapshot is read and verified whole in a worker thread before any
shard is touched; each saved chain goes to the shard that placement sends
its first block to (:meth:`~akv.core.shard_map.ShardMap.affine_shard`); each
shard keeps the hottest blocks that fit its free blocks less the eviction
loop's headroom (its high watermark, which it would evict at once)
(:func:`~akv.storage.snapshot_record.hottest_that_fit`), allocates them,
gets their K/V written, then publishes them as cached, in the saved
eviction order.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import torch

from akv.actors.snapshot_messages import ExportSnapshot, ImportAbort, ImportPublish, ImportReserve, ReleaseHold
from akv.core.block_key import KEY_BYTES, block_key_raw, chain_suffix
from akv.core.eviction_policy import EVICTION_POLICIES
from akv.errors import InvalidInput, SnapshotError
from akv.storage.snapshot_demo import tensor_reader
from akv.storage.snapshot_dir import save_snapshot as write_snapshot
from akv.storage.snapshot_reader import Snapshot
from akv.storage.snapshot_reader import load_snapshot as read_snapshot
from akv.storage.snapshot_record import MEDIUM_DEVICE, MEDIUM_HOST, SnapshotBlocks, hottest_that_fit


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotLoad:
    """What :meth:`ManagerSnapshots.load_snapshot` loaded.

    Attributes:
        generation: The snapshot generation loaded.
        saved_blocks: Blocks in the snapshot.
        loaded_blocks: Blocks now cached from it.
        dropped_blocks: ``saved_blocks - loaded_blocks``: no room (the
            coldest first, never a block without its ancestors) or cached already.
        seconds: Wall time of the load (read, verify, write K/V, publish).
    """

    generation: int
    saved_blocks: int
    loaded_blocks: int
    dropped_blocks: int
    seconds: float


def _directory(path: Any) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if type(path) is not str or not path or "\x00" in path:
        raise InvalidInput(f"a snapshot directory must be a non-empty path, got {type(path).__name__}")
    return path


class ManagerSnapshots:
    """``save_snapshot`` / ``load_snapshot``; a mixin of :class:`~akv.manager.KVCacheManager` (uses its attributes)."""

    __slots__ = ()

    async def save_snapshot(self, path: str | os.PathLike) -> int:
        """Save the prefix cache (published full blocks, and their K/V unless metadata-only) as a new generation.

        The manager keeps serving steps while the files are written; blocks
        published after the cut are not in this snapshot.

        Args:
            path: The snapshot directory (created if absent).

        Returns:
            The generation written.

        Raises:
            InvalidInput: ``path`` is not a path, or a save is already running.
            SnapshotError: cause ``"io"``: the directory cannot be written
                (nothing half-written remains; the current generation is kept).
            ManagerClosed, ActorCrashed: The manager is not running.
        """
        directory = _directory(path)
        self._check_running()
        started = time.perf_counter()
        hold = self.storage is not None
        self.log.info("snapshot.save_started", directory=directory)
        with self._tracer.span("akv.save_snapshot", attributes={"akv.directory": directory}) as span:
            exports: list = []
            try:
                for shard in self._shards:
                    exports.append(await self._ask(shard, ExportSnapshot(hold)))
                blocks, block_ids = await anyio.to_thread.run_sync(_merge_exports, exports, self.config.block_size)
                reader = self._tier_reader(blocks, block_ids) if hold else None
                generation = await anyio.to_thread.run_sync(write_snapshot, directory, self.config, blocks, reader)
            except Exception as exc:
                self.log.warning("snapshot.save_failed", directory=directory, error=str(exc))
                raise
            finally:
                if hold:
                    with anyio.CancelScope(shield=True):
                        for shard, _ in zip(self._shards, exports, strict=False):
                            if self._phase == "running":
                                await shard.ask(ReleaseHold())
            seconds = time.perf_counter() - started
            if span.is_recording():
                span.set_attributes({"akv.generation": generation, "akv.blocks": blocks.num_blocks})
        self._metrics.snapshot_save_s.observe(seconds)
        self._metrics.snapshot_blocks.labels(op="saved").inc(blocks.num_blocks)
        self.log.info(
            "snapshot.save_finished",
            directory=directory,
            generation=generation,
            num_blocks=blocks.num_blocks,
            seconds=round(seconds, 6),
        )
        return generation

    async def load_snapshot(self, path: str | os.PathLike) -> SnapshotLoad:
        """Load a snapshot into the prefix cache of a manager with no live sequence.

        The snapshot is verified whole first (nothing is loaded from a refused
        one). Blocks that do not fit the free blocks are dropped, coldest
        first by the saved eviction order, never a block without its
        ancestors; blocks cached already are kept once.

        Args:
            path: The snapshot directory.

        Returns:
            What was loaded (:class:`SnapshotLoad`).

        Raises:
            InvalidInput: ``path`` is not a path, or a sequence is live.
            SnapshotError: The snapshot is refused (corrupt, truncated,
                missing, foreign, format, io; metadata-only while this
                manager holds K/V is ``"foreign"``); the cache is unchanged.
            ManagerClosed, ActorCrashed: The manager is not running.
        """
        directory = _directory(path)
        self._check_running()
        live = sum(shard.snapshot.num_sequences for shard in self._shards)
        if live:
            raise InvalidInput(f"load_snapshot needs a manager with no live sequence; {live} are live")
        started = time.perf_counter()
        self.log.info("snapshot.load_started", directory=directory)
        with self._tracer.span("akv.load_snapshot", attributes={"akv.directory": directory}) as span:
            try:
                snap = await anyio.to_thread.run_sync(read_snapshot, directory, self.config.fingerprint())
                if self.storage is not None and snap.layers is None:
                    raise SnapshotError("foreign", directory, "metadata-only snapshot for a manager that holds K/V")
            except SnapshotError as exc:
                self._metrics.snapshot_refusals.labels(cause=exc.cause).inc()
                self.log.warning("snapshot.refused", directory=directory, cause=exc.cause, error=str(exc))
                raise
            loaded = 0
            for shard, rows in enumerate(self._split_rows(snap.blocks)):
                if rows.size:
                    loaded += await self._load_into(shard, snap, rows)
            result = SnapshotLoad(
                generation=snap.generation,
                saved_blocks=snap.blocks.num_blocks,
                loaded_blocks=loaded,
                dropped_blocks=snap.blocks.num_blocks - loaded,
                seconds=time.perf_counter() - started,
            )
            if span.is_recording():
                span.set_attributes({"akv.loaded_blocks": loaded, "akv.dropped_blocks": result.dropped_blocks})
        self._metrics.snapshot_load_s.observe(result.seconds)
        self._metrics.snapshot_blocks.labels(op="loaded").inc(loaded)
        self._metrics.snapshot_blocks.labels(op="dropped").inc(result.dropped_blocks)
        self.log.info(
            "snapshot.load_finished",
            directory=directory,
            generation=result.generation,
            loaded_blocks=loaded,
            dropped_blocks=result.dropped_blocks,
            seconds=round(result.seconds, 6),
        )
        return result

    async def _snapshot_on_enter(self) -> None:
        """``load_on_enter``: load ``snapshot_dir``; a refused snapshot starts cold unless ``require_snapshot``."""
        if not self.config.load_on_enter:
            return
        try:
            await self.load_snapshot(self.config.snapshot_dir)
        except SnapshotError:
            if self.config.require_snapshot:
                raise
            self.log.warning("snapshot.cold_start", directory=self.config.snapshot_dir)

    async def _snapshot_on_exit(self) -> None:
        """``save_on_exit``: save to ``snapshot_dir`` (a clean exit only; the caller checks)."""
        if self.config.save_on_exit and self._phase == "running":
            await self.save_snapshot(self.config.snapshot_dir)

    def _split_rows(self, blocks: SnapshotBlocks) -> list[np.ndarray]:
        """Record rows by the shard placement sends each chain to (a chain follows its first block)."""
        num_shards = len(self._shards)
        shard = np.zeros(blocks.num_blocks, dtype=np.int64)
        if num_shards > 1:
            parents = blocks.parent.tolist()
            for row, key in enumerate(blocks.keys):
                up = parents[row]
                shard[row] = shard[up] if up >= 0 else int.from_bytes(key[:8].tobytes(), "big") % num_shards
        return [np.flatnonzero(shard == s).astype(np.int64) for s in range(num_shards)]

    async def _load_into(self, index: int, snap: Snapshot, rows: np.ndarray) -> int:
        """Load record rows ``rows`` (ancestor-closed, increasing) into shard ``index``; return blocks loaded.

        The hottest blocks that fit both tiers are kept; of those, the hottest
        that fit the device go there (an ancestor-closed set), the rest to the
        host tier.
        """
        actor = self._shards[index]
        sub = snap.blocks.take(rows)
        key = EVICTION_POLICIES[self.config.eviction_policy].key
        room = max(0, actor.snapshot.num_free - actor.high_free_blocks)  # the eviction loop's headroom stays free
        host_room = actor.snapshot.host[0]
        kept, _ = hottest_that_fit(sub, room + host_room, key)
        sub = sub.take(kept)
        on_device, _ = hottest_that_fit(sub, room, key)
        on_host = np.ones(sub.num_blocks, dtype=bool)
        on_host[on_device] = False
        block_ids = await self._ask(actor, ImportReserve(sub.tokens, on_host))
        try:
            if self.storage is not None:
                await anyio.to_thread.run_sync(self._write_rows, snap.layers, rows[kept], block_ids)
            namespaces = [sub.namespaces[i] for i in sub.namespace.tolist()]
            publish = ImportPublish(block_ids, sub.parent, namespaces, sub.num_hits, sub.last_release, sub.tokens)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._ask(actor, ImportAbort(block_ids))
            raise
        with anyio.CancelScope(shield=True):
            return await self._ask(actor, publish)

    def _write_rows(self, layers: list, rows: np.ndarray, block_ids: list[int]) -> None:
        """Copy snapshot rows into their blocks: device blocks in the pool, host-tier ids in the host pool."""
        ids = np.array(block_ids, dtype=np.int64)
        host = ids >= self.config.host_block_base
        _write_layers(self.storage.kv_caches, layers, torch.from_numpy(rows[~host]), ids[~host].tolist())
        if host.any():
            slots = (ids[host] - self.config.host_block_base).tolist()
            _write_layers(self.storage.host.kv_caches, layers, torch.from_numpy(rows[host]), slots)

    def _tier_reader(self, blocks: SnapshotBlocks, block_ids: np.ndarray):
        """A ``read_blocks`` over both tiers: a row on the host tier is read from the host pool's slot."""
        on_host = blocks.medium == MEDIUM_HOST
        if not on_host.any():
            return tensor_reader(self.storage.kv_caches, block_ids)
        slots = np.where(on_host, block_ids - self.config.host_block_base, 0)
        device = tensor_reader(self.storage.kv_caches, np.where(on_host, 0, block_ids))
        host = tensor_reader(self.storage.host.kv_caches, slots)

        def read_blocks(layer: int, rows: np.ndarray) -> torch.Tensor:
            out = device(layer, rows)
            here = on_host[rows]
            if here.any():
                out[:, torch.from_numpy(here)] = host(layer, rows[here]).to(out.device)
            return out

        return read_blocks


def _write_layers(kv_caches: list, layers: list, rows: torch.Tensor, block_ids: list[int]) -> None:
    """Copy snapshot rows ``rows`` of every layer into pool blocks ``block_ids`` (dim 1 of each layer)."""
    for cache, saved in zip(kv_caches, layers, strict=True):
        # (2, num_blocks, block_size, num_kv_heads, head_dim), K then V
        dst = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
        cache.index_copy_(1, dst, saved.index_select(1, rows).to(cache.device))


def _chain_keys(export: Any) -> list[bytes]:
    """The content key of every row of a shard's export, chained from its parent row's key."""
    keys: list[bytes] = []
    suffixes: dict = {}
    raw = np.ascontiguousarray(export.tokens, dtype="<i4")
    for row, up in enumerate(export.parent.tolist()):
        namespace = export.namespaces[row]
        suffix = suffixes.get((type(namespace), namespace))
        if suffix is None:
            suffix = suffixes[(type(namespace), namespace)] = chain_suffix(namespace)
        keys.append(block_key_raw(None if up < 0 else keys[up], raw[row].tobytes(), suffix))
    return keys


def _merge_exports(exports: list, block_size: int) -> tuple[SnapshotBlocks, np.ndarray]:
    """One record from the shards' exports (keys chained here, off the actors): blocks saved twice kept once.

    Returns:
        The record and the block id of each of its rows.
    """
    table: dict = {}
    seen: dict[bytes, int] = {}
    columns: dict[str, list] = {
        name: [] for name in ("keys", "parent", "namespace", "tokens", "hits", "rank", "ids", "medium")
    }
    for export in exports:
        local: list[int] = []
        for row, key in enumerate(_chain_keys(export)):
            known = seen.get(key)
            if known is not None:
                local.append(known)
                continue
            up = int(export.parent[row])
            namespace = export.namespaces[row]
            local.append(len(columns["ids"]))
            seen[key] = local[-1]
            columns["keys"].append(key)
            columns["parent"].append(-1 if up < 0 else local[up])
            columns["namespace"].append(table.setdefault((type(namespace), namespace), len(table)))
            columns["tokens"].append(export.tokens[row])
            columns["hits"].append(int(export.num_hits[row]))
            columns["rank"].append(int(export.last_release[row]))
            columns["ids"].append(int(export.block_ids[row]))
            columns["medium"].append(MEDIUM_HOST if export.on_host[row] else MEDIUM_DEVICE)
    n = len(columns["ids"])
    blocks = SnapshotBlocks(
        block_size=block_size,
        namespaces=tuple(value for _, value in table),
        keys=np.frombuffer(b"".join(columns["keys"]), dtype=np.uint8).reshape(n, KEY_BYTES).copy(),
        parent=np.array(columns["parent"], dtype=np.int64),
        namespace=np.array(columns["namespace"], dtype=np.int32),
        tokens=np.array(columns["tokens"], dtype=np.int32).reshape(n, block_size),
        num_hits=np.array(columns["hits"], dtype=np.int64),
        last_release=np.array(columns["rank"], dtype=np.int64),
        medium=np.array(columns["medium"], dtype=np.uint8),
    )
    return blocks, np.array(columns["ids"], dtype=np.int64)
