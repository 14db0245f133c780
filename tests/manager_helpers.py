"""Helpers of the KVCacheManager tests: a minimal model runner with its own K/V oracle, state snapshots.

``Runner`` writes synthetic K/V that depends on each sequence's own token
history (kept by the runner, not read back from the manager) through the slot
mappings, and checks what the block tables read back.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import sys
from collections.abc import Hashable

import pytest
import torch

from akv import Admit, KVCacheManager

BS = 4
VOCAB = 1000


def kv_values(history: list[int], layer: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic K and V for every position of ``history``: ``(n, heads, dim)`` float32, exact.

    Position ``i`` depends on the whole prefix ``history[: i + 1]`` (a rolling
    hash, as a real model's K/V depends on the prefix) and on the layer. All
    values are integers below 2**24, so float32 holds them exactly.
    """
    h, rows = 0, []
    for tok in history:
        h = (h * 1_000_003 + tok + 1) % (1 << 16)
        rows.append(h)
    width = num_kv_heads * head_dim
    base = (torch.tensor(rows, dtype=torch.float32) * 4 + layer).view(-1, 1, 1) * width
    k = base + torch.arange(width, dtype=torch.float32).view(1, num_kv_heads, head_dim)
    return k, -k - 1


class Runner:
    """A minimal model runner: writes K/V through slot mappings, reads back through block tables."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.history: dict[Hashable, list[int]] = {}

    @property
    def storage(self):
        return self.kv.storage

    def _values(self, sid: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.storage
        return kv_values(self.history[sid], layer, s.num_kv_heads, s.head_dim)

    async def write(self, result) -> None:
        """Write this step's new tokens of every scheduled row (after its copies ran)."""
        await result.copies.wait()
        qsl = result.query_start_loc.tolist()
        for row, sid in enumerate(result.seq_ids):
            a, b = qsl[row], qsl[row + 1]
            end = int(result.context_lens[row])
            start = end - (b - a)
            assert end == len(self.history[sid]), f"{sid}: context length {end}, history {len(self.history[sid])}"
            slots = result.slot_mapping[a:b]
            for layer in range(self.storage.num_layers):
                k, v = self._values(sid, layer)
                self.storage.write(layer, slots, k[start:end], v[start:end])

    async def admit(self, sid: Hashable, prompt: list[int]) -> int:
        self.history[sid] = list(prompt)
        result = await self.kv.step(admits=[Admit(seq_id=sid, prompt=prompt)])
        assert sid not in result.rejected, result.rejected
        await self.write(result)
        cached = result.cached_tokens[sid]
        await self.kv.commit(sid, len(prompt) - cached)
        return cached

    async def fork(self, parent: Hashable, children: list[Hashable]) -> None:
        await self.kv.fork(parent, children)
        for child in children:
            self.history[child] = list(self.history[parent])

    async def append(self, appends: dict[Hashable, list[int]]):
        for sid, toks in appends.items():
            self.history[sid].extend(toks)
        result = await self.kv.step(appends=appends)
        assert result.rejected == {}, result.rejected
        assert sorted(map(str, result.seq_ids)) == sorted(map(str, appends))
        await self.write(result)
        await self.kv.step(commits={sid: len(toks) for sid, toks in appends.items()}, want_metadata=False)
        return result

    async def verify(self, sid: Hashable) -> None:
        """What the sequence reads back through its block table equals what was written for its history."""
        info = await self.kv.sequence(sid)
        assert list(info.token_ids) == self.history[sid]
        assert info.num_tokens == len(self.history[sid])
        assert len(info.block_ids) == -(-info.num_tokens // BS)
        table = torch.tensor(info.block_ids, dtype=torch.int32)
        for layer in range(self.storage.num_layers):
            k, v = self.storage.gather(layer, table, info.num_tokens)
            want_k, want_v = self._values(sid, layer)
            assert torch.equal(k, want_k), f"{sid}: K of layer {layer} differs from its own history"
            assert torch.equal(v, want_v), f"{sid}: V of layer {layer} differs from its own history"


def messages_handled(kv: KVCacheManager) -> int:
    """Messages the pool shards' handlers have run (the actors' own counter): how many asks calls took."""
    return sum(shard.messages_handled for shard in kv._shards)


def state_view(stats) -> dict:
    """Stats minus what may legitimately move without a state change (inbox depths, the error counter)."""
    d = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    d.pop("max_inbox_depth")
    d.pop("pool_exhausted")
    return d


async def snapshot(kv: KVCacheManager, ids: list[Hashable]) -> tuple:
    stats = await kv.stats()
    return state_view(stats), {sid: await kv.sequence(sid) for sid in ids}


async def publish(kv: KVCacheManager, sid: Hashable, prompt: list[int], *, free: bool = True) -> None:
    """Admit, commit the whole prompt (its full blocks enter the prefix cache), optionally free."""
    await kv.add_sequence(sid, prompt)
    await kv.commit(sid, len(prompt))
    if free:
        assert await kv.free(sid) is True


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of a module that imports this fixture on asyncio and on trio."""
    return request.param


@pytest.fixture(autouse=True)
def watchdog():
    """Last resort against a hang inside a shielded wait (fail_after cannot cancel those); autouse where imported."""
    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()
