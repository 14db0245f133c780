"""Cache events of a shard with a host tier: a step's tier moves turned into removals and stores per medium.

With a host tier (:mod:`akv.core.tiers`) the prefix tree holds blocks on both
tiers and a block that changes tier keeps its node and key; only its id
changes. :class:`~akv.events.shard_events.ShardEvents` then keeps two
:class:`~akv.events.key_index.KeyIndex` es, one over the shard's device
blocks and one over its host ids, and a move carries a block's entry (key,
parent key, namespace) from one to the other without hashing it again. The
events name the same key in both media: a demotion is a ``BlockRemoved``
from ``"device"`` and a ``BlockStored`` in ``"host"`` (same key, its parent
key, its tokens), a promotion the reverse, a host-tier drop a
``BlockRemoved`` from ``"host"``.

**What one step did, in which order.** A
:class:`~akv.core.step.StepOutcome` lists its drops (``removed_block_ids``,
both tiers), demotions, promotions and stores each in its own order, not how
they interleaved, and a host id can change hands several times in one step
(dropped to make room, then the target of a demotion, then dropped again).
The order is recovered per id, which is all a block's key depends on:

1. a promotion's source is matched before the step's evictions and protected
   from them until it is promoted, so its promotion is its first change;
2. a device block leaves the tree at most once per step and, once it holds
   a block again (stored or promoted into), is referenced and stays, so a
   demotion carries the key it held when the step began;
3. a host id's arrivals (demotions, in order) and drops (in order) alternate,
   starting with a drop when it held a block after step 1: its first holder
   leaves (if it drops at all) and its last arrival stays (if it ends in the
   tree); the blocks in between arrived and left inside the step;
4. promotion targets and newly published blocks then enter the device index.

Each step's events are its **net change**, removals first: a block demoted
and dropped in the same step is a ``BlockRemoved`` from ``"device"`` alone,
so an index applying the batch ends exactly where the tree is. A count that
does not alternate, or an id that ends in the tree or out of it against the
count, is akv's bug: ``RuntimeError`` (it crashes the shard's actor).
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from akv.core.block_key import KEY_BYTES, block_key_raw, chain_suffix

from .types import BlockRemoved, stored_unchecked

if TYPE_CHECKING:
    from akv.core.step import StepOutcome

    from .shard_events import ShardEvents

__all__ = ["HOST", "loaded_events", "moved_stored", "put_back_events", "tier_step_events"]

#: The medium of a shard's host tier.
HOST = "host"


def _key_list(keys: np.ndarray) -> list[bytes]:
    """uint8 ``(n, 16)`` keys as a list of ``n`` 16-byte ``bytes``."""
    raw = keys.tobytes()
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


def _select(entries: tuple, rows: np.ndarray) -> tuple:
    """The ``rows`` (an int array) of :meth:`~akv.events.key_index.KeyIndex.take` entries."""
    keys, parents, has_parent, namespaces = entries
    return keys[rows], parents[rows], has_parent[rows], [namespaces[i] for i in rows.tolist()]


def moved_stored(events: ShardEvents, block_ids: list[int], entries: tuple, medium: str) -> list:
    """``BlockStored`` events of blocks that moved into ``medium`` (now at ``block_ids`` in the tree).

    Consecutive blocks of one chain (each the parent of the next) share an
    event, as for stores. Tokens are read from the tree. O(blocks), numpy
    but for one event per run.

    Args:
        events: The shard's events.
        block_ids: The blocks' ids in the tree now.
        entries: Their ``(keys, parent_keys, has_parent, namespaces)``
            (:meth:`~akv.events.key_index.KeyIndex.take`).
        medium: ``"device"`` or ``"host"``.

    Returns:
        The events, in ``block_ids`` order (empty for no blocks).
    """
    n = len(block_ids)
    if not n:
        return []
    bs = events.state.block_size
    keys, parents, has_parent, namespaces = entries
    rows = events.state.tree.block_tokens(block_ids)  # int32 (n, block_size)
    chained = np.zeros(n, dtype=bool)  # a key's parent is the key before it: one chain (one namespace)
    chained[1:] = has_parent[1:] & (parents[1:] == keys[:-1]).all(axis=1)
    starts = [*np.flatnonzero(~chained).tolist(), n]
    key_list = _key_list(keys)
    out = []
    for start, stop in pairwise(starts):
        parent = parents[start].tobytes() if has_parent[start] else None
        tokens = rows[start:stop].reshape(-1).tolist()
        out.append(stored_unchecked(key_list[start:stop], parent, tokens, bs, medium, namespaces[start]))
    return out


def _host_cycles(events: ShardEvents, fills: np.ndarray, drops: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Each host id's arrivals (``fills``, in order) and drops of the step, alternated (module docstring, 3).

    Returns:
        ``(left, arrived)``: host ids whose holder at the start left, and the
        indices into ``fills`` of the arrivals that stayed (ascending).

    Raises:
        RuntimeError: The counts do not alternate, or disagree with the tree.
    """
    index = events.host_keys
    if len(np.unique(fills)) == len(fills) and len(np.unique(drops)) == len(drops):  # each id changed once or twice
        held_fill, held_drop = index.stored_mask(fills), index.stored_mask(drops)
        fill_dropped, drop_filled = np.isin(fills, drops), np.isin(drops, fills)
        if (held_fill & ~fill_dropped).any() or (~held_drop & ~drop_filled).any():
            raise RuntimeError("a demotion into a host id that held a block, or a drop of an empty one")
        arrived = np.flatnonzero(held_fill | ~fill_dropped)  # an empty id filled, then dropped: in and out
        left = drops[held_drop].tolist()
    else:
        left, arrived = _host_cycles_slow(index, fills, drops)
    stay = fills[arrived]
    tree_ids = np.union1d(fills, drops)
    expected = np.isin(tree_ids, stay)
    if (events.state.tree.holds(tree_ids) != expected).any():
        raise RuntimeError(f"host ids {tree_ids[:8].tolist()}: the tree disagrees with the step's moves")
    return left, arrived


