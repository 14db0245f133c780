"""``akv replay --events-out``: the replay's cache events as JSON lines, and the final cached set.

A subscription taken before the first step (``since=0``) is drained by a
writer task into one JSON line per batch (:func:`akv.events.jsonl.to_json`).
After the replay the eviction loop is stopped, so nothing changes the cache
any more; the writer finishes every batch up to the snapshot's number, and
``final_cached_blocks`` counts the snapshot's keys per medium: exactly the
set a reader rebuilds from the file.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from akv.events.jsonl import to_json

__all__ = ["EVENTS_BUFFER", "replay_with_events"]

#: Batches the writer's subscription holds; a replay step never waits on the file.
EVENTS_BUFFER = 1 << 20


async def replay_with_events(kv: Any, run: Callable[[], Awaitable[Any]], path: Path) -> tuple[Any, dict, int]:
    """Run ``run()`` (the replay) on ``kv`` while writing its event batches to ``path``.

    Args:
        kv: A running manager with ``enable_events``.
        run: The replay coroutine function; its result is returned.
        path: The JSON-lines file to write (created or replaced).

    Returns:
        ``(run's result, final_cached_blocks, batches written)``:
        ``final_cached_blocks`` maps each medium to its cached blocks as of
        the last batch written.

    Raises:
        RuntimeError: The subscription fell behind and dropped batches (the
            file would not be exact).
        OSError: The file cannot be written.
    """
    sub = kv.subscribe_events(since=0, buffer=EVENTS_BUFFER)
    written = [0]
    caught_up = anyio.Event()
    target = [None]

    async def write(out) -> None:
        async for batch in sub:
            if batch.dropped is not None:
                raise RuntimeError(f"--events-out: the writer missed batches {batch.dropped.from_seq}..{batch.seq}")
            out.write(json.dumps(to_json(batch), separators=(",", ":")) + "\n")
            written[0] = batch.seq
            if target[0] is not None and written[0] >= target[0]:
                caught_up.set()

    with open(path, "w", encoding="utf-8") as out:
        async with anyio.create_task_group() as tg:
            tg.start_soon(write, out)
            result = await run()
            await kv.stop_eviction_loop()
            keys, as_of = await kv.cached_keys()
            target[0] = as_of
            if written[0] < as_of:
                await caught_up.wait()
            sub.close()
            tg.cancel_scope.cancel()
    final = dict(Counter(k.medium for k in keys))
    return result, final, as_of
