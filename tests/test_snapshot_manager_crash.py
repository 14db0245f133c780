"""A kill -9 of a process in the middle of KVCacheManager.save_snapshot leaves a loadable snapshot of its cache."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from akv import KVCacheManager
from akv.storage.snapshot_reader import verify_snapshot
from tests.snapshot_manager_child import KV_SEED
from tests.test_snapshot_manager import BS, config, fill, prompts

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 120


async def expected_reads() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """What each prompt's cached blocks hold in the child's cache (the same fill, in this process)."""
    out = []
    async with KVCacheManager(config(storage="tensors")) as kv:
        await fill(kv, prompts(4), kv_seed=KV_SEED)
        for i, prompt in enumerate(prompts(4)):
            await kv.add_sequence(("read", i), prompt)
            table = torch.tensor((await kv.sequence(("read", i))).block_ids)
            n = (len(prompt) - 1) // BS * BS
            out.append([kv.storage.gather(layer, table, n) for layer in range(kv.config.model.num_layers)])
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [0, 1])
async def test_kill_during_manager_save_leaves_a_loadable_snapshot(tmp_path, seed) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.snapshot_manager_child", str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in child.stdout:  # the first save is done when it says so
            if line.startswith("saved"):
                break
        else:
            pytest.fail(f"the child ended before its first save (exit {child.wait(HANG_GUARD_S)})")
        time.sleep(random.Random(seed).uniform(0.0, 0.3))  # a random instant of a later save
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(HANG_GUARD_S)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    verify_snapshot(tmp_path, config(storage="tensors").fingerprint())
    expected = await expected_reads()
    async with KVCacheManager(config(storage="tensors")) as kv:
        for cache in kv.storage.kv_caches:
            cache.fill_(-1.0)
        loaded = await kv.load_snapshot(tmp_path)
        assert loaded.dropped_blocks == 0
        for i, prompt in enumerate(prompts(4)):
            n = (len(prompt) - 1) // BS * BS
            assert await kv.add_sequence(i, prompt) == n
            table = torch.tensor((await kv.sequence(i)).block_ids)
            for layer, (key, value) in enumerate(expected[i]):
                got = kv.storage.gather(layer, table, n)
                assert torch.equal(got[0], key) and torch.equal(got[1], value)
