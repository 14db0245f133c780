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
from typing import TYPE_CHECKING

import numpy as np

from akv.core.block_key import block_key_raw, chain_suffix

from .types import BlockRemoved, stored_unchecked

if TYPE_CHECKING:
    from akv.core.step import StepOutcome

    from .shard_events import ShardEvents

__all__ = ["HOST", "loaded_events", "moved_stored", "put_back_events", "tier_step_events"]

#: The medium of a shard's host tier.
HOST = "host"


def moved_stored(events: ShardEvents, block_ids: list[int], entries: list, medium: str) -> list:
    """``BlockStored`` events of blocks that moved into ``medium`` (now at ``block_ids`` in the tree).

    Consecutive blocks of one chain (each the parent of the next, one
    namespace) share an event, as for stores. Tokens are read from the tree.

    Args:
        events: The shard's events.
        block_ids: The blocks' ids in the tree now.
        entries: Per block, ``(key, parent key or None, namespace)``.
        medium: ``"device"`` or ``"host"``.

    Returns:
        The events, in ``block_ids`` order (empty for no blocks).
    """
    if not block_ids:
        return []
    bs = events.state.block_size
    tokens = np.frombuffer(events.state.tree.block_tokens(block_ids), dtype="<i4").tolist()
    out, start = [], 0
    for i in range(1, len(entries) + 1):
        if i < len(entries) and entries[i][1] == entries[i - 1][0] and entries[i][2] == entries[i - 1][2]:
            continue  # the chain goes on
        run = entries[start:i]
        keys = [key for key, _, _ in run]
        out.append(stored_unchecked(keys, run[0][1], tokens[start * bs : i * bs], bs, medium, run[0][2]))
        start = i
    return out


def _host_cycles(events: ShardEvents, fills: dict[int, list], drops: Counter) -> tuple[list[int], list[int], list]:
    """Each host id's arrivals and drops of the step, alternated (see the module docstring, 3).

    Returns:
        ``(left, arrived ids, arrived entries)``: host ids whose holder at the
        start left, and the ids and entries of the blocks that arrived and stayed.

    Raises:
        RuntimeError: The counts do not alternate, or disagree with the tree.
    """
    index, tree = events.host_keys, events.state.tree
    left, arrived_ids, arrived = [], [], []
    for hid in [*fills, *(h for h in drops if h not in fills)]:
        came, went = fills.get(hid, ()), drops.get(hid, 0)
        held = hid in index
        if not (went - len(came) in (0, 1) if held else len(came) - went in (0, 1)):
            raise RuntimeError(f"host id {hid}: {len(came)} arrivals and {went} drops in one step (held: {held})")
        stays = held + len(came) - went == 1
        if stays != (hid in tree):
            raise RuntimeError(f"host id {hid}: {'not ' if stays else ''}in the tree after {len(came)} arrivals")
        if held and went:
            left.append(hid)
        if stays and came:
            arrived_ids.append(hid)
            arrived.append(came[-1])
    return left, arrived_ids, arrived


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
    promoted = host.take([h for h, _ in out.promotes])  # 1
    gone_host = [key for key, _, _ in promoted]
    dropped = [b for b in removed if b < hb]  # 2
    gone_dev = dev.removed(dropped) if dropped else []
    demoted = dev.take([d for d, _ in out.demotes])
    gone_dev += [key for key, _, _ in demoted]
    fills: dict[int, list] = {}  # 3
    for (_, hid), entry in zip(out.demotes, demoted):
        fills.setdefault(hid, []).append(entry)
    left, arrived_ids, arrived = _host_cycles(events, fills, Counter(b for b in removed if b >= hb))
    gone_host += host.removed(left) if left else []
    arrived_ids.reverse()  # demotions run deepest first: parents first, so one chain is one event
    arrived.reverse()
    host.put(arrived_ids, arrived)
    targets = [d for _, d in out.promotes]  # 4
    dev.put(targets, promoted)
    result: list = []
    if gone_dev:
        result.append(BlockRemoved(block_hashes=gone_dev, medium=events.medium))
    if gone_host:
        result.append(BlockRemoved(block_hashes=gone_host, medium=HOST))
    result += moved_stored(events, arrived_ids, arrived, HOST)
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
    gone += [key for key, _, _ in entries]
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
    tree, w = events.state.tree, 4 * events.state.block_size
    raw = tree.block_tokens(host)
    earlier: dict[int, tuple] = {}  # host id -> entry, for this call's blocks
    entries = []
    for i, b in enumerate(host):
        parent, root = tree.parent_of(b)
        if parent is None:
            parent_key, namespace = None, root[1]  # tree namespaces are (shard index, namespace)
        elif parent in earlier:
            parent_key, _, namespace = earlier[parent]
        else:
            index = events.host_keys if parent >= hb else events.keys
            parent_key, namespace = index.key(parent), index.namespace(parent)
        entry = (block_key_raw(parent_key, raw[i * w : (i + 1) * w], chain_suffix(namespace)), parent_key, namespace)
        earlier[b] = entry
        entries.append(entry)
    events.host_keys.put(host, entries)
    return out + moved_stored(events, host, entries, HOST)
