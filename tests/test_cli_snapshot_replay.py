"""akv replay --save-snapshot / --warm-start / --requests-out / --start, through real processes and files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: A trace whose requests 2 and 3 repeat the prompts of requests 0 and 1 (8 trace blocks of 512 tokens).
LINES = [
    {"timestamp": 10 * i, "input_length": 1030, "output_length": 4, "hash_ids": [i % 2 * 10, i % 2 * 10 + 1, 99 + i]}
    for i in range(4)
]
FAST = ["--storage", "none", "--no-progress", "--num-blocks", "4096", "--block-size", "16"]


def akv(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "akv.cli", "replay", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)  # hang guard


def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


def requests(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_warm_start_serves_the_saved_prefixes_from_the_first_request(tmp_path: Path) -> None:
    path = trace(tmp_path)
    first = akv(str(path), *FAST, "--limit", "2", "--save-snapshot", str(tmp_path / "snap"))
    assert first.returncode == 0, first.stderr
    cold = akv(str(path), *FAST, "--start", "2", "--requests-out", str(tmp_path / "cold.jsonl"))
    warm = akv(
        str(path),
        *FAST,
        "--start",
        "2",
        "--warm-start",
        str(tmp_path / "snap"),
        "--requests-out",
        str(tmp_path / "warm.jsonl"),
        "--json",
        str(tmp_path / "warm.json"),
    )
    assert cold.returncode == 0 and warm.returncode == 0, cold.stderr + warm.stderr
    cold_rows, warm_rows = requests(tmp_path / "cold.jsonl"), requests(tmp_path / "warm.jsonl")
    assert [r["index"] for r in warm_rows] == [2, 3] == [r["index"] for r in cold_rows]
    assert [r["cached_tokens"] for r in cold_rows] == [0, 0]
    assert [r["cached_tokens"] for r in warm_rows] == [1024, 1024]  # two shared trace blocks of 512 tokens
    assert all(r["prompt_tokens"] == 1030 for r in warm_rows)
    report = json.loads((tmp_path / "warm.json").read_text())
    assert report["warm_start_blocks"] > 0 and report["warm_start_s"] > 0


def test_a_refused_warm_start_is_exit_2_with_the_cause(tmp_path: Path) -> None:
    path = trace(tmp_path)
    done = akv(str(path), *FAST, "--warm-start", str(tmp_path / "missing"))
    assert done.returncode == 2
    assert "snapshot missing:" in done.stderr and "Traceback" not in done.stderr
    assert akv(str(path), *FAST, "--limit", "1", "--save-snapshot", str(tmp_path / "snap")).returncode == 0
    other = akv(str(path), *FAST, "--block-size", "32", "--warm-start", str(tmp_path / "snap"))
    assert other.returncode == 2 and "snapshot foreign:" in other.stderr and "block_size" in other.stderr
    (tmp_path / "file").write_text("x")
    cannot = akv(str(path), *FAST, "--limit", "1", "--save-snapshot", str(tmp_path / "file"))
    assert cannot.returncode == 2 and "snapshot io:" in cannot.stderr
