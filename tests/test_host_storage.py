"""The host tier's tensors (akv.storage.host_pool) and the one-pass row copies under the cross-tier batches."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.config import MODEL_SHAPES, KVCacheConfig, ModelShape
from akv.errors import InvalidInput
from akv.storage import HostKVStorage, KVStorage
from akv.storage.row_copy import KINDS, copy_rows, plan_row_copy, run_starts, runs_of
from akv.storage.tensor_args import row_view


def make_host(num_blocks: int = 6, dtype: torch.dtype = torch.float32) -> HostKVStorage:
    return HostKVStorage(num_blocks=num_blocks, block_size=4, num_layers=2, num_kv_heads=2, head_dim=3, dtype=dtype)


def fill_distinct(caches: list[torch.Tensor]) -> None:
    for layer, cache in enumerate(caches):
        cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(cache.shape) + layer * 1e5)


# ------------------------------------------------------------------ the pool
def test_from_config_builds_a_host_pool_with_the_device_layout() -> None:
    shape = ModelShape(name="x", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    storage = KVStorage.from_config(KVCacheConfig(num_blocks=5, block_size=4, model=shape, host_blocks=7))
    assert storage is not None and storage.host is not None
    host = storage.host
    assert len(host.kv_caches) == 3
    for cache in host.kv_caches:
        assert cache.shape == (2, 7, 4, 2, 8)  # no null block on the host
        assert cache.dtype == torch.bfloat16 and cache.device.type == "cpu"
        assert cache.is_contiguous() and not cache.is_pinned()  # pinned only for a CUDA pool
    assert not host.pinned
    assert host.bytes_per_block == storage.bytes_per_block == shape.bytes_per_block(4)
    assert host.nbytes == 7 * storage.bytes_per_block
    assert "host_blocks=7" in repr(storage) and "pinned=False" in repr(host)


def test_host_gib_and_no_tier() -> None:
    config = KVCacheConfig(num_blocks=4, model=MODEL_SHAPES["tiny"], host_gib=1 / 2**17)  # 8 KiB: one tiny block
    storage = KVStorage.from_config(config)
    assert storage is not None and storage.host is not None
    assert storage.host.num_blocks == config.num_host_blocks == 1
    plain = KVStorage.from_config(KVCacheConfig(num_blocks=4))
    assert plain is not None and plain.host is None
    assert KVStorage.from_config(KVCacheConfig(num_blocks=4, storage="none", host_blocks=100)) is None


@pytest.mark.parametrize("bad", [-1, True, 2.0, "3"])
def test_num_host_blocks_must_be_a_non_negative_int(bad: object) -> None:
    with pytest.raises(InvalidInput, match="num_host_blocks"):
        KVStorage(
            num_blocks=2,
            block_size=4,
            num_layers=1,
            num_kv_heads=1,
            head_dim=2,
            dtype=torch.float32,
            device="cpu",
            num_host_blocks=bad,  # type: ignore[arg-type]
        )


def test_host_constructor_rejects_bad_sizes_and_dtype() -> None:
    with pytest.raises(InvalidInput, match="host pool num_blocks"):
        HostKVStorage(num_blocks=0, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    with pytest.raises(InvalidInput, match="dtype"):
        HostKVStorage(num_blocks=1, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")  # type: ignore[arg-type]


def test_allocation_failure_names_the_gib() -> None:
    # 2**31 slots of 2**20 float32 elements per plane: 16 PiB, more than any address space.
    with pytest.raises(InvalidInput, match=r"cannot allocate the host KV pool \(16,777,216.00 GiB of host memory\)"):
        HostKVStorage(
            num_blocks=2**31, block_size=2**10, num_layers=1, num_kv_heads=1, head_dim=2**10, dtype=torch.float32
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works here")
def test_pinned_without_cuda_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="pinned host pool needs CUDA"):
        HostKVStorage(
            num_blocks=1,
            block_size=4,
            num_layers=1,
            num_kv_heads=1,
            head_dim=2,
            dtype=torch.float32,
            cuda_device="cuda",
        )


def test_read_block_read_blocks_and_gather() -> None:
    host = make_host()
    fill_distinct(host.kv_caches)
    assert torch.equal(host.read_block(1, 4), host.kv_caches[1][:, 4])
    got = host.read_blocks(0, torch.tensor([5, 0, 5], dtype=torch.int32))
    assert got.shape == (2, 3, 4, 2, 3) and torch.equal(got, host.kv_caches[0][:, [5, 0, 5]])
    got[:] = -1  # a copy, not a view
    assert host.kv_caches[0].min() >= 0
    k, v = host.gather(1, torch.tensor([3, 1, 2]), 6)  # 4 tokens of slot 3, 2 of slot 1
    assert torch.equal(k, torch.cat([host.kv_caches[1][0, 3], host.kv_caches[1][0, 1, :2]]))
    assert torch.equal(v, torch.cat([host.kv_caches[1][1, 3], host.kv_caches[1][1, 1, :2]]))
    k, _ = host.gather(0, torch.tensor([2, 99]), 4)  # a slot past the tokens read is not checked
    assert torch.equal(k, host.kv_caches[0][0, 2])


def test_host_readers_reject_bad_input() -> None:
    host = make_host()
    with pytest.raises(InvalidInput, match="layer"):
        host.read_block(2, 0)
    with pytest.raises(InvalidInput, match="slots out of range"):
        host.read_blocks(0, [6])
    with pytest.raises(InvalidInput, match="slot must be an int"):
        host.read_block(0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="num_tokens"):
        host.gather(0, torch.tensor([0]), 5)
    with pytest.raises(InvalidInput, match="slot_table out of range"):
        host.gather(0, torch.tensor([-1]), 1)
    with pytest.raises(InvalidInput, match=r"torch\.Tensor"):
        host.gather(0, [0], 1)  # type: ignore[arg-type]


def test_float8_host_pool_reads_bytewise() -> None:
    host = make_host(dtype=torch.float8_e4m3fn)
    host.kv_caches[0].view(torch.uint8)[:, 2] = 7
    assert host.read_block(0, 2).dtype == torch.float8_e4m3fn
    assert bool((host.read_block(0, 2).view(torch.uint8) == 7).all())


# ------------------------------------------------------------- row copies
def test_row_view_uses_the_widest_integer_dividing_a_row() -> None:
    bf16 = torch.zeros((2, 3, 16, 8, 128), dtype=torch.bfloat16)
    assert row_view(bf16).shape == (2, 3, 16 * 8 * 128 // 4) and row_view(bf16).dtype == torch.int64
    odd = torch.zeros((2, 3, 1, 1, 3), dtype=torch.float8_e4m3fn)
    assert row_view(odd).dtype == torch.uint8 and row_view(odd).shape == (2, 3, 3)
    halves = torch.zeros((2, 3, 1, 1, 3), dtype=torch.float16)
    assert row_view(halves).dtype == torch.int16
    assert row_view(bf16).data_ptr() == bf16.data_ptr()


def test_run_starts_and_runs() -> None:
    ids = np.array([3, 4, 5, 9, 10, 2])
    assert run_starts(ids).tolist() == [0, 3, 5]
    assert run_starts(ids, np.array([0, 1, 7, 8, 9, 10])).tolist() == [0, 2, 3, 5]
    assert runs_of(run_starts(ids), ids) == ((3, 0, 3), (9, 3, 2), (2, 5, 1))


def test_planner_picks_slices_for_runs_and_gathers_for_contiguous_destinations() -> None:
    contiguous = plan_row_copy(np.arange(10, 20), np.arange(40, 50), row_bytes=4096)
    assert (contiguous.kind, contiguous.runs) == ("runs", ((10, 40, 10),))
    two_runs = plan_row_copy(np.array([7, 8, 1, 2]), np.array([3, 4, 20, 21]), row_bytes=4096)
    assert (two_runs.kind, two_runs.runs) == ("runs", ((1, 20, 2), (7, 3, 2)))
    rng = np.random.default_rng(0)
    gather = plan_row_copy(np.arange(64), rng.permutation(1000)[:64], row_bytes=4096)
    assert gather.kind == "gather" and gather.runs == ((0, 0, 64),)
    scatter = plan_row_copy(rng.permutation(1000)[:64], np.arange(64), row_bytes=4096)
    assert scatter.kind == "scatter" and len(scatter.runs) == 1
    small_rows = plan_row_copy(rng.permutation(1000)[:64], rng.permutation(1000)[:64], row_bytes=256)
    assert small_rows.kind == "chunked"
    with pytest.raises(ValueError, match="unknown row copy kind"):
        plan_row_copy(np.arange(2), np.arange(2), 8, kind="memcpy")


@settings(max_examples=60)
@given(data=st.data(), kind=st.sampled_from((None, *KINDS)))
def test_every_plan_kind_copies_exactly_the_pairs(data: st.DataObject, kind: str | None) -> None:
    n_dst, n_src = 12, 10
    dst_ids = data.draw(st.lists(st.integers(0, n_dst - 1), unique=True, max_size=n_dst))
    src_ids = data.draw(st.lists(st.integers(0, n_src - 1), min_size=len(dst_ids), max_size=len(dst_ids)))
    row = data.draw(st.sampled_from([3, 8, 300]))  # 300 int64 words: chunks of 218 rows
    src = torch.arange(2 * n_src * row, dtype=torch.int64).view(2, n_src, row)
    dst = -torch.ones((2, n_dst, row), dtype=torch.int64)
    want = dst.clone()
    for d, s in zip(dst_ids, src_ids):
        want[:, d] = src[:, s]
    plan = plan_row_copy(np.array(dst_ids, dtype=np.int64), np.array(src_ids, dtype=np.int64), row * 8, kind=kind)
    copy_rows(dst, src, plan)
    assert torch.equal(dst, want)


def test_chunked_plan_spans_several_chunks() -> None:
    rng = np.random.default_rng(1)
    dst_ids, src_ids = rng.permutation(500)[:300], rng.permutation(400)[:300]
    plan = plan_row_copy(dst_ids, src_ids, row_bytes=4096, kind="chunked")
    assert plan.chunk_rows == 64 and plan.num_pairs == 300  # 512 KiB / (2 * 4 KiB): five chunks
    src = torch.randint(0, 2**62, (2, 400, 512), dtype=torch.int64)
    dst = torch.zeros((2, 500, 512), dtype=torch.int64)
    copy_rows(dst, src, plan)
    assert torch.equal(dst[:, torch.from_numpy(dst_ids)], src[:, torch.from_numpy(src_ids)])
    untouched = np.setdiff1d(np.arange(500), dst_ids)
    assert not dst[:, torch.from_numpy(untouched)].any()


def test_a_host_pool_larger_than_the_machine_is_invalid_input_before_allocating() -> None:
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shape = ModelShape(name="x", num_layers=4, num_kv_heads=8, head_dim=128, dtype="float32")
    blocks = physical // shape.bytes_per_block(1) + 1
    with pytest.raises(InvalidInput, match="more than this machine"):
        KVStorage.from_config(KVCacheConfig(num_blocks=5, block_size=1, model=shape, host_blocks=blocks))


def test_a_host_pool_larger_than_the_memory_available_now_is_invalid_input_before_allocating() -> None:
    from akv.storage.host_pool import available_memory

    available = available_memory()
    if available is None:
        pytest.skip("no MemAvailable in /proc/meminfo")
    shape = ModelShape(name="x", num_layers=4, num_kv_heads=8, head_dim=128, dtype="float32")
    per_block = shape.bytes_per_block(1)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    blocks = (available + physical) // 2 // per_block  # halfway between what is available and the machine
    if not available + 64 * 2**20 < blocks * per_block < physical:
        pytest.skip("available memory is within 128 MiB of the machine's here")
    with pytest.raises(InvalidInput, match="available now"):
        KVStorage.from_config(KVCacheConfig(num_blocks=5, block_size=1, model=shape, host_blocks=blocks))
