"""``akv inspect``: a replay's JSON-lines log, summarized, per sequence, and plotted; a truncated last line is fine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from akv.cli import main
from tests.test_metrics import write_tight_trace
from tests.test_replay import restore_logging

__all__ = ["restore_logging"]  # the fixture, imported for its use here


def test_inspect_summarizes_a_replay_log(tmp_path: Path, restore_logging, capsys) -> None:
    trace, log, report, png = tmp_path / "t.jsonl", tmp_path / "log.jsonl", tmp_path / "r.json", tmp_path / "p.png"
    write_tight_trace(trace)
    argv = ["replay", str(trace), "--num-blocks", "200", "--storage", "none", "--no-progress"]
    assert main([*argv, "--log-json", str(log), "--log-level", "debug", "--json", str(report)]) == 0
    with open(log, "a") as f:
        f.write('{"event": "eviction.batch", "blo')  # what a crashed run leaves
    capsys.readouterr()

    assert main(["inspect", str(log), "--json", "--plot", str(png)]) == 0
    summary = json.loads(capsys.readouterr().out)
    data = json.loads(report.read_text())
    lines = log.read_text().splitlines()
    assert summary["bad_lines"] == [len(lines)]
    assert sum(summary["events"].values()) == len(lines) - 1
    assert summary["events"]["sequence.added"] == data["requests_finished"] + data["readmissions"]
    assert summary["events"]["replay.finished"] == 1
    assert summary["errors"] == []
    (run,) = summary["runs"]
    assert run["preemptions"] == data["preemptions"] > 0
    bursts = summary["eviction_bursts"]
    assert sum(b["batches"] for b in bursts) == summary["events"].get("eviction.batch", 0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    preempted = next(json.loads(x) for x in lines[:-1] if '"sequence.freed"' in x and '"preempted": true' in x)
    assert main(["inspect", str(log), "--seq", preempted["seq_id"]]) == 0
    history = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    names = [e["event"] for e in history]
    resumed = [e["resumed"] for e in history if e["event"] == "sequence.added"]
    freed = [e["preempted"] for e in history if e["event"] == "sequence.freed"]
    assert resumed[0] is False and all(resumed[1:]) and len(resumed) >= 2  # admitted, preempted, re-admitted
    assert freed == [True] * (len(resumed) - 1) + [False]  # every preemption re-admitted, then finished
    assert names[0] == "sequence.added"
    assert all(e.get("seq_id") == preempted["seq_id"] or preempted["seq_id"] in e.get("seq_ids", []) for e in history)

    assert main(["inspect", str(log)]) == 0
    assert "eviction bursts" in capsys.readouterr().out
    assert main(["inspect", str(log), "--seq", "no-such-sequence"]) == 2


def test_replay_plot_writes_a_png_of_the_timeline(tmp_path: Path, restore_logging) -> None:
    trace, png = tmp_path / "t.jsonl", tmp_path / "replay.png"
    write_tight_trace(trace, n=20)
    assert (
        main(["replay", str(trace), "--num-blocks", "200", "--storage", "none", "--no-progress", "--plot", str(png)])
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_timeline_samples_stats() -> None:
    import anyio

    from akv import KVCacheConfig, KVCacheManager
    from akv.replay import ReplayOptions, replay
    from tests.test_replay import BLOCK, TRACE_BLOCK, synthetic_requests

    async def run():
        async with KVCacheManager(KVCacheConfig(num_blocks=48, block_size=BLOCK)) as kv:
            options = ReplayOptions(max_batch=16, trace_block_tokens=TRACE_BLOCK, timeline_every_steps=5)
            return await replay(kv, synthetic_requests(30), options)

    report = anyio.run(run)
    steps = report.decode_steps
    assert len(report.timeline) == 1 + steps // 5 + (steps % 5 != 0)  # the first step, every 5th, the last
    assert report.timeline[-1]["simulated_s"] == pytest.approx(report.simulated_s - 0.02)  # the last step (20 ms)
    assert all(sum(x[s] for s in ("free", "active", "cached", "in_flight")) == 48 for x in report.timeline)
    times = [x["simulated_s"] for x in report.timeline]
    assert times == sorted(times)
    assert "timeline" not in report.as_json()
