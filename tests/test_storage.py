"""Tests of akv.storage on CPU: K/V pool, reference paged attention, copy executor."""

from __future__ import annotations

import random
import threading

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.config import MODEL_SHAPES, KVCacheConfig, ModelShape
from akv.errors import ActorCrashed, InvalidInput, ManagerClosed
from akv.storage import (
    CopyExecutor,
    KVStorage,
    paged_decode_attention,
    paged_prefill_attention,
    torch_dtype,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_storage(num_blocks: int = 8, block_size: int = 4, num_layers: int = 2, dtype=torch.float32) -> KVStorage:
    return KVStorage(
        num_blocks=num_blocks,
        block_size=block_size,
        num_layers=num_layers,
        num_kv_heads=2,
        head_dim=3,
        dtype=dtype,
        device="cpu",
    )


def fill_distinct(storage: KVStorage) -> None:
    """Give every element of every layer a distinct value."""
    for layer, cache in enumerate(storage.kv_caches):
        cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(cache.shape) + layer * 1e5)


# ------------------------------------------------------------------ KVStorage
def test_torch_dtype_names() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float8_e4m3fn") is torch.float8_e4m3fn
    with pytest.raises(InvalidInput, match="known: float32"):
        torch_dtype("int8")


def test_from_config_sizes_match_config() -> None:
    config = KVCacheConfig(num_blocks=5, block_size=4, model=MODEL_SHAPES["tiny"])
    storage = KVStorage.from_config(config)
    assert storage is not None
    assert len(storage.kv_caches) == 2
    assert storage.kv_caches[0].shape == (2, 6, 4, 2, 16)  # 5 usable blocks and the null block
    assert storage.null_block_id == config.null_block_id == 5
    assert storage.dtype is torch.float32 and storage.device == torch.device("cpu")
    assert storage.bytes_per_block == config.bytes_per_block
    assert storage.nbytes == config.pool_bytes
    assert all(bool((cache == 0).all()) for cache in storage.kv_caches)
    assert KVStorage.from_config(KVCacheConfig(num_blocks=5, storage="none")) is None


def test_constructor_rejects_bad_sizes() -> None:
    with pytest.raises(InvalidInput, match="block_size"):
        KVStorage(
            num_blocks=4, block_size=0, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu"
        )


def test_write_gather_round_trip_across_block_boundaries() -> None:
    storage = make_storage(num_blocks=8, block_size=4)
    table = torch.tensor([5, 2, 7], dtype=torch.int32)  # non-contiguous, out of order
    n = 10  # 2 full blocks and 2 tokens of the third
    pos = torch.arange(n)
    slots = table.long()[pos // 4] * 4 + pos % 4
    key = torch.arange(n * 2 * 3, dtype=torch.float32).view(n, 2, 3) + 1
    value = -key
    storage.write(1, slots, key, value)

    cache = storage.kv_caches[1]
    # Exact placement at the block boundaries: last of block 5, first of block 2, first of block 7.
    assert torch.equal(cache[0, 5, 3], key[3]) and torch.equal(cache[1, 5, 3], value[3])
    assert torch.equal(cache[0, 2, 0], key[4]) and torch.equal(cache[0, 2, 3], key[7])
    assert torch.equal(cache[0, 7, 0], key[8]) and torch.equal(cache[1, 7, 1], value[9])
    # Nothing else was touched: the tail of block 7, other blocks, the other layer.
    assert bool((cache[:, 7, 2:] == 0).all())
    assert bool((cache[:, [0, 1, 3, 4, 6]] == 0).all())
    assert bool((storage.kv_caches[0] == 0).all())

    k, v = storage.gather(1, table, n)
    assert torch.equal(k, key) and torch.equal(v, value)
    k4, _ = storage.gather(1, table, 4)  # exactly one full block
    assert torch.equal(k4, key[:4])
    k0, v0 = storage.gather(1, table, 0)
    assert k0.shape == (0, 2, 3) and v0.shape == (0, 2, 3)


def test_write_all_layers_matches_per_layer_writes() -> None:
    a, b = make_storage(num_layers=3), make_storage(num_layers=3)
    slots = torch.tensor([0, 31, 9, 16])
    keys = torch.randn(3, 4, 2, 3)
    values = torch.randn(3, 4, 2, 3)
    a.write_all_layers(slots, keys, values)
    for layer in range(3):
        b.write(layer, slots, keys[layer], values[layer])
    assert all(torch.equal(x, y) for x, y in zip(a.kv_caches, b.kv_caches, strict=True))


def test_copy_blocks_copies_exactly_and_leaves_others_untouched() -> None:
    storage = make_storage(num_blocks=8)
    fill_distinct(storage)
    before = [cache.clone() for cache in storage.kv_caches]
    storage.copy_blocks(torch.tensor([1, 4, 6]), torch.tensor([3, 0, 7]))
    for cache, old in zip(storage.kv_caches, before, strict=True):
        assert torch.equal(cache[:, [3, 0, 7]], old[:, [1, 4, 6]])  # K and V
        untouched = [1, 2, 4, 5, 6]
        assert torch.equal(cache[:, untouched], old[:, untouched])
    storage.copy_blocks([2], [5])  # lists work too
    assert torch.equal(storage.kv_caches[0][:, 5], before[0][:, 2])
    storage.copy_blocks(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))


