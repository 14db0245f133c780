"""Benchmark of the host tier (issue 16) on the real Mooncake conversation trace: hit rate and per-step cost.

Two measurements, one command each (both write JSON; ``sweep`` also draws a plot):

    # hit rate against host-tier size, 50,000 device blocks, first 2,000 requests, metadata mode
    python stress/bench_host_tier.py sweep --plot docs/host_tier_hit_rate.png
    # per-step cost with the tier on against off at the same device pool, alternating pairs
    python stress/bench_host_tier.py cost --pairs 3
    python stress/bench_host_tier.py cost --pairs 3 --storage cpu   # real CPU tensors (tiny model)
    python stress/bench_host_tier.py cost --pairs 3 --storage cpu --with-thread  # + copies on a thread

Every run is ``akv replay``'s scheduler (:func:`akv.replay.replay`) in this
process, with ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)`` (said in
the output). ``sweep`` compares each host size with the device-only pool of
the same total (the issue's reference is 250,000 device blocks). ``cost``
runs tier off, tier on, tier off, tier on, ... and reports each run's step
latency mean / p50 / p99 (µs, over every scheduler step), wall time (of
which the scheduler awaited the step's copies, as a runner must before its
forward pass: ``ReplayOptions.wait_copies``), the main thread's CPU time
during the replay (``time.thread_time``: the event loop's work, the
manager's included, not the pools' allocation; the number least moved by
other jobs on the machine), and the median of the per-pair ratios.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import torch

from akv import KVCacheConfig, KVCacheManager, model_shape
from akv.obs import configure_logging
from akv.replay import ReplayOptions, replay
from akv.trace import read_trace, shared_trace_path

ROOT = Path(__file__).resolve().parent.parent
DEVICE_BLOCKS = 50_000
HOST_SIZES = (0, 25_000, 50_000, 100_000, 200_000, 400_000)
REFERENCE = 250_000


def run_one(requests: list, num_blocks: int, host_blocks: int, storage: str, copy_process: bool = True) -> dict:
    """One replay; its report as JSON plus the configuration (``copy_process``: see ``KVCacheConfig``)."""
    config = KVCacheConfig(
        num_blocks=num_blocks,
        block_size=16,
        model=model_shape("tiny"),
        storage="none" if storage == "none" else "tensors",
        host_blocks=host_blocks,
        copy_process=copy_process,
    )

    async def go():
        async with KVCacheManager(config) as kv:
            cpu0 = time.thread_time()  # the replay only: not the pools' allocation nor the copy process's start
            report = await replay(kv, requests, ReplayOptions())
            return report, time.thread_time() - cpu0

    report, cpu_s = anyio.run(go)
    out = report.as_json()
    out.update(
        device_blocks=num_blocks, host_blocks=host_blocks, storage=storage, copy_process=copy_process, cpu_s=cpu_s
    )
    return out


def machine() -> dict:
    """Where and how the numbers were taken."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return {
        "commit": commit.stdout.strip(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
    }


def sweep(requests: list, args: argparse.Namespace) -> dict:
    """Hit rate against host size at 50,000 device blocks, and device-only pools of the same totals."""
    rows = []
    for host in HOST_SIZES:
        tier = run_one(requests, DEVICE_BLOCKS, host, "none")
        flat = run_one(requests, DEVICE_BLOCKS + host, 0, "none")
        rows.append(
            {
                "host_blocks": host,
                "hit_rate": tier["hit_rate"],
                "host_hit_tokens": tier["host_hit_tokens"],
                "device_only_same_total": flat["hit_rate"],
                "decode_steps": tier["decode_steps"],
                "preemptions": tier["preemptions"],
            }
        )
        print(
            f"host {host:>7,}: hit rate {tier['hit_rate']:.4%} (device-only {DEVICE_BLOCKS + host:,} blocks: "
            f"{flat['hit_rate']:.4%}), {tier['decode_steps']:,} steps, {tier['preemptions']} preemptions",
            flush=True,
        )
    reference = next(r["device_only_same_total"] for r in rows if DEVICE_BLOCKS + r["host_blocks"] == REFERENCE)
    tier = next(r["hit_rate"] for r in rows if r["host_blocks"] == REFERENCE - DEVICE_BLOCKS)
    print(f"50,000 + 200,000 host: {tier:.4%} = {tier / reference:.1%} of 250,000 device blocks ({reference:.4%})")
    if args.plot:
        plot(rows, args.plot)
    return {"rows": rows, "target_ratio": tier / reference}


