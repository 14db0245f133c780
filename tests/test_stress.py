"""The stress harness (issue 3): a short run in the default suite, fault injection, the command,
and regression tests for the library bugs the harness found.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import torch

from akv.config import KVCacheConfig
from akv.core.step import Admit
from akv.manager import KVCacheManager
from akv.stress import StressOptions, main_stress, register, run_stress
from akv.stress.audit import AuditResult, PublishRecord, audit, compare_refcounts
from akv.stress.cli import options_from_args
from akv.stress.kv_io import append, fork, oracle_for, prefill, quiesce, reads_back
from akv.stress.kv_io import history as kv_history
from akv.stress.oracle import KVOracle, history_hashes
from akv.stress.probe import EXPECTED_ORDER, probe_eviction_order, probe_pending_hits, probe_pinned_child
from akv.stress.programs import max_sequence_blocks
from akv.stress.session import tenant_namespaces
from akv.stress.workload import PromptSource, max_prompt_tokens, system_prompt_lengths

ROOT = Path(__file__).resolve().parent.parent
REPORT_KEYS = {
    "operations", "forks", "cow_copies", "evictions", "cancellations", "corrupted_reads",
    "invariant_violations", "leaked_blocks", "ops_per_s", "latency_us", "eviction_batches",
    "prefix_hit_rate", "retries", "max_inbox_depth", "backend", "seed", "duration_s", "sequences",
}  # fmt: skip


# ------------------------------------------------------------------ oracle
def test_oracle_values_are_a_function_of_the_whole_history() -> None:
    oracle = KVOracle(num_layers=2, num_kv_heads=2, head_dim=16)
    a = oracle.values(history_hashes([5, 6, 7]))
    b = oracle.values(history_hashes([5, 6, 8]))
    c = oracle.values(history_hashes([4, 6, 7]))
    assert a.shape == (2, 2, 3, 2, 16)
    assert a.dtype.is_floating_point
    assert (a[:, :, :2] == b[:, :, :2]).all()  # same prefix, same values
    assert not (a[:, :, 2] == b[:, :, 2]).all()  # another last token
    assert not (a[:, :, 1:] == c[:, :, 1:]).any()  # another first token changes every later position
    assert not (a[0] == a[1]).all() and not (a[:, 0] == a[:, 1]).all()  # layer and K/V salted


def test_prompts_cover_block_boundaries_and_are_seeded() -> None:
    assert system_prompt_lengths(16) == [1, 5, 16, 17, 32, 48, 71]
    one, two = PromptSource(3, 16), PromptSource(3, 16)
    assert one.system_prompts == two.system_prompts and one.canned_turns == two.canned_turns
    assert PromptSource(4, 16).system_prompts != one.system_prompts


# -------------------------------------------------------------- short runs
# Runs end after a number of programs (requests), not a time; every assertion is on counts.
def _count_run(**overrides) -> StressOptions:
    fields = {"seed": 1, "sequences": 24, "operations": 120, "duration_s": 900.0}
    fields.update(overrides)
    return StressOptions(**fields)


@pytest.mark.anyio
async def test_short_stress_run_is_clean() -> None:
    report = await run_stress(_count_run(sequences=48, operations=240, audits=3))
    assert sum(report.programs.values()) == 240 and report.programs_budget == 240
    assert report.corrupted_reads == 0, report.samples
    assert report.invariant_violations == 0, report.errors
    assert report.leaked_blocks == 0 and report.leaked_sequences == 0
    assert report.unexpected_errors == 0 and report.hung_calls == 0, report.samples
    assert report.nonempty_inboxes == {}
    assert report.audits == 4 and report.audit_violations == 0, report.errors  # 3 during the run + the end
    assert report.probe_errors == []
    assert report.forks > 0 and report.cow_copies > 0
    assert report.evictions > 0 and report.eviction_batches > 0
    assert report.cancellations > 0 and report.aborts > 0 and report.frees_when_cancelled > 0
    assert report.calls["free_many"] > 0  # several sequences sharing blocks freed in one step
    assert report.verifications > 0 and report.verified_tokens > 0
    assert report.backend == "asyncio" and report.eviction_policy == "slru" and report.namespaces == 3
    assert report.ok, report.failures
    assert set(report.as_json()) >= REPORT_KEYS


@pytest.mark.anyio
@pytest.mark.parametrize(("shards", "policy"), [(2, "lru"), (4, "lfu")])
async def test_sharded_runs_with_each_policy_are_clean(shards: int, policy: str) -> None:
    report = await run_stress(_count_run(seed=shards, shards=shards, eviction_policy=policy))
    assert report.shards == shards and report.eviction_policy in ("lru", "lfu", "slru")
    assert report.audits == 4 and report.audit_violations == 0, report.errors
    assert report.evictions > 0 and report.forks > 0
    assert report.ok, (report.failures, report.errors, report.samples)


HOST_KEYS = {
    "host_blocks", "host_free", "host_cached", "host_swapped", "host_in_use", "demoted_blocks", "promoted_blocks",
    "host_evicted_blocks", "host_hit_tokens", "device_hit_tokens", "swapped_out", "swapped_in", "swap_outs",
    "swap_ins", "swap_refused", "swapped_frees", "cancelled_swaps", "continuations",
}  # fmt: skip


@pytest.mark.anyio
async def test_short_host_tier_run_demotes_promotes_swaps_and_is_clean() -> None:
    report = await run_stress(_count_run(sequences=24, operations=160, host_blocks=128, audits=3))
    h = report.host_tier
    assert set(h) == HOST_KEYS and h["host_blocks"] == 128
    assert h["demoted_blocks"] > 0 and h["promoted_blocks"] > 0 and h["host_hit_tokens"] > 0
    assert h["host_evicted_blocks"] > 0 and h["continuations"] > 0  # the host tier filled and dropped its own
    assert h["swap_outs"] == h["swapped_out"] > 0 and h["swap_ins"] == h["swapped_in"] > 0
    assert h["swapped_frees"] > 0 and h["cancelled_swaps"] > 0
    assert h["swapped_out"] == h["swapped_in"] + h["swapped_frees"]  # every swap-out came back in or was freed
    assert h["host_swapped"] == 0 and h["host_free"] + h["host_cached"] == 128
    assert report.programs["swap"] > 0 and report.calls["swap_out"] > 0 and report.calls["swap_in"] > 0
    assert report.audits == 4 and report.audit_violations == 0, report.errors
    assert report.leaked_blocks == 0 and report.leaked_host_blocks == 0 and report.leaked_sequences == 0
    assert report.corrupted_reads == 0 and report.verified_tokens > 0, report.samples
    assert report.ok, (report.failures, report.errors, report.samples)
    assert report.as_json()["host_tier"] == h


@pytest.mark.anyio
@pytest.mark.parametrize(("shards", "policy"), [(2, "lru"), (3, "lfu")])
async def test_sharded_host_tier_runs_with_slow_copies_are_clean(shards: int, policy: str) -> None:
    """Slow copies (every batch sleeps 1-5 ms) widen every window in which a tier copy is pending."""
    report = await run_stress(
        _count_run(
            seed=shards, shards=shards, eviction_policy=policy, host_blocks=96, fault="slow_copies",
            fault_after_programs=1,
        )
    )  # fmt: skip
    fi = report.fault_injection
    assert fi is not None and fi.injected and not fi.fatal
    assert report.host_tier["demoted_blocks"] > 0 and report.host_tier["swapped_out"] > 0
    assert report.audit_violations == 0 and report.leaked_host_blocks == 0, report.errors
    assert report.ok, (report.failures, report.errors, report.samples)


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["failing_copies", "crash"])
async def test_fatal_fault_with_a_host_tier_reports_leaks_on_both_tiers(fault: str) -> None:
    report = await run_stress(
        _count_run(seed=3, sequences=16, operations=400, host_blocks=64, fault=fault, fault_after_programs=40)
    )
    fi = report.fault_injection
    assert fi is not None and fi.fatal and fi.injected and fi.tasks_failed_fast == fi.tasks == 16
    assert fi.aexit_raised and fi.fresh_manager_ok
    assert report.leaked_blocks == 0 and report.leaked_host_blocks == 0 and report.leaked_sequences == 0
    assert report.ok, (report.failures, report.errors)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"), pytest.param("trio", id="trio")]
)
async def test_short_stress_run_on_other_event_loops(anyio_backend) -> None:
    pytest.importorskip("uvloop" if anyio_backend != "trio" else "trio")
    report = await run_stress(_count_run(seed=2, sequences=16, operations=48))
    assert report.backend == ("trio" if anyio_backend == "trio" else "uvloop")
    assert report.forks > 0 and sum(report.programs.values()) == 48
    assert report.ok, (report.failures, report.errors, report.samples)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fault", "shards", "actor"),
    [
        ("crash", 1, "pool_shard_0"),
        ("shard_exception", 2, "pool_shard_1"),
        ("eviction_crash", 1, "eviction_loop"),
        ("failing_copies", 1, "stream_worker"),
    ],
)
async def test_fatal_fault_fails_every_caller_fast_and_still_reports_leaks(fault: str, shards: int, actor: str) -> None:
    report = await run_stress(
        _count_run(seed=3, sequences=16, operations=400, shards=shards, fault=fault, fault_after_programs=24)
    )
    fi = report.fault_injection
    assert fi is not None and fi.kind == fault and fi.fatal and fi.injected and fi.actor == actor
    assert fi.tasks == 16 and fi.tasks_failed_fast == 16 and fi.tasks_hung == 0
    assert fi.aexit_raised and fi.fresh_manager_ok
    # Recounted from the state the failed manager left behind: figures, never null.
    assert report.leaked_blocks == 0 and report.leaked_sequences == 0
    assert report.corrupted_reads == 0 and report.invariant_violations == 0, report.errors
    assert sum(report.programs.values()) < 400  # every task stopped at the fault, not at the budget
    assert report.ok, report.failures


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("operations", "after"), [(40, 5), (20, 5), (20, 15)])
async def test_fatal_fault_in_a_small_run_reports_every_caller(seed: int, operations: int, after: int) -> None:
    """``--sequences 8 --fault crash`` soon after the start: a failure seen by an audit or a cleanup free is expected."""
    report = await run_stress(
        _count_run(seed=seed, sequences=8, operations=operations, fault="crash", fault_after_programs=after)
    )
    fi = report.fault_injection
    assert fi is not None and fi.injected and fi.tasks_failed_fast == fi.tasks and fi.tasks_hung == 0
    assert report.unexpected_errors == 0 and report.invariant_violations == 0, (report.errors, report.samples)
    assert report.ok, report.failures


@pytest.mark.anyio
async def test_a_timed_fault_the_run_ends_before_says_so() -> None:
    report = await run_stress(_count_run(sequences=8, operations=20, fault="crash", fault_after_s=800.0))
    fi = report.fault_injection
    assert fi is not None and not fi.injected
    assert fi.not_injected == "the run ended before --fault-after-s"
    expected = "fault injection (crash): fault not injected: the run ended before --fault-after-s"
    assert [f for f in report.failures if f.startswith("fault injection")] == [expected]
    assert not report.ok


@pytest.mark.anyio
async def test_slow_copies_leave_a_clean_run() -> None:
    report = await run_stress(_count_run(seed=4, fault="slow_copies", fault_after_programs=1))
    fi = report.fault_injection
    assert fi is not None and fi.kind == "slow_copies" and not fi.fatal and fi.injected
    assert report.cow_copies > 0 and report.audits == 4 and report.audit_violations == 0
    assert report.leaked_blocks == 0 and report.ok, report.failures


@pytest.mark.anyio
async def test_inject_crash_after_s_is_the_crash_fault() -> None:
    report = await run_stress(_count_run(seed=5, sequences=16, operations=10_000, inject_crash_after_s=0.0))
    fi = report.fault_injection
    assert fi is not None and fi.kind == "crash" and fi.injected and fi.tasks_failed_fast == fi.tasks
    assert report.leaked_blocks == 0 and report.ok, report.failures


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("fault", [None, "slow_copies"])
async def test_long_host_tier_run_256_sequences(fault: str | None) -> None:
    """``akv stress --sequences 256 --duration-s 300 --host-blocks 2048``, clean and with slow copies."""
    options = StressOptions(
        seed=1, sequences=256, duration_s=300.0, host_blocks=2048, fault=fault, fault_after_s=1.0, audits=5
    )
    report = await run_stress(options)
    assert report.host_tier["promoted_blocks"] > 0 and report.host_tier["swapped_out"] > 0
    assert report.leaked_blocks == 0 and report.leaked_host_blocks == 0 and report.leaked_sequences == 0
    assert report.ok, (report.failures, report.errors[:5])


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("fault", [None, "slow_copies", "crash", "shard_exception", "eviction_crash", "failing_copies"])
async def test_long_run_512_sequences(fault: str | None) -> None:
    """``akv stress --sequences 512 --duration-s 300`` with each fault (fatal ones fire after 2,000 programs)."""
    shards = 2 if fault == "shard_exception" else 1
    options = StressOptions(
        seed=1, sequences=512, duration_s=300.0, shards=shards, fault=fault, fault_after_programs=2000, audits=5
    )
    report = await run_stress(options)
    assert report.leaked_blocks == 0 and report.leaked_sequences == 0
    assert report.ok, (report.failures, report.errors[:5])


# ------------------------------------------------------------------ audits
@pytest.mark.anyio
async def test_quiesce_returns_with_a_full_shard_beside_a_cached_one() -> None:
    """Regression: quiesce judged the pool as a whole, so a full shard (nothing to evict) beside a
    shard with cached blocks above its low watermark kept it waiting forever (audits timed out)."""
    cfg = _config(num_blocks=16, num_shards=2, low_watermark=0.25, high_watermark=0.5)
    async with KVCacheManager(cfg) as kv:
        await prefill(kv, "full", list(range(1, 33)))  # shard 0: every block active
        await prefill(kv, "cached", list(range(100, 117)))
        await kv.free("cached")  # shard 1: 4 cached blocks
        await prefill(kv, "held", list(range(200, 208)))  # shard 1: 2 free, its low watermark
        assert [(await kv.sequence(s)).shard for s in ("full", "held")] == [0, 1]
        stats = await kv.stats()
        assert (stats.free, stats.cached) == (2, 4)  # below the pool's low watermark (4) with cached blocks
        await quiesce(kv, timeout_s=30.0)  # the limit is only a hang guard
        assert (await kv.stats()).cached == 4  # quiet: nothing was evicted


def test_compare_refcounts_names_every_block_that_disagrees() -> None:
    result = AuditResult()
    compare_refcounts(result, [(0, 1), (0, 2)], {0: 2, 1: 1, 2: 1})
    assert result.refcount_mismatches == 0
    compare_refcounts(result, [(0, 1), (0, 2)], {0: 1, 1: 1, 3: 1})
    assert result.refcount_mismatches == 3  # 0 (1 vs 2), 2 (0 vs 1), 3 (1 vs 0)
    assert result.errors[0] == "block 0: refcount 1 but 2 block-table references"


@pytest.mark.anyio
async def test_audit_recounts_refcounts_and_checks_the_prefix_cache() -> None:
    async with KVCacheManager(_config(num_blocks=12)) as kv:
        record = PublishRecord(4)
        record.add(None, [1, 2, 3, 4, 5, 6, 7, 8, 9], 0, 2)
        await prefill(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # two full blocks published
        await fork(kv, "a", ["b"])
        await prefill(kv, "c", [1, 2, 3, 4, 50])  # hits the first block
        clean = await audit(kv, ["a", "b", "c", "gone"], record)
        assert (clean.violations, clean.live_sequences, clean.cached_prefixes) == (0, 3, 2), clean.errors
        missing = await audit(kv, ["a", "c"], record)  # "b" holds references the audit is not told of
        assert missing.unknown_sequences == 1 and missing.refcount_mismatches == 3, missing.errors  # 0, 1, 2
        short = PublishRecord(4)
        short.add(None, [1, 2, 3, 4], 0, 1)  # the second block was never committed, as far as it knows
        assert (await audit(kv, ["a", "b", "c"], short)).prefix_cache_mismatch == 1


def test_publish_record_allows_only_committed_prefixes_of_the_same_namespace() -> None:
    record = PublishRecord(2)
    record.add("x", [1, 2, 3, 4, 5], 0, 2)
    assert record.allows("x", [1, 2, 3, 4, 9], 4) and record.allows("x", [1, 2, 7], 2)
    assert not record.allows(None, [1, 2, 3], 2)  # another tenant
    assert not record.allows("x", [1, 2, 3, 5], 4)
    assert tenant_namespaces(5) == (None, ("lora", 1), 2, b"t3", "tenant-4")


@pytest.mark.anyio
@pytest.mark.parametrize("policy", sorted(EXPECTED_ORDER))
async def test_eviction_probe_holds_each_policy_to_its_definition(policy: str) -> None:
    assert await probe_eviction_order(policy) == []
    others = {order for name, order in EXPECTED_ORDER.items() if name != policy}
    assert EXPECTED_ORDER[policy] not in others  # the probe tells the three policies apart
    for order in others:
        assert await probe_eviction_order(policy, expected=order) != []


@pytest.mark.anyio
async def test_pending_copy_and_pending_hit_probes_pass() -> None:
    assert await probe_pinned_child() == []
    assert await probe_pending_hits() == []


@pytest.mark.anyio
async def test_kv_io_append_writes_the_clients_history_not_the_managers() -> None:
    """Regression (issue 18): append wrote K/V for the history the manager reported, so a manager
    holding other tokens than the client gave it still read back "right"."""
    async with KVCacheManager(_config(num_blocks=8)) as kv:
        await prefill(kv, "a", [1, 2, 3])
        await kv.append("a", [5])  # behind the client's back: the manager now holds 1 2 3 5
        await kv.commit("a", 1)
        result = await append(kv, "a", [6])
        assert kv_history(kv, "a") == [1, 2, 3, 6]
        expected = oracle_for(kv).values(history_hashes([1, 2, 3, 6]))[:, :, 3]  # (L, 2, H, D)
        key, _ = kv.storage.gather(0, torch.tensor([result.slot_mapping.item() // 4]), 4)
        assert torch.equal(key[result.slot_mapping.item() % 4], expected[0, 0])
        assert not await reads_back(kv, "a")  # the manager's tokens are not the client's


# ----------------------------------------------------------------- command
def test_register_adds_the_stress_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="akv")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["stress", "--seed", "7", "--sequences", "8", "--backend", "uvloop", "--no-progress"])
    assert args.command == "stress" and args.handler is main_stress
    options = options_from_args(args)
    assert (options.seed, options.sequences, options.backend, options.progress) == (7, 8, "uvloop", False)
    assert options.duration_s == 20.0 and options.block_size == 16 and options.inject_crash_after_s is None
    assert (options.operations, options.shards, options.eviction_policy, options.fault) == (None, 1, "slru", None)
    assert (options.host_blocks, options.host_gib, options.host_tier) == (0, None, False)
    tier = options_from_args(parser.parse_args(["stress", "--host-gib", "0.001"]))
    assert (tier.host_gib, tier.host_tier) == (0.001, True)


@pytest.mark.anyio
async def test_host_gib_sizes_the_tier_in_bytes() -> None:
    report = await run_stress(_count_run(seed=7, sequences=8, operations=24, host_gib=0.001))
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # tiny model: layers x K/V x tokens x heads x head_dim x float32
    assert report.host_tier["host_blocks"] == int(0.001 * 2**30) // block_bytes
    assert report.ok, (report.failures, report.errors)


@pytest.mark.parametrize(
    "argv",
    [
        ["--shards", "5"], ["--shards", "0"], ["--operations", "0"], ["--seed", "x"], ["--seed", str(2**70)],
        ["--duration-s", "-1"], ["--duration-s", "nan"], ["--duration-s", "inf"], ["--namespaces", "17"],
        ["--sequences", "0"], ["--num-blocks", "7"], ["--block-size", "0"], ["--fault", "meteor"],
        ["--eviction-policy", "fifo"], ["--fault-after-programs", "0"], ["--inject-crash-after-s", "-0.5"],
        ["--audits", "-1"], ["--log-level", "loud"], ["--seed", "-1"], ["--log-json-level", "loud"],
        ["--json", "."], ["--log-json", "."], ["--json", "/nonexistent-akv-dir/r.json"],
        ["--log-json", "/nonexistent-akv-dir/x.jsonl"], ["--host-blocks", "-1"], ["--host-gib", "0"],
        ["--host-gib", "nan"],
    ],
)  # fmt: skip
def test_out_of_range_options_exit_2(argv: list[str], capsys) -> None:
    parser = argparse.ArgumentParser(prog="akv")
    register(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["stress", *argv])
    assert exc.value.code == 2
    assert f"error: argument {argv[0]}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--fault", "shard_exception"], "shards >= 2"),
        (["--fault", "slow_copies", "--inject-crash-after-s", "1"], "inject_crash_after_s"),
        (["--fault-after-s", "3"], "--fault-after-s needs --fault"),
        (["--fault-after-programs", "5"], "--fault-after-programs needs --fault"),
        (["--operations", "20", "--fault", "crash", "--fault-after-programs", "50"], "must be below --operations 20"),
        (["--operations", "20", "--fault", "crash", "--fault-after-programs", "20"], "must be below --operations 20"),
        (["--num-blocks", "8"], "needs 21 blocks"),
        (["--shards", "3", "--num-blocks", "62"], "needs 21 blocks"),
        (["--block-size", "1", "--num-blocks", "200"], "needs 201 blocks"),
        (["--host-blocks", "64", "--host-gib", "0.5"], "not both"),
        (["--shards", "4", "--host-blocks", "3"], "cannot be split over 4 shards"),
    ],
)
def test_inconsistent_options_exit_2(argv: list[str], says: str, capsys) -> None:
    parser = argparse.ArgumentParser(prog="akv")
    register(parser.add_subparsers(dest="command", required=True))
    assert main_stress(parser.parse_args(["stress", "--no-progress", *argv])) == 2
    err = capsys.readouterr().err
    assert err.startswith("akv stress: error:") and says in err


@pytest.mark.parametrize(("block_size", "shards", "sequences"), [(1, 1, 1), (16, 4, 1), (16, 1, 256), (64, 3, 2)])
def test_default_pool_gives_every_shard_the_longest_sequence(block_size: int, shards: int, sequences: int) -> None:
    options = StressOptions(block_size=block_size, shards=shards, sequences=sequences)
    assert options.pool_blocks() // shards >= max_sequence_blocks(block_size)


def test_max_prompt_tokens_bounds_every_prompt() -> None:
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        source = PromptSource(0, block_size)
        longest = max(len(source.prompt(rng)) for _ in range(3000))
        assert longest <= max_prompt_tokens(block_size)
        assert longest > max_prompt_tokens(block_size) - block_size  # the bound is reached, nearly


@pytest.mark.anyio
async def test_smallest_accepted_pool_runs_without_request_too_large() -> None:
    report = await run_stress(_count_run(seed=6, sequences=16, operations=120, num_blocks=max_sequence_blocks(16)))
    assert report.ok, report.as_json()
    assert report.unexpected_errors == 0


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("option", ["--json", "--log-json"])
def test_output_that_cannot_be_written_exits_2_naming_the_option(option: str, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "akv.cli", "stress", "--operations", "12", "--sequences", "4", "--no-progress"]
    proc = subprocess.run([*cmd, option, "/dev/full"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (  # refused while parsing (akv.argtypes.output_path): a device
        f"akv stress: error: argument {option}: '/dev/full' is not a regular file (a device, pipe or socket); "
        "give a file path"
    )


def test_run_stress_script_writes_report_and_json_log(tmp_path: Path) -> None:
    report_path, log_path = tmp_path / "report.json", tmp_path / "log.jsonl"
    cmd = [
        sys.executable, str(ROOT / "stress" / "run_stress.py"), "--operations", "16", "--duration-s", "600",
        "--sequences", "8", "--json", str(report_path), "--log-json", str(log_path), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert set(report) >= REPORT_KEYS and report["ok"] is True and sum(report["programs"].values()) == 16
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    events = [line["event"] for line in lines]
    assert "stress.started" in events and "stress.finished" in events and "manager.started" in events
    # --log-json-level defaults to debug: the per-sequence events akv inspect --seq reads are there
    assert any(line["level"] == "debug" and line.get("seq_id") == "t0-s0" for line in lines)


# ------------------------------------------------- library bugs (strict xfail)
def _config(**overrides) -> KVCacheConfig:
    fields = {"num_blocks": 4, "block_size": 4, "vocab_size": 1000, "debug_invariants": True}
    fields.update(overrides)
    return KVCacheConfig(**fields)


def _gate_copies(kv: KVCacheManager) -> threading.Event:
    """Hold every block copy of the stream worker until the returned event is set."""
    gate = threading.Event()
    copy = kv.storage._copy_unchecked

    def held(src, dst) -> None:
        gate.wait(10)
        copy(src, dst)

    kv.storage._copy_unchecked = held
    return gate


@pytest.mark.anyio
async def test_cow_destination_is_not_reused_while_its_copy_is_pending() -> None:
    """Regression (found by the harness): a sequence freed (e.g. its task cancelled) before its
    CoW copy ran returned the copy's destination block to the free queue; the next allocation
    got it, and the late copy overwrote the new owner's K/V. The destination is now pinned
    (in flight) until the copy has run."""
    async with KVCacheManager(_config()) as kv:
        gate = _gate_copies(kv)
        await prefill(kv, "p", [1, 2, 3, 4, 5, 6])  # blocks (0, 1), 2 tokens in the tail
        await kv.fork("p", ["c"])
        result = await kv.append("c", [9])  # c gets block 2, a copy of block 1 (pending)
        assert (await kv.sequence("c")).block_ids == (0, 2) and not result.copies.done()
        await kv.free("c")  # c's task is cancelled before it waited for the copy
        assert (await kv.stats()).in_flight == 1  # block 2 waits for its copy
        await prefill(kv, "q", [50, 51, 52])
        assert 2 not in (await kv.sequence("q")).block_ids
        gate.set()
        await kv.wait_copies()
        assert await reads_back(kv, "q")
        assert (await kv.stats()).in_flight == 0


@pytest.mark.anyio
async def test_check_is_sound_while_the_eviction_loop_runs() -> None:
    """Regression (found by the harness): check() took the tree snapshot and checked the shard
    in two messages; an eviction batch in between made it report 'in the prefix cache but not
    marked published' and crash a healthy manager. The shard now takes the snapshot itself."""
    async with KVCacheManager(_config(low_watermark=0.75, high_watermark=1.0)) as kv:
        await kv.add_sequence("a", list(range(1, 10)))
        await kv.commit("a", 9)  # 2 full blocks published
        await kv.free("a")  # 2 of 4 blocks cached, free 0.5 < 0.75: the eviction loop wakes
        await kv.check()