def _host_cycles_slow(index, fills: np.ndarray, drops: np.ndarray) -> tuple[list[int], np.ndarray]:
    """:func:`_host_cycles` of a step that changed some host id more than twice: one id at a time."""
    came: dict[int, list[int]] = {}
    for i, hid in enumerate(fills.tolist()):
        came.setdefault(hid, []).append(i)
    went = Counter(drops.tolist())
    left, arrived = [], []
    for hid in [*came, *(h for h in went if h not in came)]:
        n_in, n_out, held = len(came.get(hid, ())), went.get(hid, 0), hid in index
        if not (n_out - n_in in (0, 1) if held else n_in - n_out in (0, 1)):
            raise RuntimeError(f"host id {hid}: {n_in} arrivals and {n_out} drops in one step (held: {held})")
        if held and n_out:
            left.append(hid)
        if n_in and held + n_in - n_out == 1:
            arrived.append(came[hid][-1])
    return left, np.array(sorted(arrived), dtype=np.intp)


def tier_step_events(events: ShardEvents, out: StepOutcome) -> list:
    """The net events of a step (or eviction, swap) that moved blocks between tiers; updates both key indexes.

    O(blocks changed), plus one key hash per newly published block.

    Args:
        events: The shard's events (with a host key index).
        out: The step's outcome (after the step).

    Returns:
        ``BlockRemoved`` (device, then host), then ``BlockStored`` (host, then
        device: promotions, then newly published blocks).

    Raises:
        RuntimeError: The key indexes disagree with the outcome or the tree
            (akv's bug; it crashes the shard's actor).
    """
    dev, host, hb = events.keys, events.host_keys, events.state.host_base
    removed = out.removed_block_ids
    promoted = host.take(out.promoted)  # 1
    gone_host = _key_list(promoted[0])
    dropped = [b for b in removed if b < hb]  # 2
    gone_dev = dev.removed(dropped) if dropped else []
    demoted = dev.take(out.demoted)
    gone_dev += _key_list(demoted[0])
    fills = np.array(out.demoted_to, dtype=np.int64)  # 3
    left, arrived = _host_cycles(events, fills, np.array([b for b in removed if b >= hb], dtype=np.int64))
    gone_host += host.removed(left) if left else []
    arrived = arrived[::-1]  # demotions run deepest first: parents first, so one chain is one event
    arrived_ids, arrived_entries = fills[arrived].tolist(), _select(demoted, arrived)
    host.put(arrived_ids, arrived_entries)
    targets = out.promoted_to  # 4
    dev.put(targets, promoted)
    result: list = []
    if gone_dev:
        result.append(BlockRemoved(block_hashes=gone_dev, medium=events.medium))
    if gone_host:
        result.append(BlockRemoved(block_hashes=gone_host, medium=HOST))
    result += moved_stored(events, arrived_ids, arrived_entries, HOST)
    result += moved_stored(events, targets, promoted, events.medium)
    if out.stored_block_ids:
        result += events._stored(out.stored_block_ids)
    return result


