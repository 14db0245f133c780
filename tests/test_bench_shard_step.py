"""Smoke test of stress/bench_shard_step.py (tiny sizes): one child run and the paired summary of two trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stress_scripts import load

bench = load("bench_shard_step")
ROOT = Path(__file__).resolve().parent.parent


def test_one_run_times_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "one.json"
    argv = ["--shards", "1", "2", "--batches", "8", "--steps", "4", "--warmup", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert list(doc["configs"]) == ["shards=1 B=8 direct", "shards=2 B=8 direct", "shards=2 B=8 queued"]
    assert all(0 < c["p50_us"] <= c["p99_us"] for c in doc["configs"].values())


@pytest.mark.slow
def test_paired_runs_alternate_trees_and_report_ratios(tmp_path: Path) -> None:
    out = tmp_path / "paired.json"
    argv = ["--trees", f"a={ROOT}", f"b={ROOT}", "--rounds", "2", "--shards", "2", "--batches", "8"]
    argv += ["--paths", "direct", "--steps", "4", "--warmup", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert [len(doc["runs"][name]) for name in ("a", "b")] == [2, 2]
    row = doc["summary"]["shards=2 B=8 direct"]
    assert row["b/a p50"] == row["b"]["p50_us"] / row["a"]["p50_us"] > 0