@pytest.mark.anyio
async def test_wait_copies_waits_for_the_copies_of_cancelled_calls() -> None:
    """Regression (found by the harness): a cancelled call's copy ticket was never recorded, so
    wait_copies() (and check()) returned while that copy was still pending. The ticket is now
    recorded (``on_reply``) before the deferred cancellation is re-raised.

    Only a queued step can be cancelled after it was applied (an idle shard serves the step on
    the caller's task, after the call's only checkpoint), so the shard is made to queue."""
    async with KVCacheManager(_config(num_blocks=8)) as kv:
        gate = _gate_copies(kv)
        await prefill(kv, "s0", [1, 2, 3, 4, 5, 6])
        await kv.fork("s0", ["s1"])
        shard = kv._shards[0]  # reaching in on purpose: force the queued path
        shard.direct = False
        sent = shard.messages_handled
        with anyio.CancelScope() as scope:

            async def cancel_once_queued() -> None:
                while not shard.inbox_depth and shard.messages_handled == sent:
                    await anyio.lowlevel.checkpoint()
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_once_queued)
                await kv.step(appends={"s1": [9]})  # applied (shielded), copy submitted, then cancelled
        shard.direct = True
        assert scope.cancelled_caught
        assert (await kv.sequence("s1")).num_tokens == 7  # applied, copy-on-write of the shared tail
        await kv.free("s0")
        await kv.free("s1")
        done = anyio.Event()

        async def wait_then_mark() -> None:
            await kv.wait_copies()
            done.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_then_mark)
                for _ in range(50):
                    await anyio.lowlevel.checkpoint()
                assert not done.is_set()  # still waiting: the copy is held
                gate.set()
                with anyio.fail_after(60):  # a hang guard only
                    await done.wait()
        finally:
            gate.set()
        assert (await kv.stats()).in_flight == 0


