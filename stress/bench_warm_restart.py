"""Benchmark: a warm restart from a snapshot against a cold one and against never having stopped.

On the Mooncake conversation trace shipped in akv (its first ``--requests``,
default 2,000), metadata mode (``--storage none``), a pool of ``--num-blocks``
(default 100,000), four ``akv replay`` processes:

- ``full``: requests 1 to N in one uninterrupted replay (``--requests-out``);
- ``first``: requests 1 to N/2, then ``--save-snapshot``;
- ``cold``: requests N/2+1 to N (``--start``) in a fresh process;
- ``warm``: the same with ``--warm-start`` from the snapshot.

Reported: the hit rate (cached / prompt tokens) of requests N/2+1 to N in
each (``full`` from its per-request lines), the warm gap to ``full`` in
points (target: within 1), and the time from process start (just before the
``subprocess`` spawn) to the first admission served a prefix hit, cold vs
warm, with that request's index (0-based, in the trace). Prints a table and
writes JSON.

    OMP_NUM_THREADS=1 python stress/bench_warm_restart.py     # JSON to stress/results/bench_warm_restart.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def replay(argv: list[str], requests_out: Path | None) -> tuple[float, float]:
    """Run one ``akv replay``; return ``(spawn time.time(), wall seconds)``."""
    cmd = [sys.executable, "-m", "akv.cli", "replay", "--no-progress", *argv]
    if requests_out is not None:
        cmd += ["--requests-out", str(requests_out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return started, time.time() - started


def hit_rate(rows: list[dict], first_index: int) -> float:
    """Cached over prompt tokens of the rows with trace index >= ``first_index``."""
    rows = [r for r in rows if r["index"] >= first_index]
    return sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)


def first_hit(rows: list[dict], started: float) -> dict | None:
    """Seconds from the spawn to the first admission served a prefix hit, and that request's index."""
    hits = [(r["admitted_unix_s"], r["index"]) for r in rows if r["cached_tokens"] > 0]
    if not hits:
        return None
    admitted, index = min(hits)
    return {"seconds": admitted - started, "index": index}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests of the trace (even; default 2000)")
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=REPO / "stress" / "results" / "bench_warm_restart.json")
    args = parser.parse_args()
    half = args.requests // 2
    pool = ["--storage", "none", "--num-blocks", str(args.num_blocks)]
    with tempfile.TemporaryDirectory(prefix="akv-warm-") as tmp:
        tmp = Path(tmp)
        read = lambda name: [json.loads(line) for line in (tmp / name).read_text().splitlines()]  # noqa: E731
        _, full_s = replay([*pool, "--limit", str(args.requests)], tmp / "full.jsonl")
        _, first_s = replay([*pool, "--limit", str(half), "--save-snapshot", str(tmp / "snap")], None)
        second = [*pool, "--start", str(half), "--limit", str(args.requests - half)]
        cold_start, cold_s = replay([*second, "--json", str(tmp / "cold.json")], tmp / "cold.jsonl")
        warm_start, warm_s = replay(
            [*second, "--warm-start", str(tmp / "snap"), "--json", str(tmp / "warm.json")], tmp / "warm.jsonl"
        )
        warm_report = json.loads((tmp / "warm.json").read_text())
        result = {
            "trace": "mooncake conversation (akv/data head)",
            "requests": args.requests,
            "num_blocks": args.num_blocks,
            "second_half_hit_rate": {
                "uninterrupted": hit_rate(read("full.jsonl"), half),
                "cold": hit_rate(read("cold.jsonl"), half),
                "warm": hit_rate(read("warm.jsonl"), half),
            },
            "first_hit": {
                "cold": first_hit(read("cold.jsonl"), cold_start),
                "warm": first_hit(read("warm.jsonl"), warm_start),
            },
            "warm_start_blocks": warm_report["warm_start_blocks"],
            "warm_start_s": warm_report["warm_start_s"],
            "wall_s": {"full": full_s, "first": first_s, "cold": cold_s, "warm": warm_s},
            "load_average": os.getloadavg(),
        }
    rates = result["second_half_hit_rate"]
    result["warm_gap_points"] = 100 * (rates["uninterrupted"] - rates["warm"])
    print(f"requests {half + 1}-{args.requests} of the conversation trace, {args.num_blocks:,} blocks, metadata mode")
    for name, rate in rates.items():
        print(f"  hit rate {name:>13}: {rate:.2%}")
    print(f"  warm gap to uninterrupted: {result['warm_gap_points']:+.2f} points (target within 1)")
    for name, hit in result["first_hit"].items():
        if hit is None:
            print(f"  first served hit, {name}: none")
        else:
            print(f"  first served hit, {name}: {hit['seconds']:.2f} s after process start, request {hit['index']}")
    print(f"  warm start: {result['warm_start_blocks']:,} blocks in {result['warm_start_s']:.3f} s")
    print(f"  load average {result['load_average']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
