"""Smoke tests of stress/bench_micro.py (tiny sizes) and of bench_peers.py's timing proxy."""

from __future__ import annotations

import inspect
import json
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


def test_ask_round_trip_positive() -> None:
    row = bench_micro.ask_round_trip("asyncio", n=50, warmup=5)
    assert row["backend"] == "asyncio" and row["asks"] == 50
    assert 0 < row["p50_us"] <= row["p99_us"]


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
    for row in doc["decode_steps"]:
        assert row["same_metadata"] is True
        assert row["steps"] == 8
        for path in ("manager", "actor_free"):
            assert 0 < row[path]["p50_us"] <= row[path]["p99_us"]
            assert row[path]["us_per_seq_tok"] > 0
        assert row["actor_share_p50"] < 1 and row["actor_share_paired"] < 1
        assert row["ask_fraction_of_step"] > 0
        if "manager_in_handler_p50_us" in row:  # diagnostic through private attributes, present today
            assert row["manager_in_handler_p50_us"] > 0 and row["asks_per_step"] >= 1
    assert "| asyncio |" in bench_micro.table(doc)


class _SyncAdapter:
    name = "sync"

    def step_begin(self):
        pass

    def admit(self, seqs):
        return [0] * len(seqs)

    def decode(self, seqs, tokens):
        pass

    def finish(self, seqs):
        pass


class _AsyncAdapter(_SyncAdapter):
    name = "async"

    async def admit(self, seqs):
        await anyio.sleep(0)
        return [1] * len(seqs)

    async def decode(self, seqs, tokens):
        await anyio.sleep(0)


@pytest.mark.parametrize("cls", [_SyncAdapter, _AsyncAdapter])
def test_step_timer_keeps_kinds_and_sums_steps(cls) -> None:
    inner = cls()
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
            proxy.finish([1])
        return hits

    hits = anyio.run(drive)
    proxy.flush()
    assert hits == [[1 if cls is _AsyncAdapter else 0]] * 3
    assert len(proxy.steps_ns) == 3 and all(ns > 0 for ns in proxy.steps_ns)
    assert [b for b, _ in proxy.decode_ns] == [2, 2]
    assert bench_peers.rotation(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert np.all(np.asarray(proxy.steps_ns) >= 0)