@pytest.mark.anyio
async def test_step_cancelled_before_it_is_sent_applies_nothing() -> None:
    """A step to an idle shard is cancellable only at its checkpoint, before the message is sent."""
    async with KVCacheManager(_config(num_blocks=8)) as kv:
        await prefill(kv, "s0", [1, 2, 3, 4, 5, 6])
        await kv.fork("s0", ["s1"])
        before = await kv.stats()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await kv.step(appends={"s1": [9]})
        assert scope.cancelled_caught
        assert (await kv.sequence("s1")).num_tokens == 6
        after = await kv.stats()
        assert (after.free, after.active, after.cow_copies) == (before.free, before.active, before.cow_copies)
        await kv.wait_copies()
        await kv.check()


@pytest.mark.anyio
async def test_admit_step_rows_match_the_harness_slot_convention() -> None:
    """The harness writes a prefill through step(admits=...).slot_mapping: one slot per non-cached token."""
    async with KVCacheManager(_config(num_blocks=8)) as kv:
        await prefill(kv, "a", [1, 2, 3, 4, 5])
        result = await kv.step(admits=[Admit(seq_id="b", prompt=[1, 2, 3, 4, 5, 6])])
        assert result.cached_tokens["b"] == 4
        assert result.slot_mapping.tolist() == [b * 4 + o for b, o in ((2, 0), (2, 1))]
