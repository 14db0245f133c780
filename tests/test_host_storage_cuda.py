"""The host tier on a CUDA device: pinned pool, cross-tier batches on the copy stream, the fence.

Both routes of :mod:`akv.storage.tier_cuda` run: DMA per run of host slots
(contiguous slots, or ``zero_copy=False``) and zero-copy kernels on the device
alias of the pinned pool (fragmented slots).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.errors import InvalidInput
from akv.storage import CopyExecutor, KVStorage
from akv.storage.tier_cuda import DMA_MAX_RUNS
from tests.test_host_storage_copy import NUM_BLOCKS, NUM_HOST, apply_model, same, tier_batches

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: tens of ms, enough to expose a missing dependency


def make_storage(num_blocks: int = NUM_BLOCKS, num_host: int = NUM_HOST, dtype=torch.bfloat16) -> KVStorage:
    storage = KVStorage(
        num_blocks=num_blocks,
        block_size=16,
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        device=DEVICE,
        num_host_blocks=num_host,
    )
    gen = torch.Generator().manual_seed(11)
    assert storage.host is not None
    for cache in storage.kv_caches + storage.host.kv_caches:
        raw = cache.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    torch.cuda.synchronize()
    return storage


def snapshot(storage: KVStorage) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    assert storage.host is not None
    torch.cuda.synchronize()
    return [c.cpu() for c in storage.kv_caches], [c.clone() for c in storage.host.kv_caches]


def assert_same(storage: KVStorage, dev: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    assert storage.host is not None
    torch.cuda.synchronize()
    for got, want in zip(storage.kv_caches, dev, strict=True):
        assert same(got.cpu(), want)
    for got, want in zip(storage.host.kv_caches, host, strict=True):
        assert same(got, want)


def test_host_pool_is_pinned_without_power_of_two_rounding() -> None:
    storage = make_storage(num_host=5)
    assert storage.host is not None and storage.host.pinned
    for cache in storage.host.kv_caches:
        assert cache.is_pinned() and cache.device.type == "cpu"
        assert cache.shape == (2, 5, 16, 8, 128) and cache.dtype == torch.bfloat16
    assert storage.host.nbytes == 5 * storage.bytes_per_block


def test_zero_copy_alias_is_available() -> None:
    executor = CopyExecutor(make_storage())
    assert executor.zero_copy, "the pinned host pool could not be aliased on the device; DMA route only"
    assert not CopyExecutor(make_storage(), zero_copy=False).zero_copy
    executor.close()


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_round_trip_is_byte_exact(zero_copy: bool, contiguous: bool) -> None:
    storage = make_storage(num_blocks=64, num_host=48)
    dev0, _ = snapshot(storage)
    executor = CopyExecutor(storage, zero_copy=zero_copy)
    executor.start()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randperm(64, generator=gen)[:20].tolist()
    slots = list(range(7, 27)) if contiguous else torch.randperm(48, generator=gen)[:20].tolist()
    order = sorted(slots)
    runs = 1 + sum(b - a != 1 for a, b in itertools.pairwise(order))
    assert runs == 1 if contiguous else runs > DMA_MAX_RUNS  # one DMA per plane, or the kernel route
    back_ids = torch.randperm(64, generator=gen)[:20].tolist()
    out = executor.submit_tiers(d2h_src_ids=ids, d2h_dst_slots=slots)
    back = executor.submit_tiers(h2d_src_slots=slots, h2d_dst_ids=back_ids)
    assert isinstance(out.fence, torch.cuda.Event) and isinstance(back.fence, torch.cuda.Event)
    assert (out.d2h_blocks, back.h2d_blocks) == (20, 20)
    back.wait(timeout_s=60)
    torch.cuda.synchronize()
    for layer, cache in enumerate(storage.kv_caches):
        assert same(cache[:, back_ids].cpu(), dev0[layer][:, ids])
        assert same(storage.host.kv_caches[layer][:, slots], dev0[layer][:, ids])
    executor.close()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_demoted_block_reused_as_promotion_destination(zero_copy: bool) -> None:
    storage = make_storage(num_host=16)
    dev, host = snapshot(storage)
    batch = {
        "d2h_src_ids": [3, 6, 1, 8, 0, 2],
        "d2h_dst_slots": [0, 14, 2, 10, 6, 12],  # six runs of one slot: the kernel route when zero-copy
        "d2d_src_ids": [5],
        "d2d_dst_ids": [9],
        "h2d_src_slots": [4, 2, 8, 0, 11, 14],  # slots 2, 0 and 14 written by phase a
        "h2d_dst_ids": [3, 7, 1, 6, 4, 9],  # 3, 1 and 6 demoted by phase a; 9 written by phase b
    }
    executor = CopyExecutor(storage, zero_copy=zero_copy)
    executor.submit_tiers(**batch)
    executor.close()
    apply_model(dev, host, **batch)
    assert_same(storage, dev, host)


@settings(max_examples=25)
@given(batches=st.lists(tier_batches(), min_size=1, max_size=4), zero_copy=st.booleans())
def test_random_batches_match_the_model_on_cuda(batches: list[dict[str, list[int]]], zero_copy: bool) -> None:
    storage = make_storage()
    dev, host = snapshot(storage)
    executor = CopyExecutor(storage, zero_copy=zero_copy)
    for b in batches:
        executor.submit_tiers(**b)
        apply_model(dev, host, **b)
    executor.close()
    assert_same(storage, dev, host)


@pytest.mark.parametrize("zero_copy", [True, False])
def test_fence_orders_a_consumer_after_both_directions(zero_copy: bool) -> None:
    """Promote into a block, wait_event(fence), read it on the current stream: no host wait on the ticket."""
    storage = make_storage(num_host=16)
    _, host = snapshot(storage)
    dev_block3 = storage.kv_caches[0][:, 3].clone()
    executor = CopyExecutor(storage, zero_copy=zero_copy)
    executor.start()
    with torch.cuda.stream(executor.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # delay the copy stream so a missing wait would show
    slots = [0, 2, 4, 6, 9, 12]  # six runs: the kernel route when zero-copy
    ticket = executor.submit_tiers(
        d2h_src_ids=[3, 0, 1, 2, 4, 5], d2h_dst_slots=slots, h2d_src_slots=[5, 3], h2d_dst_ids=[3, 8]
    )
    torch.cuda.current_stream().wait_event(ticket.fence)
    promoted = storage.kv_caches[0][:, [3, 8]].cpu()  # ordered after the copies by the fence alone
    assert same(promoted, host[0][:, [5, 3]])
    ticket.wait(timeout_s=60)
    assert ticket.fence.query()
    assert same(storage.host.kv_caches[0][:, 0], dev_block3.cpu())  # done: the host side is complete
    executor.close()


def test_demotion_waits_for_writes_issued_before_submit() -> None:
    storage = make_storage()
    executor = CopyExecutor(storage)
    executor.start()
    side = torch.cuda.Stream()
    key = torch.randn(16, 8, 128, device=DEVICE).to(torch.bfloat16)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the write below lands late
        storage.write(0, torch.arange(16, 32), key, key)  # block 1
        ticket = executor.submit_tiers(d2h_src_ids=[1, 4], d2h_dst_slots=[6, 2])
    ticket.wait(timeout_s=60)
    assert storage.host is not None
    k, _ = storage.host.gather(0, torch.tensor([6]), 16)
    assert torch.equal(k, key.cpu())
    executor.close()


def test_validation_on_cuda_queues_nothing() -> None:
    storage = make_storage()
    dev, host = snapshot(storage)
    executor = CopyExecutor(storage)
    with pytest.raises(InvalidInput, match="d2h_dst_slots out of range"):
        executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[NUM_HOST], h2d_src_slots=[0], h2d_dst_ids=[2])
    assert executor.submit([0], [1]).seq_no == 1
    executor.close()
    apply_model(dev, host, d2d_src_ids=[0], d2d_dst_ids=[1])
    assert_same(storage, dev, host)
