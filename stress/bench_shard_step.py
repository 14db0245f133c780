"""Paired micro-benchmark of a decode step through the manager, by shard count and path, old tree vs new.

One configuration is ``(num_shards, batch, path)``: a metadata-only manager
(``storage="none"``, block_size 16, eviction loop off) holding ``batch``
running sequences with distinct random prompts of 64-79 tokens (staggered, so
about ``batch / 16`` sequences start a block in every step), each step
committing every sequence's previous token and appending one ``int`` token,
with metadata (block tables, slot mapping). ``path``: ``direct`` (every shard
serves on the caller's task, the usual case) or ``queued`` (``Actor.direct =
False``: every message through the shards' inboxes and tasks). With one
shard this is the decode step of ``stress/bench_micro.py`` (b), which shows
what publishing a snapshot after every message costs; with 2 and 4 shards it
is the cost of a step split over every shard (one ``Step`` per shard sharing
a vote since mgr2; ``Validate`` then ``Step`` per shard at 0a4c218).

Step times are the thread's CPU time (``time.thread_time_ns``: what the step
costs, robust to other processes on a loaded machine; ``--wall`` for the wall
clock), p50 and p99 over ``--steps`` timed steps.

Paired: ``--trees NAME=PATH ...`` runs this file as a child process per tree
(``PYTHONPATH=PATH``), alternating the trees' order every round, so load on
a shared machine hits both alike; per configuration it reports each tree's
median over rounds of the per-run p50 and p99 step times, and the ratio of the
p50s to the first tree's. Every child runs with ``OMP_NUM_THREADS=1``.

    python3 stress/bench_shard_step.py --trees old=/tmp/base-0a4 new=. --rounds 3
    python3 stress/bench_shard_step.py                      # this tree only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "stress" / "results" / "bench_shard_step.json"
BLOCK_SIZE = 16
PROMPT_TOKENS = 64


def pct(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0-1) of ``values``."""
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def _decode_run(
    num_shards: int, batch: int, steps: int, warmup: int, direct: bool, clock: Any = time.thread_time_ns
) -> list[float]:
    """Step times (us, by ``clock`` in ns) of ``steps`` timed decode steps after ``warmup`` untimed ones."""
    from akv import Admit, KVCacheConfig, KVCacheManager

    per_seq = -(-(PROMPT_TOKENS + BLOCK_SIZE + steps + warmup) // BLOCK_SIZE) + 1
    num_blocks = -(-2 * batch * per_seq // num_shards) * num_shards
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_shards=num_shards,
        storage="none",
        low_watermark=0.0,
        high_watermark=0.0,
    )
    rng = random.Random(batch * 31 + num_shards)
    async with KVCacheManager(cfg) as kv:
        ids = list(range(batch))
        for start in range(0, batch, 64):
            chunk = ids[start : start + 64]
            prompts = {i: [rng.randrange(1000) for _ in range(PROMPT_TOKENS + i % BLOCK_SIZE)] for i in chunk}
            result = await kv.step(admits=[Admit(seq_id=i, prompt=prompts[i]) for i in chunk], want_metadata=False)
            assert not result.rejected, result.rejected
            await kv.step(commits={i: len(prompts[i]) - result.cached_tokens[i] for i in chunk}, want_metadata=False)
        for shard in kv._shards:
            shard.direct = direct
        appends = dict.fromkeys(ids, 7)
        commits = dict.fromkeys(ids, 1)
        await kv.step(appends=appends)
        times = []
        for n in range(warmup + steps):
            t0 = clock()
            result = await kv.step(commits=commits, appends=appends)
            elapsed = clock() - t0
            assert len(result.seq_ids) == batch and not result.rejected
            if n >= warmup:
                times.append(elapsed / 1000)
    return times


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration once in this process (the akv on ``sys.path``)."""
    import anyio

    import akv
    from akv.obs import configure_logging

    configure_logging(level="warning")
    out: dict[str, Any] = {"akv": str(Path(akv.__file__).resolve().parent.parent), "configs": {}}
    for num_shards in args.shards:
        for batch in args.batches:
            for path in args.paths:
                if num_shards == 1 and path == "queued" and not args.queued_one_shard:
                    continue
                clock = time.perf_counter_ns if args.wall else time.thread_time_ns
                times = anyio.run(_decode_run, num_shards, batch, args.steps, args.warmup, path == "direct", clock)
                key = f"shards={num_shards} B={batch} {path}"
                out["configs"][key] = {
                    "p50_us": pct(times, 0.5),
                    "p99_us": pct(times, 0.99),
                    "mean_us": statistics.fmean(times),
                }
                print(f"  {key}: p50 {pct(times, 0.5):.1f} us, p99 {pct(times, 0.99):.1f} us", file=sys.stderr)
    return out


def paired(args: argparse.Namespace) -> dict[str, Any]:
    """Alternate one child run per tree for ``--rounds`` rounds; medians per tree and ratios to the first."""
    trees = [t.split("=", 1) for t in args.trees]
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    passthrough = ["--shards", *map(str, args.shards), "--batches", *map(str, args.batches)]
    passthrough += ["--paths", *args.paths, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    passthrough += ["--wall"] if args.wall else []
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for name, path in order:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                env = {**os.environ, "PYTHONPATH": str(Path(path).resolve()), "OMP_NUM_THREADS": "1"}
                cmd = [sys.executable, __file__, "--child", "--out", tmp.name, *passthrough]
                print(f"round {r + 1}: {name} ({path})", file=sys.stderr)
                subprocess.run(cmd, env=env, check=True, cwd=str(Path(path).resolve()))
                runs[name].append(json.loads(Path(tmp.name).read_text()))
    first = trees[0][0]
    summary: dict[str, Any] = {}
    for key in runs[first][0]["configs"]:
        row = {}
        for name, _ in trees:
            row[name] = {
                stat: statistics.median(run["configs"][key][stat] for run in runs[name])
                for stat in ("p50_us", "p99_us")
            }
        for name, _ in trees[1:]:
            row[f"{name}/{first} p50"] = row[name]["p50_us"] / row[first]["p50_us"]
        summary[key] = row
    return {"trees": dict(trees), "rounds": args.rounds, "summary": summary, "runs": runs}


def table(doc: dict[str, Any]) -> str:
    """The summary as aligned text."""
    names = list(doc["trees"])
    lines = [
        f"{'config':<26}"
        + "".join(f"{n + ' p50/p99 us':>24}" for n in names)
        + "".join(f"{n + '/' + names[0]:>12}" for n in names[1:])
    ]
    for key, row in doc["summary"].items():
        cells = "".join(f"{row[n]['p50_us']:>14.1f} /{row[n]['p99_us']:>8.1f}" for n in names)
        ratios = "".join(f"{row[f'{n}/{names[0]} p50']:>12.3f}" for n in names[1:])
        lines.append(f"{key:<26}{cells}{ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs="+", default=[], help="NAME=PATH of each akv tree to compare (first: baseline)")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs per tree")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--paths", nargs="+", default=["direct", "queued"], choices=["direct", "queued"])
    p.add_argument("--queued-one-shard", action="store_true", help="also run the queued path with one shard")
    p.add_argument("--steps", type=int, default=200, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before them")
    p.add_argument("--wall", action="store_true", help="time by the wall clock, not the thread's CPU time")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output file ('' for none)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child or not args.trees:
        doc = child(args)
    else:
        doc = paired(args)
        doc["load_average"] = os.getloadavg()
        print(table(doc))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
