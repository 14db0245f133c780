"""The stress harness (issue 3): a short run in the default suite, fault injection, the command,
and regression tests for the library bugs the harness found.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from akv.config import KVCacheConfig
from akv.core.step import Admit
from akv.manager import KVCacheManager
from akv.stress import StressOptions, main_stress, register, run_stress
from akv.stress.cli import options_from_args
from akv.stress.kv_io import prefill, reads_back
from akv.stress.oracle import KVOracle, history_hashes
from akv.stress.workload import PromptSource, system_prompt_lengths

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
@pytest.mark.anyio
async def test_short_stress_run_is_clean() -> None:
    report = await run_stress(StressOptions(seed=1, sequences=128, duration_s=12.0))
    assert report.corrupted_reads == 0, report.samples
    assert report.invariant_violations == 0, report.errors
    assert report.leaked_blocks == 0 and report.leaked_sequences == 0
    assert report.unexpected_errors == 0 and report.hung_calls == 0, report.samples
    assert report.nonempty_inboxes == {}
    assert report.forks > 0 and report.cow_copies > 0
    assert report.evictions > 0 and report.eviction_batches > 0
    assert report.cancellations > 0 and report.aborts > 0
    assert report.verifications > 0 and report.verified_tokens > 0
    assert report.backend == "asyncio"
    assert report.ok, report.failures
    assert set(report.as_json()) >= REPORT_KEYS


@pytest.mark.anyio
@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"), pytest.param("trio", id="trio")]
)
async def test_short_stress_run_on_other_event_loops(anyio_backend) -> None:
    pytest.importorskip("uvloop" if anyio_backend != "trio" else "trio")
    report = await run_stress(StressOptions(seed=2, sequences=32, duration_s=3.0))
    assert report.backend == ("trio" if anyio_backend == "trio" else "uvloop")
    assert report.forks > 0 and report.operations > 0
    assert report.ok, (report.failures, report.errors, report.samples)


@pytest.mark.anyio
async def test_fault_injection_fails_every_caller_fast_and_a_fresh_manager_works() -> None:
    report = await run_stress(
        StressOptions(seed=3, sequences=48, duration_s=6.0, inject_crash_after_s=1.5, hang_timeout_s=5.0)
    )
    fi = report.fault_injection
    assert fi is not None and fi.injected and fi.actor == "pool_shard_0"
    assert fi.tasks == 48 and fi.tasks_failed_fast == 48 and fi.tasks_hung == 0
    assert fi.max_error_latency_s is not None and fi.max_error_latency_s < 5.0
    assert fi.aexit_raised and fi.fresh_manager_ok
    assert report.corrupted_reads == 0 and report.invariant_violations == 0
    assert report.ok, report.failures
    assert report.duration_s < 6.0  # every task stopped at the fault, not at the deadline


# ----------------------------------------------------------------- command
def test_register_adds_the_stress_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="akv")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["stress", "--seed", "7", "--sequences", "8", "--backend", "uvloop", "--no-progress"])
    assert args.command == "stress" and args.handler is main_stress
    options = options_from_args(args)
    assert (options.seed, options.sequences, options.backend, options.progress) == (7, 8, "uvloop", False)
    assert options.duration_s == 20.0 and options.block_size == 16 and options.inject_crash_after_s is None


def test_run_stress_script_writes_report_and_json_log(tmp_path: Path) -> None:
    report_path, log_path = tmp_path / "report.json", tmp_path / "log.jsonl"
    cmd = [
        sys.executable, str(ROOT / "stress" / "run_stress.py"), "--duration-s", "2", "--sequences", "16",
        "--json", str(report_path), "--log-json", str(log_path), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert set(report) >= REPORT_KEYS and report["ok"] is True
    events = [json.loads(line)["event"] for line in log_path.read_text().splitlines()]
    assert "stress.started" in events and "stress.finished" in events and "manager.started" in events


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
        try:
            with anyio.move_on_after(0.5) as waited:
                await kv.wait_copies()
            assert waited.cancelled_caught  # still waiting: the copy is held
        finally:
            gate.set()
        with anyio.fail_after(5):
            await kv.wait_copies()
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
