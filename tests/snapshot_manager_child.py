"""Child process of tests/test_snapshot_manager_crash.py: a manager that saves snapshots until it is killed.

Run as ``python -m tests.snapshot_manager_child DIR``: it fills a manager's
cache (tests/test_snapshot_manager.py's prompts and K/V), saves a snapshot to
``DIR``, prints ``saved`` (flushed), then keeps saving new generations of the
same cache, serving a step between saves, until it is killed.
"""

from __future__ import annotations

import sys

import anyio

from akv import KVCacheManager
from tests.test_snapshot_manager import config, fill, prompts

KV_SEED = 11


async def main(directory: str) -> None:
    async with KVCacheManager(config(storage="tensors")) as kv:
        await fill(kv, prompts(4), kv_seed=KV_SEED)
        await kv.save_snapshot(directory)
        print("saved", flush=True)
        while True:
            await kv.save_snapshot(directory)
            await kv.lookup(prompts(1)[0])


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
