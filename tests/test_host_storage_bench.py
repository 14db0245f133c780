"""Smoke test of stress/bench_tier_copy.py at tiny sizes (a subprocess: the script sets its thread counts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_tier_copy_runs_and_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "tier.json"
    args = ["--layers", "1", "--num-blocks", "8", "--host-blocks", "6", "--batches", "1", "4", "9"]
    args += ["--reps", "1", "--warmup", "0", "--device", "cpu", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "stress" / "bench_tier_copy.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    assert "OMP_NUM_THREADS=1, torch threads 1" in done.stdout
    report = json.loads(out.read_text())
    assert report["omp_num_threads"] == "1" and report["torch_threads"] == 1
    rows = report["rows"]
    keys = {(r["direction"], r["pattern"], r["blocks_per_call"]) for r in rows}
    assert keys == {(d, p, m) for d in ("d2h", "h2d") for p in ("contiguous", "host-runs", "scattered") for m in (1, 4)}
    methods = {r["method"] for r in rows}
    assert methods == {"torch copy", "akv", "akv x4", "akv (thread)", "akv (thread) x4", "akv copier", "index_copy"}
    for r in rows:
        assert r["bytes_per_call"] == r["blocks_per_call"] * 1 * 2 * 16 * 8 * 128 * 2
        assert r["gib_per_s"] > 0 and r["ratio"] > 0
    assert "| device | direction | pattern | m | torch copy | akv |" in done.stdout