def test_float8_cache_round_trip_is_bytewise() -> None:
    storage = make_storage(dtype=torch.float8_e4m3fn)
    key = torch.randn(3, 2, 3).to(torch.float8_e4m3fn)
    storage.write(0, torch.tensor([4, 5, 6]), key, key)
    storage.copy_blocks([1], [2])
    k, _ = storage.gather(0, torch.tensor([2], dtype=torch.int32), 3)
    assert k.dtype is torch.float8_e4m3fn
    assert torch.equal(k.view(torch.uint8), key.view(torch.uint8))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"slot_mapping": torch.tensor([0, 36])}, "slot_mapping out of range"),  # 32..35: the null block
        ({"slot_mapping": torch.tensor([-1, 0])}, "slot_mapping out of range"),
        ({"slot_mapping": torch.tensor([0.0, 1.0])}, "int32 or int64"),
        ({"slot_mapping": torch.tensor([[0, 1]])}, "1-D"),
        ({"key": torch.zeros(2, 2, 4)}, "key must have shape"),
        ({"value": torch.zeros(2, 2, 3, dtype=torch.float16)}, "value must have dtype"),
        ({"layer": 2}, "layer must be"),
    ],
)
def test_write_rejects_bad_input(kwargs: dict, match: str) -> None:
    storage = make_storage()
    args = {
        "layer": 0,
        "slot_mapping": torch.tensor([0, 1]),
        "key": torch.zeros(2, 2, 3),
        "value": torch.zeros(2, 2, 3),
    }
    args.update(kwargs)
    with pytest.raises(InvalidInput, match=match):
        storage.write(**args)
    assert all(bool((cache == 0).all()) for cache in storage.kv_caches)


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        ([1, 2], [3], "has 2 ids but"),
        ([8], [1], "src_block_ids out of range"),
        ([1], [-1], "dst_block_ids out of range"),
        ([1, 2], [3, 3], "duplicates"),
        ([1, 2], [2, 4], "both source and destination: \\[2\\]"),
        ([1.5], [2], "int32 or int64"),
    ],
)
def test_copy_blocks_rejects_bad_batches(src: list, dst: list, match: str) -> None:
    storage = make_storage()
    fill_distinct(storage)
    before = [cache.clone() for cache in storage.kv_caches]
    with pytest.raises(InvalidInput, match=match):
        storage.copy_blocks(src, dst)
    assert all(torch.equal(a, b) for a, b in zip(storage.kv_caches, before, strict=True))


def test_gather_rejects_bad_input() -> None:
    storage = make_storage()
    with pytest.raises(InvalidInput, match="num_tokens"):
        storage.gather(0, torch.tensor([1, 2], dtype=torch.int32), 9)
    with pytest.raises(InvalidInput, match="block_table out of range"):
        storage.gather(0, torch.tensor([1, 8], dtype=torch.int32), 5)
    # A block past the tokens read is never touched, so it is not checked.
    k, _ = storage.gather(0, torch.tensor([1, 8], dtype=torch.int32), 4)
    assert k.shape == (4, 2, 3)


