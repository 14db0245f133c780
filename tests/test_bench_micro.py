"""Smoke tests of stress/bench_micro.py (tiny sizes) and of bench_peers.py's timing proxy."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import anyio
import numpy as np
import pytest
from stress_scripts import load

bench_micro = load("bench_micro")
bench_peers = load("bench_peers")


def test_actor_free_path_matches_manager_path() -> None:
    """Both paths give identical block tables and slot mappings at every step, blocks boundaries included."""
    plan = bench_micro.make_plan(5, 12, warmup=2, prompt_len=6, block_size=4, vocab=1000)
    mgr = bench_micro.manager_run(plan, record=True)
    free = bench_micro.actor_free_run(plan, record=True)
    assert len(mgr.step_ns) == len(free.step_ns) == 12
    assert all(ns > 0 for ns in mgr.step_ns + free.step_ns)
    assert len(mgr.tables) == len(free.tables) == 1 + 2 + 12  # admission, warm-up, timed
    # The decode steps really grow the tables: 5 sequences of 6..9 tokens + 14 tokens cross several blocks.
    first, last = mgr.tables[1][0], mgr.tables[-1][0]
    assert last.shape[0] == 5 and last.shape[1] > first.shape[1]
    assert mgr.tables[-1][1].shape == (5,)
    assert bench_micro.same_metadata(mgr, free)
    # ... and the comparison does notice a difference.
    tables, slots = free.tables[-1]
    bad = slots.copy()
    bad[0] += 1
    free.tables[-1] = (tables, bad)
    assert not bench_micro.same_metadata(mgr, free)


def test_paired_run_steps_both_paths_in_lockstep() -> None:
    plan = bench_micro.make_plan(4, 9, warmup=1, prompt_len=5, block_size=4, vocab=1000)
    mgr, free = bench_micro.paired_run(plan, record=True)
    assert len(mgr.step_ns) == len(free.step_ns) == 9
    assert all(ns > 0 for ns in mgr.step_ns + free.step_ns)
    assert bench_micro.same_metadata(mgr, free)
    assert bench_micro.same_metadata(mgr, bench_micro.actor_free_run(plan, record=True))


class ScriptedClock:
    """A ``perf_counter_ns`` stand-in: returns ``now``, which the test advances by known amounts."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


class PairedClock:
    """A ``perf_counter_ns`` stand-in for code that reads it before and after each timed call.

    The k-th pair of reads spans ``durations[k]`` ns; ``reads`` counts the reads.
    """

    def __init__(self, durations: list[int]) -> None:
        self._durations = iter(durations)
        self.now = 0
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        if not self.reads % 2:
            self.now += next(self._durations)
        return self.now


def test_percentile_is_linear_interpolation() -> None:
    assert bench_micro.pct([40, 10, 30, 20], 0.5) == 25  # sorted 10 20 30 40: halfway between 20 and 30
    assert bench_micro.pct(list(range(101)), 0.99) == 99
    assert bench_micro.pct(list(range(1, 11)), 0.99) == pytest.approx(9.91)
    assert bench_micro.pct([7], 0.99) == 7
    assert bench_micro.pct([1, 2], 0.0) == 1 and bench_micro.pct([1, 2], 1.0) == 2
    assert np.isnan(bench_micro.pct([], 0.5))


def test_ask_round_trip_reduces_the_timed_asks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each ask reads the clock twice (before, after). The scripted durations are
    # 1 s for the 5 warm-up asks and k µs for timed ask k = 1..50, so the row
    # is known exactly, and including a warm-up ask would show in p99 and mean.
    clock = PairedClock([10**9] * 5 + [k * 1_000 for k in range(1, 51)])
    monkeypatch.setattr(time, "perf_counter_ns", clock)
    row = bench_micro.ask_round_trip("asyncio", n=50, warmup=5)
    assert clock.reads == 2 * 55
    assert row == {
        "backend": "asyncio",
        "path": "direct",
        "asks": 50,
        "p50_us": 25.5,
        "p99_us": pytest.approx(49.51),
        "mean_us": 25.5,
    }


def test_bench_batch_reduces_known_step_times(monkeypatch: pytest.MonkeyPatch) -> None:
    # Known per-step times (ns) for the two paths of each paired run; the row's
    # summaries and actor shares are then exact: manager 100..400 per step, the
    # actor-free path a quarter (first run) or half (second run) of it.
    runs = iter(
        [
            (bench_micro.PathRun([100, 200, 300, 400], asks_per_step=1.0), bench_micro.PathRun([25, 50, 75, 100])),
            (bench_micro.PathRun([400, 300, 200, 100], asks_per_step=1.0), bench_micro.PathRun([200, 150, 100, 50])),
        ]
    )
    monkeypatch.setattr(bench_micro, "paired_run", lambda plan, record, backend: next(runs))
    row = bench_micro.bench_batch(2, 4, repeats=2, ask_p50_us=0.05)
    mgr = [100, 200, 300, 400, 400, 300, 200, 100]
    free = [25, 50, 75, 100, 200, 150, 100, 50]
    assert row["manager"] == {
        "p50_us": 0.25,
        "p99_us": pytest.approx(0.4),
        "us_per_seq_tok": pytest.approx(sum(mgr) / 8 / 2 / 1e3),
        "p50_us_per_seq_tok": 0.125,
    }
    assert row["actor_free"]["p50_us"] == pytest.approx(bench_micro.pct(free, 0.5) / 1e3)
    assert row["actor_share_p50"] == pytest.approx(1 - 87.5 / 250)
    assert row["actor_share_mean"] == pytest.approx(1 - sum(free) / sum(mgr))
    assert row["actor_share_paired"] == pytest.approx(0.625)  # median of four 0.75 and four 0.5
    assert row["ask_fraction_of_step"] == pytest.approx(0.05 / 0.25)
    assert (row["batch"], row["steps"], row["repeats"], row["asks_per_step"]) == (2, 4, 2, 1.0)
    assert row["same_metadata"] is False  # nothing recorded: nothing to compare


