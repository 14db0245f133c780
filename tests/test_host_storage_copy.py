"""Cross-tier copy batches through the stream worker on CPU: CopyExecutor.submit_tiers.

A batch runs device -> host, then device -> device, then host -> device. The
tests compare the real tensors with a plain model of the three phases.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.errors import ActorCrashed, InvalidInput, ManagerClosed
from akv.storage import CopyExecutor, KVStorage, tier_copy
from akv.storage.row_copy import KINDS, RowCopyPlan, copy_rows
from akv.storage.tier_copy import TierCopier

NUM_BLOCKS, NUM_HOST = 10, 8


def make_storage(
    dtype: torch.dtype = torch.float32, num_host_blocks: int = NUM_HOST, head_dim: int = 3, shared_memory: bool = False
) -> KVStorage:
    storage = KVStorage(
        num_blocks=NUM_BLOCKS,
        block_size=4,
        num_layers=2,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
        num_host_blocks=num_host_blocks,
        shared_memory=shared_memory,
    )
    gen = torch.Generator().manual_seed(7)
    for cache in storage.kv_caches + (storage.host.kv_caches if storage.host is not None else []):
        cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape, generator=gen))
    return storage


def snapshot(storage: KVStorage) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    assert storage.host is not None
    return [c.clone() for c in storage.kv_caches], [c.clone() for c in storage.host.kv_caches]


def apply_model(dev: list[torch.Tensor], host: list[torch.Tensor], **batch: list[int]) -> None:
    """The three phases on plain tensors, one pair at a time (each phase reads before it writes)."""
    for d, h in zip(dev, host, strict=True):
        rows = [d[:, s].clone() for s in batch.get("d2h_src_ids", [])]
        for slot, row in zip(batch.get("d2h_dst_slots", []), rows, strict=True):
            h[:, slot] = row
        rows = [d[:, s].clone() for s in batch.get("d2d_src_ids", [])]
        for dst, row in zip(batch.get("d2d_dst_ids", []), rows, strict=True):
            d[:, dst] = row
        rows = [h[:, s].clone() for s in batch.get("h2d_src_slots", [])]
        for dst, row in zip(batch.get("h2d_dst_ids", []), rows, strict=True):
            d[:, dst] = row


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytewise equality (random bytes include NaNs, which torch.equal never equates)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_same(storage: KVStorage, dev: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    assert storage.host is not None
    for got, want in zip(storage.kv_caches + storage.host.kv_caches, dev + host, strict=True):
        assert same(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_device_host_device_is_byte_exact(dtype: torch.dtype) -> None:
    storage = make_storage(dtype)
    original = [c.clone() for c in storage.kv_caches]
    executor = CopyExecutor(storage)
    executor.start()
    ids = [7, 2, 9, 0, 4]
    slots = [5, 1, 6, 0, 3]
    out = executor.submit_tiers(d2h_src_ids=ids, d2h_dst_slots=slots)
    back = executor.submit_tiers(h2d_src_slots=slots, h2d_dst_ids=[1, 3, 5, 6, 8])
    back.wait(timeout_s=10)
    assert out.done() and out.exception() is None
    for cache, old in zip(storage.kv_caches, original, strict=True):
        assert same(cache[:, [1, 3, 5, 6, 8]], old[:, ids])
    executor.close()


def test_ticket_counts_every_phase() -> None:
    storage = make_storage()
    executor = CopyExecutor(storage)
    ticket = executor.submit_tiers(
        d2h_src_ids=[1, 2], d2h_dst_slots=[0, 1], d2d_src_ids=[3], d2d_dst_ids=[4], h2d_src_slots=[5], h2d_dst_ids=[6]
    )
    assert (ticket.num_blocks, ticket.d2h_blocks, ticket.h2d_blocks) == (4, 2, 1)
    assert ticket.nbytes == 4 * storage.bytes_per_block
    plain = executor.submit([0], [9])
    assert (plain.num_blocks, plain.d2h_blocks, plain.h2d_blocks, plain.seq_no) == (1, 0, 0, 2)
    executor.close()
    assert plain.done() and ticket.exception() is None


def test_a_demoted_block_is_read_before_it_is_promoted_into() -> None:
    # Block 3 goes to slot 0 and, in the same batch, slot 2 comes back into
    # block 3; block 5 is copied to block 7 (phase b) which slot 4 then
    # overwrites (phase c wins); slot 1 is written by phase a and read by c.
    storage = make_storage()
    dev, host = snapshot(storage)
    dev0, host0 = snapshot(storage)
    batch = {
        "d2h_src_ids": [3, 6],
        "d2h_dst_slots": [0, 1],
        "d2d_src_ids": [5, 3],
        "d2d_dst_ids": [7, 8],
        "h2d_src_slots": [2, 4, 1],
        "h2d_dst_ids": [3, 7, 9],
    }
    executor = CopyExecutor(storage)
    executor.submit_tiers(**batch)
    executor.close()
    apply_model(dev, host, **batch)
    assert_same(storage, dev, host)
    assert storage.host is not None
    for layer, cache in enumerate(storage.kv_caches):
        assert same(storage.host.kv_caches[layer][:, 0], dev0[layer][:, 3])  # demoted first
        assert same(cache[:, 3], host0[layer][:, 2])  # then promoted into
        assert same(cache[:, 8], dev0[layer][:, 3])  # phase b read block 3 before phase c wrote it
        assert same(cache[:, 7], host0[layer][:, 4])  # phase c wins over phase b
        assert same(cache[:, 9], dev0[layer][:, 6])  # slot 1: written by a, read by c


def test_batches_run_in_submission_order() -> None:
    storage = make_storage()
    dev, host = snapshot(storage)
    executor = CopyExecutor(storage)
    batches = [
        {"d2h_src_ids": [2], "d2h_dst_slots": [4]},
        {"d2d_src_ids": [5], "d2d_dst_ids": [2]},  # overwrites block 2 after it was demoted
        {"h2d_src_slots": [4], "h2d_dst_ids": [6]},  # reads what the first batch wrote
        {"d2h_src_ids": [6], "d2h_dst_slots": [7], "h2d_src_slots": [7], "h2d_dst_ids": [0]},
    ]
    tickets = [executor.submit_tiers(**b) for b in batches]  # all queued before the worker starts
    assert [t.seq_no for t in tickets] == [1, 2, 3, 4]
    executor.start()
    tickets[-1].wait(timeout_s=10)
    for b in batches:
        apply_model(dev, host, **b)
    assert_same(storage, dev, host)
    assert executor.completed_seq_no == 4
    executor.close()


def test_ids_mutated_after_submit_do_not_change_the_queued_copy() -> None:
    storage = make_storage()
    dev, host = snapshot(storage)
    executor = CopyExecutor(storage)
    src = torch.tensor([1, 2])
    slots = torch.tensor([3, 4], dtype=torch.int32)
    dst = torch.tensor([5])
    executor.submit_tiers(d2h_src_ids=src, d2h_dst_slots=slots, h2d_src_slots=torch.tensor([0]), h2d_dst_ids=dst)
    executor.submit(src[:1], dst)
    src.fill_(NUM_BLOCKS + 5)  # the batches are queued, not run: the worker has not started
    slots.fill_(-1)
    dst.fill_(0)
    executor.close()  # runs them now
    apply_model(dev, host, d2h_src_ids=[1, 2], d2h_dst_slots=[3, 4], h2d_src_slots=[0], h2d_dst_ids=[5])
    apply_model(dev, host, d2d_src_ids=[1], d2d_dst_ids=[5])
    assert_same(storage, dev, host)


BAD_BATCHES = [
    ({"d2h_src_ids": [1, 2], "d2h_dst_slots": [0]}, "d2h_src_ids has 2 ids but d2h_dst_slots has 1"),
    ({"h2d_src_slots": [1], "h2d_dst_ids": []}, "h2d_src_slots has 1 ids but h2d_dst_ids has 0"),
    ({"d2h_src_ids": [NUM_BLOCKS], "d2h_dst_slots": [0]}, "d2h_src_ids out of range"),  # the null block
    ({"d2h_src_ids": [1], "d2h_dst_slots": [NUM_HOST]}, "d2h_dst_slots out of range"),
    ({"d2h_src_ids": [1], "d2h_dst_slots": [-1]}, "d2h_dst_slots out of range"),
    ({"h2d_src_slots": [NUM_HOST], "h2d_dst_ids": [0]}, "h2d_src_slots out of range"),
    ({"h2d_src_slots": [0], "h2d_dst_ids": [NUM_BLOCKS]}, "h2d_dst_ids out of range"),
    ({"d2h_src_ids": [1, 2], "d2h_dst_slots": [3, 3]}, "d2h_dst_slots contains duplicates"),
    ({"h2d_src_slots": [1, 2], "h2d_dst_ids": [4, 4]}, "h2d_dst_ids contains duplicates"),
    ({"d2d_src_ids": [1, 2], "d2d_dst_ids": [3, 3]}, "dst_block_ids contains duplicates"),
    ({"d2d_src_ids": [1, 2], "d2d_dst_ids": [2, 3]}, "both source and destination"),
    ({"d2d_src_ids": [1], "d2d_dst_ids": [NUM_BLOCKS]}, "dst_block_ids out of range"),
    ({"d2h_src_ids": [1.0], "d2h_dst_slots": [0]}, "d2h_src_ids must be ints"),
    ({"d2h_src_ids": torch.tensor([[1]]), "d2h_dst_slots": [0]}, "must be 1-D"),
    ({"h2d_src_slots": torch.tensor([1.0]), "h2d_dst_ids": [0]}, "dtype int32 or int64"),
    ({"h2d_src_slots": 3, "h2d_dst_ids": [0]}, "h2d_src_slots must be ints"),
]


@pytest.mark.parametrize(("batch", "match"), BAD_BATCHES)
def test_bad_batches_raise_and_queue_nothing(batch: dict, match: str) -> None:
    storage = make_storage()
    dev, host = snapshot(storage)
    executor = CopyExecutor(storage)
    valid = {"d2h_src_ids": [0], "d2h_dst_slots": [1], "h2d_src_slots": [2], "h2d_dst_ids": [3]}
    with pytest.raises(InvalidInput, match=match):
        executor.submit_tiers(**{**valid, **batch})
    executor.close()  # runs whatever was queued: nothing
    assert executor.completed_seq_no == 0
    assert_same(storage, dev, host)


def test_host_pairs_without_a_host_tier_are_refused() -> None:
    storage = make_storage(num_host_blocks=0)
    executor = CopyExecutor(storage)
    with pytest.raises(InvalidInput, match="no host tier"):
        executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0])
    with pytest.raises(InvalidInput, match="no host tier"):
        executor.submit_tiers(h2d_src_slots=[0], h2d_dst_ids=[1])
    assert executor.submit_tiers(d2d_src_ids=[1], d2d_dst_ids=[2]).seq_no == 1  # CoW still works
    assert executor.submit_tiers().num_blocks == 0  # an empty batch is a no-op ticket
    executor.close()


def test_metadata_mode_counts_and_completes_inside_submit() -> None:
    executor = CopyExecutor(None)
    ticket = executor.submit_tiers(d2h_src_ids=[1, 2], d2h_dst_slots=[9, 8], h2d_src_slots=[3], h2d_dst_ids=[1])
    assert ticket.done() and ticket.fence is None and ticket.nbytes == 0
    assert (ticket.seq_no, ticket.num_blocks, ticket.d2h_blocks, ticket.h2d_blocks) == (1, 3, 2, 1)
    assert executor.completed_seq_no == 1
    with pytest.raises(InvalidInput, match="h2d_src_slots has 1 ids but h2d_dst_ids has 2"):
        executor.submit_tiers(h2d_src_slots=[1], h2d_dst_ids=[1, 2])
    assert executor.submit([0], [1]).seq_no == 2  # the refused batch took no number
    executor.close()
    with pytest.raises(ManagerClosed):
        executor.submit_tiers(d2h_src_ids=[0], d2h_dst_slots=[0])


def test_worker_failure_breaks_the_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = make_storage()
    executor = CopyExecutor(storage)
    crashes: list[ActorCrashed] = []
    executor.on_failure = crashes.append

    def fail(self: TierCopier, batch: object) -> None:
        raise RuntimeError("host memory gone")

    monkeypatch.setattr(TierCopier, "run", fail)
    first = executor.submit_tiers(d2h_src_ids=[0], d2h_dst_slots=[0])
    second = executor.submit_tiers(h2d_src_slots=[0], h2d_dst_ids=[1])
    executor.start()
    with pytest.raises(RuntimeError, match="host memory gone"):
        first.wait(timeout_s=10)
    with pytest.raises(ActorCrashed):
        second.wait(timeout_s=10)
    assert len(crashes) == 2  # once per failed batch, as documented
    assert all(isinstance(crash.cause, RuntimeError) for crash in crashes)
    with pytest.raises(ActorCrashed):
        executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[1])
    with pytest.raises(ActorCrashed):
        executor.submit([1], [2])
    executor.close()


def test_closed_executor_refuses_and_abort_leaves_host_untouched() -> None:
    storage = make_storage()
    dev, host = snapshot(storage)
    executor = CopyExecutor(storage)
    ticket = executor.submit_tiers(d2h_src_ids=[0, 1], d2h_dst_slots=[2, 3])
    executor.close(drain=False)
    assert isinstance(ticket.exception(), ManagerClosed)
    assert_same(storage, dev, host)
    with pytest.raises(ManagerClosed):
        executor.submit_tiers(d2h_src_ids=[0], d2h_dst_slots=[0])


def test_long_batches_take_every_plan_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 KiB rows in a 64-block pool: contiguous, gathered, scattered and
    # chunked phases all occur among these batches; each checked against the model.
    storage = KVStorage(
        num_blocks=64,
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device="cpu",
        num_host_blocks=48,
    )
    assert storage.host is not None
    for cache in storage.kv_caches + storage.host.kv_caches:
        cache.normal_()
    dev, host = snapshot(storage)
    gen = torch.Generator().manual_seed(3)

    def perm(n: int, k: int) -> list[int]:
        return torch.randperm(n, generator=gen)[:k].tolist()

    batches = [
        {"d2h_src_ids": list(range(8, 40)), "d2h_dst_slots": list(range(10, 42))},  # runs
        {"d2h_src_ids": perm(64, 40), "d2h_dst_slots": list(range(0, 40))},  # gather
        {"h2d_src_slots": list(range(5, 45)), "h2d_dst_ids": perm(64, 40)},  # scatter
        {"h2d_src_slots": perm(48, 40), "h2d_dst_ids": perm(64, 40)},  # chunked
        {
            "d2h_src_ids": perm(64, 30),
            "d2h_dst_slots": perm(48, 30),
            "h2d_src_slots": perm(48, 30),
            "h2d_dst_ids": perm(64, 30),
        },
    ]
    kinds: set[str] = set()

    def recording(dst: torch.Tensor, src: torch.Tensor, plan: RowCopyPlan) -> None:
        kinds.add(plan.kind)
        copy_rows(dst, src, plan)

    monkeypatch.setattr(tier_copy, "copy_rows", recording)
    executor = CopyExecutor(storage)
    for b in batches:
        executor.submit_tiers(**b)
        apply_model(dev, host, **b)
    executor.close()
    assert_same(storage, dev, host)
    assert kinds == set(KINDS)


@st.composite
def tier_batches(draw: st.DrawFn) -> dict[str, list[int]]:
    """One valid batch: distinct destinations per phase, phase (b) sources and destinations disjoint."""
    a = draw(st.integers(0, NUM_HOST))
    d2h_dst = draw(st.permutations(range(NUM_HOST)))[:a]
    d2h_src = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=a, max_size=a))
    b_ids = draw(st.permutations(range(NUM_BLOCKS)))
    b = draw(st.integers(0, NUM_BLOCKS // 2))
    d2d_dst = b_ids[:b]
    d2d_src = draw(st.lists(st.sampled_from(b_ids[b:]), min_size=b, max_size=b))
    c = draw(st.integers(0, NUM_BLOCKS))
    h2d_dst = draw(st.permutations(range(NUM_BLOCKS)))[:c]
    h2d_src = draw(st.lists(st.integers(0, NUM_HOST - 1), min_size=c, max_size=c))
    return {
        "d2h_src_ids": d2h_src,
        "d2h_dst_slots": d2h_dst,
        "d2d_src_ids": d2d_src,
        "d2d_dst_ids": d2d_dst,
        "h2d_src_slots": h2d_src,
        "h2d_dst_ids": h2d_dst,
    }


@settings(max_examples=60)
@given(batches=st.lists(tier_batches(), min_size=1, max_size=4), as_tensors=st.booleans())
def test_random_batches_match_the_model_of_three_phases(batches: list[dict[str, list[int]]], as_tensors: bool) -> None:
    storage = make_storage(head_dim=5)  # odd rows: int32 words
    dev, host = snapshot(storage)
    executor = CopyExecutor(storage)
    for b in batches:
        args = {k: torch.tensor(v, dtype=torch.int32) for k, v in b.items()} if as_tensors else b
        ticket = executor.submit_tiers(**args)
        assert ticket.num_blocks == sum(
            len(v) for k, v in b.items() if k.endswith("dst_slots") or k.endswith("dst_ids")
        )
        apply_model(dev, host, **b)
    executor.close()
    assert executor.completed_seq_no == len(batches)
    assert_same(storage, dev, host)