def plot(rows: list[dict], path: Path) -> None:
    """Hit rate against host-tier size, with the device-only pool of the same total blocks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["host_blocks"] / 1000 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [100 * r["hit_rate"] for r in rows], "o-", label=f"{DEVICE_BLOCKS:,} device blocks + host tier")
    ax.plot(x, [100 * r["device_only_same_total"] for r in rows], "s--", label="device only, same total blocks")
    ax.set_xlabel("host-tier blocks (thousands; 16 tokens each)")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title("Mooncake conversation trace, first 2,000 requests (metadata mode)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def cost(requests: list, args: argparse.Namespace) -> dict:
    """Tier off and tier on at the same device pool, alternating; per-step latency of every run.

    With ``--with-thread`` (CPU tensors) each round adds a tier-on run whose
    copies run on the worker thread (``copy_process=False``): off, on, on (thread).
    """
    variants = [(0, True), (args.host_blocks, True)]
    if args.with_thread:
        variants.append((args.host_blocks, False))
    runs = []
    for pair in range(args.pairs):
        for host, process in variants:
            r = run_one(requests, args.device_blocks, host, args.storage, process)
            lat = r["step_latency_us"]
            runs.append(
                {
                    "pair": pair,
                    "host_blocks": host,
                    "copy_process": process,
                    "wall_s": r["wall_s"],
                    "copy_wait_s": r["copy_wait_s"],
                    "cpu_s": r["cpu_s"],
                    **lat,
                    "hit_rate": r["hit_rate"],
                }
            )
            what = "" if host == 0 or args.storage == "none" else (" (process)" if process else " (thread) ")
            print(
                f"pair {pair} host {host:>7,}{what}: step mean {lat['mean']:.1f} p50 {lat['p50']:.1f} "
                f"p99 {lat['p99']:.1f} us, wall {r['wall_s']:.2f} s (awaiting copies {r['copy_wait_s']:.2f} s), main-thread CPU {r['cpu_s']:.2f} s, "
                f"hit rate {r['hit_rate']:.4%}, load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    n = len(variants)
    out: dict = {"runs": runs}
    for v, label in ((1, "ratios"), (2, "ratios_thread"))[: n - 1]:
        ratios = {}
        for key in ("mean", "p50", "p99", "wall_s", "cpu_s"):
            per_pair = [runs[n * p + v][key] / runs[n * p][key] for p in range(args.pairs) if runs[n * p][key]]
            ratios[key] = statistics.median(per_pair)
        out[label] = ratios
        name = "tier on / off" if v == 1 else "tier on, copies on a thread / off"
        print(f"{name}, median of pairs: " + ", ".join(f"{k} {x:.2f}x" for k, x in ratios.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one measurement; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("sweep", "cost"))
    parser.add_argument(
        "--trace", type=Path, default=None, help="default: ../shared/traces/mooncake_conversation.jsonl"
    )
    parser.add_argument("--limit", type=int, default=2000)
    parser.add_argument("--plot", type=Path, default=None, help="sweep: write the plot here (PNG)")
    parser.add_argument("--pairs", type=int, default=3, help="cost: alternating off/on pairs")
    parser.add_argument("--device-blocks", type=int, default=DEVICE_BLOCKS, help="cost: device pool")
    parser.add_argument("--host-blocks", type=int, default=200_000, help="cost: host tier of the 'on' runs")
    parser.add_argument("--storage", choices=("none", "cpu"), default="none", help="cost: metadata or CPU tensors")
    parser.add_argument(
        "--with-thread", action="store_true", help="cost, cpu: also run the tier with copy_process=False each round"
    )
    parser.add_argument("--json", type=Path, default=None, help="default: stress/results/bench_host_tier_<what>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configure_logging(level="warning")
    path = args.trace or shared_trace_path("mooncake_conversation.jsonl")
    if path is None:
        print("bench_host_tier: the conversation trace is not in ../shared/traces; pass --trace", file=sys.stderr)
        return 2
    requests = read_trace(path, limit=args.limit)
    print(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, torch threads {torch.get_num_threads()}; {machine()}")
    t0 = time.perf_counter()
    result = sweep(requests, args) if args.what == "sweep" else cost(requests, args)
    out = {"machine": machine(), "limit": args.limit, "seconds": time.perf_counter() - t0, **result}
    target = args.json or ROOT / "stress" / "results" / f"bench_host_tier_{args.what}.json"
    target.write_text(json.dumps(out, indent=1))
    print(f"json: {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