def test_main_writes_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_micro, "configure_logging", lambda **_: None)  # leave the process's logging alone
    out = tmp_path / "micro.json"
    rc = bench_micro.main(
        [
            "--batches",
            "1",
            "3",
            "--steps",
            "8",
            "--asks",
            "30",
            "--repeats",
            "1",
            "--backends",
            "asyncio",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {"command", "versions", "ask_round_trip", "decode_steps", "step_backend"} <= set(doc)
    assert [a["backend"] for a in doc["ask_round_trip"]] == ["asyncio"]
    assert [r["batch"] for r in doc["decode_steps"]] == [1, 3]
    (ask,) = doc["ask_round_trip"]
    assert (ask["asks"], ask["path"]) == (30, "direct")
    for row in doc["decode_steps"]:
        assert row["same_metadata"] is True
        assert (row["steps"], row["repeats"]) == (8, 1)
        mgr, free = row["manager"], row["actor_free"]
        for summary in (mgr, free):
            assert summary["p50_us_per_seq_tok"] == pytest.approx(summary["p50_us"] / row["batch"])
        # The derived fields are computed from the summaries written beside them.
        assert row["actor_share_p50"] == pytest.approx(1 - free["p50_us"] / mgr["p50_us"])
        assert row["actor_share_mean"] == pytest.approx(1 - free["us_per_seq_tok"] / mgr["us_per_seq_tok"])
        assert row["ask_fraction_of_step"] == pytest.approx(ask["p50_us"] * row["asks_per_step"] / mgr["p50_us"])
        # One shard ask per decode step (diagnostic through private attributes, present today).
        assert row["asks_per_step"] == 1.0
    assert "| asyncio |" in bench_micro.table(doc)


class _SyncAdapter:
    """A peer adapter whose calls take known times on a :class:`ScriptedClock`."""

    name = "sync"

    def __init__(self, clock: ScriptedClock) -> None:
        self.clock = clock

    def step_begin(self):
        self.clock.now += 1

    def admit(self, seqs):
        self.clock.now += 100
        return [0] * len(seqs)

    def decode(self, seqs, tokens):
        self.clock.now += 20 * len(seqs)

    def finish(self, seqs):
        self.clock.now += 1_000


class _AsyncAdapter(_SyncAdapter):
    name = "async"

    async def admit(self, seqs):
        await anyio.sleep(0)
        self.clock.now += 100
        return [1] * len(seqs)

    async def decode(self, seqs, tokens):
        await anyio.sleep(0)
        self.clock.now += 20 * len(seqs)


@pytest.mark.parametrize("cls", [_SyncAdapter, _AsyncAdapter])
def test_step_timer_keeps_kinds_and_sums_steps(cls, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ScriptedClock()
    monkeypatch.setattr(time, "perf_counter_ns", clock)  # StepTimer takes it when it wraps
    inner = cls(clock)
    proxy = bench_peers.StepTimer(inner)
    for m in ("step_begin", "admit", "decode", "finish"):
        assert inspect.iscoroutinefunction(getattr(proxy, m)) == inspect.iscoroutinefunction(getattr(inner, m))
    assert proxy.name == cls.name  # forwarded

    async def drive() -> list:
        hits = []
        for step in range(3):
            proxy.step_begin()
            if step:
                r = proxy.decode([1, 2], [5, 6])
                if inspect.isawaitable(r):
                    await r
            r = proxy.admit([1])
            hits.append(await r if inspect.isawaitable(r) else r)
            clock.now += 1_000_000  # between calls: not timed
            proxy.finish([1])
        return hits

    hits = anyio.run(drive)
    proxy.flush()
    assert hits == [[1 if cls is _AsyncAdapter else 0]] * 3
    # Each step sums its calls: step_begin 1 + admit 100 + finish 1,000, plus decode 20 per sequence after the first.
    assert proxy.steps_ns == [1_101, 1_141, 1_141]
    assert proxy.decode_ns == [(2, 40), (2, 40)]
    assert bench_peers.rotation(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert bench_peers.rotation(["a", "b", "c"], 5) == ["c", "a", "b"]