# ----------------------------------------------------------- paged attention
def build_paged_batch(data: st.DataObject, *, prefill: bool):
    """Random sequences written into a cache through shuffled block tables."""
    block_size = data.draw(st.sampled_from([1, 4, 16]), label="block_size")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
    group = data.draw(st.sampled_from([1, 2, 4]), label="group")
    head_dim = data.draw(st.sampled_from([4, 8]), label="head_dim")
    batch = data.draw(st.integers(1, 3), label="batch")
    ctx_lens = []
    for _ in range(batch):
        full = data.draw(st.integers(0, 3))
        delta = data.draw(st.sampled_from([-1, 0, 1]))
        ctx_lens.append(max(1, full * block_size + delta))
    q_lens = [data.draw(st.integers(0 if prefill else 1, c)) for c in ctx_lens] if prefill else [1] * batch
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)

    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    max_blocks = max(blocks_per_seq) + 1  # one padding column at least
    num_blocks = sum(blocks_per_seq) + 2
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    perm = torch.randperm(num_blocks, generator=gen)  # non-contiguous block ids
    tables = torch.full((batch, max_blocks), num_blocks + 7, dtype=torch.int32)  # padding: invalid on purpose
    keys, values, used = [], [], 0
    for i, ctx in enumerate(ctx_lens):
        ids = perm[used : used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        tables[i, : ids.numel()] = ids.to(torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        pos = torch.arange(ctx)
        cache[0, ids[pos // block_size], pos % block_size] = k
        cache[1, ids[pos // block_size], pos % block_size] = v
        keys.append(k)
        values.append(v)
    num_heads = num_kv_heads * group
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    return cache, tables, torch.tensor(ctx_lens, dtype=torch.int32), q_lens, query, keys, values


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Dense reference: q (L, Hq, D), k/v (S, Hkv, D), mask (L, S) bool -> (L, Hq, D)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True
    )
    return out[0].transpose(0, 1)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_paged_decode_matches_dense_sdpa(data: st.DataObject) -> None:
    cache, tables, ctx_lens, _, query, keys, values = build_paged_batch(data, prefill=False)
    out = paged_decode_attention(query, cache, tables, ctx_lens)
    assert out.shape == query.shape
    for i in range(len(keys)):
        expected = sdpa(query[i : i + 1], keys[i], values[i], None)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_paged_prefill_matches_dense_causal_sdpa(data: st.DataObject) -> None:
    cache, tables, ctx_lens, q_lens, query, keys, values = build_paged_batch(data, prefill=True)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = paged_prefill_attention(query, cache, tables, starts, ctx_lens)
    assert out.shape == query.shape
    for i, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens.tolist(), strict=True)):
        if q_len == 0:
            continue
        q = query[starts[i] : starts[i + 1]]
        # Query row j sits at position ctx - q_len + j and sees positions <= it.
        mask = torch.arange(ctx)[None, :] <= (ctx - q_len + torch.arange(q_len))[:, None]
        expected = sdpa(q, keys[i], values[i], mask)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_scale_and_dtype() -> None:
    cache = torch.randn(2, 3, 4, 1, 8)
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    q = torch.randn(1, 2, 8)
    k = cache[0, [2, 0]].flatten(0, 1)[:6]
    v = cache[1, [2, 0]].flatten(0, 1)[:6]
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=0.3, enable_gqa=True
    )[0].transpose(0, 1)
    torch.testing.assert_close(
        paged_decode_attention(q, cache, tables, lens, scale=0.3), expected, atol=1e-5, rtol=1e-5
    )
    out16 = paged_decode_attention(q.bfloat16(), cache.bfloat16(), tables, lens)
    assert out16.dtype is torch.bfloat16
    reference = paged_decode_attention(q.bfloat16().float(), cache.bfloat16().float(), tables, lens)
    torch.testing.assert_close(out16.float(), reference, atol=2e-2, rtol=2e-2)  # bf16: 8 mantissa bits


def test_paged_attention_rejects_bad_input() -> None:
    cache = torch.zeros(2, 4, 4, 2, 8)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(InvalidInput, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.zeros(1, 3, 8), cache, tables, lens)
    with pytest.raises(InvalidInput, match="head_dim"):
        paged_decode_attention(torch.zeros(1, 2, 4), cache, tables, lens)
    with pytest.raises(InvalidInput, match="context_lens must lie"):
        paged_decode_attention(torch.zeros(1, 2, 8), cache, tables, torch.tensor([9], dtype=torch.int32))
    with pytest.raises(InvalidInput, match=">= 1"):
        paged_decode_attention(torch.zeros(1, 2, 8), cache, tables, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(InvalidInput, match="outside"):
        paged_decode_attention(torch.zeros(1, 2, 8), cache, torch.tensor([[0, 4]], dtype=torch.int32), lens)
    with pytest.raises(InvalidInput, match="query_start_loc"):
        paged_prefill_attention(torch.zeros(3, 2, 8), cache, tables, torch.tensor([0, 2], dtype=torch.int32), lens)
    with pytest.raises(InvalidInput, match="query lengths"):
        paged_prefill_attention(torch.zeros(6, 2, 8), cache, tables, torch.tensor([0, 6], dtype=torch.int32), lens)


# --------------------------------------------------------------- CopyExecutor
def test_executor_runs_batches_in_submission_order() -> None:
    storage = make_storage()
    fill_distinct(storage)
    block1 = [cache[:, 1].clone() for cache in storage.kv_caches]
    executor = CopyExecutor(storage)
    first = executor.submit([1], [2])  # A: 1 -> 2
    second = executor.submit(torch.tensor([2]), torch.tensor([3]))  # B: 2 -> 3, must see A's result
    assert (first.seq_no, second.seq_no) == (1, 2)
    executor.start()
    second.wait(timeout_s=10)
    assert first.done() and second.done()
    assert executor.completed_seq_no == 2
    for cache, original in zip(storage.kv_caches, block1, strict=True):
        assert torch.equal(cache[:, 3], original) and torch.equal(cache[:, 2], original)
    assert first.exception() is None and first.fence is None
    assert (second.num_blocks, second.nbytes) == (1, storage.bytes_per_block)
    executor.close()


def test_executor_rejects_bad_batch_without_consuming_a_seq_no() -> None:
    executor = CopyExecutor(make_storage())
    with pytest.raises(InvalidInput, match="duplicates"):
        executor.submit([1, 2], [3, 3])
    assert executor.submit([1], [2]).seq_no == 1
    executor.close()


def test_close_drains_queued_batches_then_submit_raises() -> None:
    storage = make_storage(num_blocks=16)
    fill_distinct(storage)
    executor = CopyExecutor(storage)
    executor.start()
    tickets = [executor.submit([i], [i + 8]) for i in range(8)]
    executor.close(drain=True)
    assert all(t.done() and t.exception() is None for t in tickets)
    assert executor.completed_seq_no == 8
    assert torch.equal(storage.kv_caches[1][:, 8:16], storage.kv_caches[1][:, :8])
    with pytest.raises(ManagerClosed):
        executor.submit([0], [1])
    executor.close()  # idempotent


def test_close_without_worker_runs_queue_inline_or_fails_it() -> None:
    storage = make_storage()
    fill_distinct(storage)
    drained = CopyExecutor(storage)
    ticket = drained.submit([0], [1])
    drained.close()
    ticket.wait(timeout_s=0)
    assert torch.equal(storage.kv_caches[0][:, 1], storage.kv_caches[0][:, 0])
    drained.run_forever()  # the loop already ran inside close: returns at once

    aborted = CopyExecutor(storage)
    ticket = aborted.submit([2], [3])
    aborted.close(drain=False)
    with pytest.raises(ManagerClosed):
        ticket.wait(timeout_s=0)
    assert isinstance(ticket.exception(), ManagerClosed)
    assert not torch.equal(storage.kv_caches[0][:, 3], storage.kv_caches[0][:, 2])


def test_wait_times_out_and_second_worker_is_refused() -> None:
    executor = CopyExecutor(make_storage())
    ticket = executor.submit([0], [1])
    with pytest.raises(TimeoutError):
        ticket.wait(timeout_s=0.01)
    executor.start()
    with pytest.raises(RuntimeError, match="already running"):
        executor.run_forever()
    ticket.wait(timeout_s=10)
    executor.close()


def test_worker_failure_fails_batch_and_breaks_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = make_storage()
    executor = CopyExecutor(storage)
    boom = RuntimeError("device lost")

    def fail(src: torch.Tensor, dst: torch.Tensor) -> None:
        raise boom

    monkeypatch.setattr(storage, "_copy_unchecked", fail)
    first, second = executor.submit([0], [1]), executor.submit([2], [3])
    executor.start()
    with pytest.raises(RuntimeError, match="device lost"):
        first.wait(timeout_s=10)
    with pytest.raises(ActorCrashed):
        second.wait(timeout_s=10)
    assert executor.completed_seq_no == 2
    with pytest.raises(ActorCrashed):
        executor.submit([4], [5])
    executor.close()


def test_done_callbacks_run_once_done() -> None:
    executor = CopyExecutor(make_storage())
    seen: list[int] = []
    ticket = executor.submit([0], [1])
    ticket.add_done_callback(lambda t: seen.append(t.seq_no))
    assert seen == []
    executor.close()
    ticket.add_done_callback(lambda t: seen.append(-t.seq_no))  # already done: called now
    assert seen == [1, -1]


def test_metadata_mode_completes_at_once() -> None:
    executor = CopyExecutor(None)
    ticket = executor.submit([0, 1, 2], [3, 4, 5])
    assert ticket.done() and ticket.fence is None
    assert (ticket.seq_no, ticket.num_blocks, ticket.nbytes) == (1, 3, 0)
    assert executor.completed_seq_no == 1
    with pytest.raises(InvalidInput):
        executor.submit([0], [])
    executor.close()
    with pytest.raises(ManagerClosed):
        executor.submit([0], [1])


@pytest.mark.anyio
async def test_wait_async_with_worker_run_by_anyio() -> None:
    storage = make_storage()
    fill_distinct(storage)
    executor = CopyExecutor(storage)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, executor.run_forever)
            first = executor.submit([1], [2])
            second = executor.submit([2], [3])
            await second.wait_async()
            assert first.done()
            await first.wait_async()  # already done: returns at once
            executor.close()  # makes run_forever return; the task group then exits
    assert torch.equal(storage.kv_caches[0][:, 3], storage.kv_caches[0][:, 1])


@pytest.mark.anyio
async def test_wait_async_is_cancellable_and_does_not_block_loop() -> None:
    executor = CopyExecutor(make_storage())
    ticket = executor.submit([0], [1])  # no worker: stays pending
    waiting = anyio.Event()
    scope = anyio.CancelScope()
    ticks = 0

    async def waiter() -> None:
        with scope:
            waiting.set()
            await ticket.wait_async()

    # Hang guard: a wait that blocked the loop would hold it until this fails the ticket.
    guard = threading.Timer(10, executor.close, kwargs={"drain": False})
    guard.start()
    with anyio.fail_after(10):  # hang guard only
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await waiting.wait()
            # The loop keeps serving this task while the waiter waits (a
            # blocking wait would hold the loop: no checkpoint would return).
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
                ticks += 1
            assert not ticket.done()
            scope.cancel()
    guard.cancel()
    assert scope.cancelled_caught and ticks == 5
    assert not ticket.done()
    executor.close(drain=False)  # releases the abandoned waiting thread
    assert isinstance(ticket.exception(), ManagerClosed)


def test_submit_is_thread_safe_and_ordered() -> None:
    # Four threads submit 32 single-block copies each, half before the worker
    # starts (a full queue) and half while it runs. Every copy writes its own
    # destination block (nothing is overwritten twice) and reads either the
    # thread's previous destination or a random block, so the result depends
    # on the order. The
    # seq_no each submit returns is the order the copies must run in: replaying
    # them in that order on a copy of the initial contents gives exactly the
    # final storage, and each thread's seq_nos increase in its own order.
    storage = make_storage(num_blocks=160)
    fill_distinct(storage)
    initial = [cache.clone() for cache in storage.kv_caches]
    executor = CopyExecutor(storage)
    submitted: list[tuple[int, int, int]] = []  # (seq_no, src, dst)
    per_thread: dict[int, list[int]] = {}
    lock = threading.Lock()
    queued = threading.Barrier(5, timeout=30)  # the four producers and this thread

    def producer(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        prev = seed
        for i in range(32):
            if i == 16:
                queued.wait()
            dst = 32 + 32 * seed + i
            # Half the copies read this thread's previous destination (a chain).
            src = prev if rng.random() < 0.5 else rng.choice([b for b in range(160) if b != dst])
            prev = dst
            t = executor.submit([src], [dst])
            mine.append(t.seq_no)
            with lock:
                submitted.append((t.seq_no, src, dst))
        per_thread[seed] = mine

    threads = [threading.Thread(target=producer, args=(seed,)) for seed in range(4)]
    for th in threads:
        th.start()
    queued.wait()
    executor.start()
    for th in threads:
        th.join()
    executor.close()
    assert sorted(s for s, _, _ in submitted) == list(range(1, 129))
    assert all(mine == sorted(mine) for mine in per_thread.values()) and len(per_thread) == 4
    assert executor.completed_seq_no == 128
    for _, src, dst in sorted(submitted):
        for cache in initial:
            cache[:, dst] = cache[:, src]
    for got, want in zip(storage.kv_caches, initial, strict=True):
        assert torch.equal(got, want)


def test_model_shape_bytes_per_block_matches_storage() -> None:
    shape = ModelShape(name="x", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    storage = KVStorage.from_config(KVCacheConfig(num_blocks=2, block_size=16, model=shape))
    assert storage is not None and storage.bytes_per_block == shape.bytes_per_block(16)
