"""What reservations cost a decode step: actor-free ``ShardState.step``, paired, without and with them.

Two shards with the same ``B`` sequences (staggered prompts of about 100
tokens, block_size 16), one admitted plainly and one with
``max_new_tokens`` covering the whole run; each step commits the previous
token and appends one ``int`` token to every sequence (the vectorized
decode path), alternating which shard goes first. Prints and writes the
per-step medians (µs) as JSON.

    OMP_NUM_THREADS=1 python3 stress/bench_reservation.py --batches 64 256 1024 --steps 300 --out /tmp/res.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepRequest

BLOCK_SIZE = 16


def make_shard(batch: int, max_new_tokens: int | None) -> ShardState:
    """A shard holding ``batch`` prefilled, committed sequences (ids ``0..batch-1``)."""
    state = ShardState(0, range(batch * 64), BLOCK_SIZE)
    admits = [
        Admit(
            seq_id=i,
            prompt=np.arange(1, 100 + i % BLOCK_SIZE, dtype=np.int32) + i * 1000 % 90000,
            max_new_tokens=max_new_tokens,
        )
        for i in range(batch)
    ]
    state.step(StepRequest(admits=admits))
    state.step(StepRequest(commits={i: 99 + i % BLOCK_SIZE for i in range(batch)}))
    return state


def bench(batch: int, steps: int) -> dict:
    """Median µs per decode step of both shards, paired step by step."""
    shards = {"plain": make_shard(batch, None), "reserved": make_shard(batch, steps + 10)}
    times: dict[str, list[float]] = {name: [] for name in shards}
    for s in range(steps):
        order = ("plain", "reserved") if s % 2 else ("reserved", "plain")
        for name in order:
            state = shards[name]
            req = StepRequest(commits={i: 1 for i in range(batch)} if s else {}, appends={i: 5 for i in range(batch)})
            t0 = time.perf_counter()
            state.step(req)
            times[name].append(time.perf_counter() - t0)
    for state in shards.values():
        state.check()
    return {
        "batch": batch,
        "steps": steps,
        **{f"{name}_p50_us": round(statistics.median(t) * 1e6, 1) for name, t in times.items()},
    }


def main() -> None:
    """Run the batch sizes given on the command line; print and write JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="stress/results/bench_reservation.json")
    args = p.parse_args()
    rows = [bench(b, args.steps) for b in args.batches]
    result = {"loadavg": os.getloadavg(), "rows": rows}
    for row in rows:
        print(json.dumps(row))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
