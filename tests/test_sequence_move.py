"""snapshot_sequence / restore_sequence: a running request moves between managers with its exact K/V."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from akv import KVCacheManager
from akv.errors import SnapshotError, UnknownSequence
from tests.test_snapshot_manager import BS, config, fill, prompts


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    return request.param


async def running(kv: KVCacheManager, seq_id, prompt: np.ndarray, seed: int) -> None:
    """Admit ``prompt``, write K/V of its uncached tokens, commit it, and decode 3 tokens (K/V written too)."""
    cached = await kv.add_sequence(seq_id, prompt)
    info = await kv.sequence(seq_id)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(cached, len(prompt) + 3)
    for step in range(4):
        if step:
            await kv.append(seq_id, [7 + step])
        info = await kv.sequence(seq_id)
        slots = torch.tensor(info.block_ids)[positions // BS] * BS + positions % BS
        now = slots[: len(prompt) - cached] if not step else slots[len(prompt) - cached + step - 1 :][:1]
        for layer in range(kv.config.model.num_layers):
            shape = (len(now), kv.config.model.num_kv_heads, kv.config.model.head_dim)
            kv.storage.write(layer, now, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        await kv.commit(seq_id, len(now))


async def history(kv: KVCacheManager, seq_id) -> tuple[tuple[int, ...], list]:
    info = await kv.sequence(seq_id)
    table = torch.tensor(info.block_ids)
    layers = [kv.storage.gather(layer, table, info.num_computed) for layer in range(kv.config.model.num_layers)]
    return info.token_ids, layers


@pytest.mark.anyio
async def test_restored_sequence_reads_back_exactly_what_was_saved() -> None:
    cfg = config(storage="tensors")
    items = prompts(3)
    async with KVCacheManager(cfg) as kv:
        await fill(kv, items[:2], kv_seed=3)
        await running(kv, "req", items[2], seed=5)
        tokens, layers = await history(kv, "req")
        data = await kv.snapshot_sequence("req")
    for shared in (0, 1):
        async with KVCacheManager(cfg) as other:
            await fill(other, items[:shared], kv_seed=9)  # another instance; its cache may share the first block
            cached = await other.restore_sequence("moved", data)
            assert cached == shared * BS
            await other.check()
            info = await other.sequence("moved")
            assert info.token_ids == tokens and info.num_computed == len(tokens)
            _, got = await history(other, "moved")
            for layer, (key, value) in enumerate(layers):  # cached blocks hold this instance's K/V
                assert torch.equal(got[layer][0][cached:], key[cached:])
                assert torch.equal(got[layer][1][cached:], value[cached:])
            await other.append("moved", [1])  # it keeps running
            with pytest.raises(SnapshotError):
                await other.restore_sequence("again", data[:-1])


@pytest.mark.anyio
@pytest.mark.parametrize("where", [0, 8, 30, -20, -1])
async def test_corrupt_or_foreign_blob_is_refused_and_adds_nothing(where: int) -> None:
    async with KVCacheManager(config(storage="tensors")) as kv:
        await running(kv, "req", prompts(1)[0], seed=1)
        good = await kv.snapshot_sequence("req")
    data = bytearray(good)
    data[where] ^= 0x40
    async with KVCacheManager(config(storage="tensors")) as kv:
        with pytest.raises(SnapshotError) as err:
            await kv.restore_sequence("x", bytes(data))
        assert err.value.cause == "corrupt"
        assert (await kv.stats()).num_sequences == 0
    async with KVCacheManager(config(storage="tensors", block_size=8)) as kv:
        with pytest.raises(SnapshotError) as err:
            await kv.restore_sequence("x", good)
        assert err.value.cause == "foreign" and "block_size" in str(err.value)


@pytest.mark.anyio
async def test_metadata_blob_is_foreign_to_a_pool_with_kv_and_unknown_ids_raise() -> None:
    async with KVCacheManager(config()) as kv:
        await kv.add_sequence("req", prompts(1)[0])
        data = await kv.snapshot_sequence("req")
        with pytest.raises(UnknownSequence):
            await kv.snapshot_sequence("nope")
        moved = await kv.restore_sequence("copy", data)
        assert moved == 0
    async with KVCacheManager(config(storage="tensors")) as kv:
        with pytest.raises(SnapshotError) as err:
            await kv.restore_sequence("x", data)
        assert err.value.cause == "foreign"
        with pytest.raises(SnapshotError):
            await kv.restore_sequence("x", "not bytes")
