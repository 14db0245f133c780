"""Benchmark: what cache events cost a manager's step, events on with one subscriber against events off.

Two measurements, each paired in one run (the off and on variants alternate
round by round, so machine load hits both alike):

- **decode**: ``--batch`` sequences decode one token per step (``step(commits=...,
  appends=...)``, metadata on, ``storage="none"``); each ``--block-size``-th step
  fills a block per sequence, which is published (and keyed into events).
  Per-step time over ``--steps`` steps, best and median of ``--rounds`` rounds.
- **replay**: ``akv.replay`` over the head of the conversation trace (the README
  main job, ``--limit`` requests, a pool of ``--replay-blocks`` so it evicts),
  events off against on with a subscriber draining every batch; the replay's
  own step latency (mean, p50), wall time and the event loop thread's CPU time
  (``time.thread_time``: the whole replay runs on it in metadata mode, and it is
  less sensitive to other processes than the wall clock). With ``--host-blocks`` both
  variants have a host tier of that many blocks: evictions demote, host hits
  are promoted, the host tier drops its own blocks, and each of those is an
  event (docs/events.md, "Tiers"); the tier's counts are printed.

Prints one line per measurement and writes JSON.

    OMP_NUM_THREADS=1 python3 stress/bench_events_cost.py            # JSON to stress/results/bench_events_cost.json
    OMP_NUM_THREADS=1 python3 stress/bench_events_cost.py --rounds 3 --limit 100 --out /tmp/c.json
    OMP_NUM_THREADS=1 python3 stress/bench_events_cost.py --host-blocks 16384 --out stress/results/bench_events_cost_host.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import anyio
import numpy as np
import structlog

from akv import KVCacheConfig, KVCacheManager
from akv.core.step import Admit
from akv.replay import ReplayOptions, replay
from akv.trace import default_trace_path, read_trace


async def _decode_round(args: argparse.Namespace, events: bool) -> float:
    """Seconds per decode step of one round (a fresh manager; with events, one subscriber drained each step)."""
    num_blocks = args.batch * (2 + (args.prompt + args.steps) // args.block_size + 1)
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        storage="none",
        host_blocks=args.host_blocks,
        enable_events=events,
    )
    rng = np.random.default_rng(0)
    async with KVCacheManager(cfg) as kv:
        sub = kv.subscribe_events() if events else None
        ids = [f"s{i}" for i in range(args.batch)]
        admits = [Admit(seq_id=i, prompt=rng.integers(0, 30000, args.prompt, dtype=np.int32)) for i in ids]
        await kv.step(admits=admits)
        commits = dict.fromkeys(ids, args.prompt)
        tokens = rng.integers(0, 30000, (args.steps, args.batch)).tolist()
        t0 = time.perf_counter()
        for step in range(args.steps):
            await kv.step(commits=commits, appends=dict(zip(ids, tokens[step])))
            commits = dict.fromkeys(ids, 1)
            if sub is not None:
                while sub.receive_nowait() is not None:
                    pass
        return (time.perf_counter() - t0) / args.steps


async def _replay_round(args: argparse.Namespace, requests: list, events: bool) -> dict:
    cfg = KVCacheConfig(
        num_blocks=args.replay_blocks, block_size=16, storage="none", host_blocks=args.host_blocks, enable_events=events
    )
    async with KVCacheManager(cfg) as kv:
        batches = 0
        async with anyio.create_task_group() as tg:
            if events:
                sub = kv.subscribe_events(buffer=1 << 20)

                async def drain() -> None:
                    nonlocal batches
                    async for _ in sub:
                        batches += 1

                tg.start_soon(drain)
            t0, c0 = time.perf_counter(), time.thread_time()
            report = await replay(kv, requests, ReplayOptions())
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            if events:
                sub.close()
    lat = report.step_latency_us
    tier = {name: getattr(report, name) for name in ("demoted_blocks", "promoted_blocks", "host_hit_tokens")}
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "mean_us": lat.get("mean"),
        "p50_us": lat.get("p50"),
        "batches": batches,
        "tier": tier,
    }


async def main_async(args: argparse.Namespace) -> dict:
    decode = {"off": [], "on": []}
    for _ in range(args.rounds):
        for variant in ("off", "on") if _ % 2 == 0 else ("on", "off"):
            decode[variant].append(await _decode_round(args, variant == "on"))
    requests = read_trace(default_trace_path(), limit=args.limit)
    rep = {"off": [], "on": []}
    for r in range(args.rounds):
        for variant in ("off", "on") if r % 2 == 0 else ("on", "off"):
            rep[variant].append(await _replay_round(args, requests, variant == "on"))
    out: dict = {"decode_us_per_step": {}, "replay": {}}
    for v, xs in decode.items():
        out["decode_us_per_step"][v] = {"best": min(xs) * 1e6, "median": statistics.median(xs) * 1e6}
    for v, runs in rep.items():
        out["replay"][v] = {
            "wall_s_best": min(x["wall_s"] for x in runs),
            "cpu_s_best": min(x["cpu_s"] for x in runs),
            "step_mean_us_median": statistics.median(x["mean_us"] for x in runs),
            "step_p50_us_median": statistics.median(x["p50_us"] for x in runs),
            "batches": runs[0]["batches"],
            "tier": runs[0]["tier"],
        }
    d, r = out["decode_us_per_step"], out["replay"]
    out["overhead_pct"] = {
        "decode_best": 100 * (d["on"]["best"] / d["off"]["best"] - 1),
        "decode_median": 100 * (d["on"]["median"] / d["off"]["median"] - 1),
        "replay_step_mean": 100 * (r["on"]["step_mean_us_median"] / r["off"]["step_mean_us_median"] - 1),
        "replay_wall_best": 100 * (r["on"]["wall_s_best"] / r["off"]["wall_s_best"] - 1),
        "replay_cpu_best": 100 * (r["on"]["cpu_s_best"] / r["off"]["cpu_s_best"] - 1),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="decoding sequences (default 256)")
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens each (default 200)")
    parser.add_argument("--steps", type=int, default=128, help="decode steps per round (default 128)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds (default 5)")
    parser.add_argument("--limit", type=int, default=200, help="trace requests replayed (default 200)")
    parser.add_argument("--replay-blocks", type=int, default=4096, help="replay pool in blocks (default 4096)")
    parser.add_argument("--host-blocks", type=int, default=0, help="host tier in blocks (default 0: none)")
    parser.add_argument("--out", type=Path, default=Path("stress/results/bench_events_cost.json"))
    args = parser.parse_args()
    # The host configures logging (akv never does): warnings only, so debug events cost nothing.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = anyio.run(main_async, args)
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    result["machine"] = {"python": platform.python_version(), "load_avg": os.getloadavg()}
    for v in ("off", "on"):
        d = result["decode_us_per_step"][v]
        print(f"decode step, events {v:3}: best {d['best']:8.1f} us  median {d['median']:8.1f} us")
    for v in ("off", "on"):
        r = result["replay"][v]
        print(
            f"replay, events {v:3}: step mean {r['step_mean_us_median']:7.1f} us  p50 {r['step_p50_us_median']:6.1f} us"
            f"  wall {r['wall_s_best']:.2f} s  cpu {r['cpu_s_best']:.2f} s  batches {r['batches']}"
        )
    if args.host_blocks:
        t = result["replay"]["on"]["tier"]
        print(f"host tier {args.host_blocks} blocks: " + "  ".join(f"{k} {v:,}" for k, v in t.items()))
    for k, v in result["overhead_pct"].items():
        print(f"overhead {k:18}: {v:+.1f} %")
    print(f"load average {result['machine']['load_avg']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