def put_back_events(events: ShardEvents, pairs: list[tuple[int, int]], dropped: list[int]) -> list:
    """Events of held demotions whose copy failed: put back on the device (a promotion's, without a copy) or dropped.

    Args:
        events: The shard's events (with a host key index).
        pairs: ``(host id, device block)`` put back, parents first.
        dropped: Host ids that left the tree instead.

    Returns:
        A ``BlockRemoved`` from ``"host"`` (the dropped keys, then the ones put
        back) and the ``BlockStored`` in ``"device"`` (none when nothing changed).
    """
    gone = events.host_keys.removed(dropped) if dropped else []
    entries = events.host_keys.take([h for h, _ in pairs])
    targets = [d for _, d in pairs]
    events.keys.put(targets, entries)
    gone += _key_list(entries[0])
    removed = [BlockRemoved(block_hashes=gone, medium=HOST)] if gone else []
    return removed + moved_stored(events, targets, entries, events.medium)


def loaded_events(events: ShardEvents, block_ids: list[int]) -> list:
    """``BlockStored`` events of blocks a snapshot load published, on either tier; indexes them. O(blocks) hashes.

    Args:
        events: The shard's events.
        block_ids: The loaded blocks now in the tree, each after its parent
            (a snapshot's rows are topological). Device blocks hang below
            device blocks only; a host block may hang below either.

    Returns:
        The device blocks' events, then the host blocks'.
    """
    hb = events.state.host_base
    dev = block_ids if hb is None else [b for b in block_ids if b < hb]
    out = events._stored(dev) if dev else []
    host = [] if hb is None else [b for b in block_ids if b >= hb]
    if not host:
        return out
    tree = events.state.tree
    raw = tree.block_tokens(host).tobytes()
    w = len(raw) // len(host)
    earlier: dict[int, tuple] = {}  # host id -> (key, parent key, namespace), for this call's blocks
    for i, b in enumerate(host):
        parent, root = tree.parent_of(b)
        if parent is None:
            parent_key, namespace = None, root[1]  # tree namespaces are (shard index, namespace)
        elif parent in earlier:
            parent_key, _, namespace = earlier[parent]
        else:
            index = events.host_keys if parent >= hb else events.keys
            parent_key, namespace = index.key(parent), index.namespace(parent)
        key = block_key_raw(parent_key, raw[i * w : (i + 1) * w], chain_suffix(namespace))
        earlier[b] = (key, parent_key, namespace)
    keys = np.frombuffer(b"".join(k for k, _, _ in earlier.values()), dtype=np.uint8).reshape(-1, KEY_BYTES)
    parents = np.frombuffer(b"".join(p or bytes(KEY_BYTES) for _, p, _ in earlier.values()), dtype=np.uint8).reshape(
        -1, KEY_BYTES
    )
    has_parent = np.array([p is not None for _, p, _ in earlier.values()], dtype=bool)
    entries = (keys, parents, has_parent, [ns for _, _, ns in earlier.values()])
    events.host_keys.put(host, entries)
    return out + moved_stored(events, host, entries, HOST)
