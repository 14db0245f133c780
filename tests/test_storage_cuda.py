"""akv.storage on a CUDA device: the key CPU checks again, plus stream ordering and the fence."""

from __future__ import annotations

import anyio
import pytest
import torch
import torch.nn.functional as F

from akv.errors import InvalidInput, ManagerClosed
from akv.storage import (
    CopyExecutor,
    KVStorage,
    paged_decode_attention,
    paged_prefill_attention,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: tens of ms, enough to expose a missing dependency


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_storage(num_blocks: int = 16, block_size: int = 16, dtype=torch.float32) -> KVStorage:
    return KVStorage(
        num_blocks=num_blocks,
        block_size=block_size,
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        device=DEVICE,
    )


def fill_distinct(storage: KVStorage) -> None:
    for layer, cache in enumerate(storage.kv_caches):
        cache.copy_(torch.arange(cache.numel(), device=cache.device, dtype=torch.float32).view(cache.shape) + layer)


def test_write_gather_round_trip_on_cuda() -> None:
    storage = make_storage(block_size=4)
    table = torch.tensor([5, 2, 7], dtype=torch.int32)
    n = 10
    pos = torch.arange(n)
    slots = table.long()[pos // 4] * 4 + pos % 4
    key = torch.randn(n, 8, 128, device=DEVICE)
    storage.write(1, slots, key, -key)  # CPU slot mapping
    storage.write(0, slots.to(DEVICE), key, key)  # device slot mapping
    k, v = storage.gather(1, table, n)
    assert torch.equal(k, key) and torch.equal(v, -key)
    assert torch.equal(storage.kv_caches[1][0, 2, 0], key[4])
    assert bool((storage.kv_caches[1][:, 7, 2:] == 0).all())
    with pytest.raises(InvalidInput, match="out of range"):
        storage.write(0, torch.tensor([64]), key[:1], key[:1])
    with pytest.raises(InvalidInput, match="must be on"):
        storage.write(0, slots, key.cpu(), key.cpu())


def test_copy_blocks_on_cuda() -> None:
    storage = make_storage(dtype=torch.bfloat16)
    fill_distinct(storage)
    before = [cache.clone() for cache in storage.kv_caches]
    storage.copy_blocks([1, 4], [3, 0])
    for cache, old in zip(storage.kv_caches, before, strict=True):
        assert torch.equal(cache[:, [3, 0]], old[:, [1, 4]])
        others = [i for i in range(16) if i not in (0, 3)]
        assert torch.equal(cache[:, others], old[:, others])


def test_paged_attention_on_cuda_matches_sdpa() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 16, generator=gen).to(DEVICE)
    tables = torch.tensor([[4, 1, 3], [0, 5, 2]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([9, 12], dtype=torch.int32, device=DEVICE)
    query = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    out = paged_decode_attention(query, cache, tables, lens)
    starts = torch.tensor([0, 3, 7], dtype=torch.int32)
    prefill_q = torch.randn(7, 4, 16, generator=gen).to(DEVICE)
    prefill = paged_prefill_attention(prefill_q, cache, tables, starts, lens)
    for i, ctx in enumerate((9, 12)):
        ids = tables[i].long()
        k = cache[0, ids].flatten(0, 1)[:ctx].transpose(0, 1)[None]
        v = cache[1, ids].flatten(0, 1)[:ctx].transpose(0, 1)[None]
        dense = F.scaled_dot_product_attention(query[i : i + 1].transpose(0, 1)[None], k, v, enable_gqa=True)
        torch.testing.assert_close(out[i], dense[0, :, 0], atol=1e-5, rtol=1e-5)
        q = prefill_q[starts[i] : starts[i + 1]]
        q_len = q.shape[0]
        mask = torch.arange(ctx, device=DEVICE)[None] <= (ctx - q_len + torch.arange(q_len, device=DEVICE))[:, None]
        dense = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(prefill[starts[i] : starts[i + 1]], dense[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_executor_orders_batches_on_copy_stream() -> None:
    storage = make_storage()
    fill_distinct(storage)
    block1 = storage.kv_caches[0][:, 1].clone()
    executor = CopyExecutor(storage)
    executor.start()
    first = executor.submit([1], [2])
    second = executor.submit(torch.tensor([2]), torch.tensor([3]))
    assert isinstance(first.fence, torch.cuda.Event)
    second.wait(timeout_s=30)
    assert first.done() and executor.completed_seq_no == 2
    assert torch.equal(storage.kv_caches[0][:, 3], block1)
    executor.close()
    with pytest.raises(ManagerClosed):
        executor.submit([0], [1])


def test_copy_waits_for_writes_issued_before_submit() -> None:
    """The copy stream waits on the submitter's current stream (here a delayed side stream)."""
    storage = make_storage(block_size=4)
    executor = CopyExecutor(storage)
    executor.start()
    side = torch.cuda.Stream()
    key = torch.randn(4, 8, 128, device=DEVICE)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the write below lands late
        storage.write(0, torch.arange(4, 8), key, key)  # block 1
        ticket = executor.submit([1], [2])
    ticket.wait(timeout_s=30)
    k, _ = storage.gather(0, torch.tensor([2], dtype=torch.int32), 4)
    torch.cuda.synchronize()
    assert torch.equal(k, key)
    executor.close()


def test_fence_orders_the_consumer_stream() -> None:
    """Model-runner path: write, submit, wait_event(fence), read, with no host wait on the ticket."""
    storage = make_storage(block_size=4)
    executor = CopyExecutor(storage)
    executor.start()
    key = torch.randn(4, 8, 128, device=DEVICE)
    storage.write(1, torch.arange(12, 16), key, -key)  # block 3, on the current stream
    with torch.cuda.stream(executor.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # delay the copy stream so a missing wait would show
    ticket = executor.submit([3], [5])
    torch.cuda.current_stream().wait_event(ticket.fence)
    k, v = storage.gather(1, torch.tensor([5], dtype=torch.int32), 4)
    assert torch.equal(k.cpu(), key.cpu()) and torch.equal(v.cpu(), -key.cpu())
    ticket.wait(timeout_s=30)
    assert ticket.fence.query()
    executor.close()


def test_close_drains_on_cuda() -> None:
    storage = make_storage(num_blocks=32)
    fill_distinct(storage)
    executor = CopyExecutor(storage)
    tickets = [executor.submit([i], [i + 16]) for i in range(16)]
    executor.close()  # no worker started: drained inline
    assert all(t.done() and t.exception() is None for t in tickets)
    assert torch.equal(storage.kv_caches[1][:, 16:32], storage.kv_caches[1][:, :16])


@pytest.mark.anyio
async def test_wait_async_on_cuda() -> None:
    storage = make_storage()
    fill_distinct(storage)
    executor = CopyExecutor(storage)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, executor.run_forever)
            ticket = executor.submit([1, 2], [3, 4])
            await ticket.wait_async()
            executor.close()
    assert torch.equal(storage.kv_caches[0][:, [3, 4]], storage.kv_caches[0][:, [1, 2]])
