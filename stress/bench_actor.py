"""Actor runtime benchmark: the direct hand-off vs the inbox, this runtime vs the one at a base commit.

Two measurements, on asyncio, uvloop and trio, each paired (old and new in one run):

(a) **ask latency** of a trivial message (the handler returns it), p50/p99/mean
    µs over ``--asks`` asks per variant. The variants run in one event loop per
    backend, interleaved in chunks of 1,000 asks (order rotated per chunk), so
    load hits them alike: this tree's runtime, direct and queued
    (``Actor(direct=False)``), and the base commit's ``akv/actors/runtime.py``
    (loaded from ``git show`` into a temporary module), direct, queued, and
    direct with its checkpoint swapped for the public
    ``anyio.lowlevel.checkpoint`` (the base resolved ``asyncio.sleep(0)`` once
    per actor instead).
(b) **decode step through the manager** at ``--batch`` sequences
    (``stress/bench_micro.py``'s workload: metadata mode, one token appended per
    sequence per step), shards serving directly or through their inboxes
    (``shard.direct = False``). Each run is a subprocess whose ``PYTHONPATH`` is
    this tree or a worktree of the base commit (``--base-tree``, created with
    ``git worktree add`` if missing), alternating for ``--rounds`` rounds;
    per-step p50/p99 µs over the pooled steps, and the median of the rounds'
    p50s (robust to a round that a load burst hit).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python3 stress/bench_actor.py   # ~3 min, JSON to stress/results/bench_actor.json
    python3 stress/bench_actor.py --asks 5000 --rounds 1 --steps 100 --out /tmp/a.json   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
from bench_micro import _admits, _config, available_backends, make_plan, pct, run_on, versions

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "stress" / "results" / "bench_actor.json"
BACKENDS = ("asyncio", "uvloop", "trio")
CHUNK = 1000


def load_base_runtime(commit: str) -> Any:
    """The module ``akv/actors/runtime.py`` as of ``commit``, imported under another name."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:akv/actors/runtime.py"], capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory(prefix="akv-base-runtime-") as tmp:
        path = Path(tmp) / "akv_base_runtime.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("akv_base_runtime", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def echo_class(actor_base: type) -> type:
    """An actor class on ``actor_base`` whose handler returns the message."""

    class Echo(actor_base):
        def handle(self, msg: Any) -> Any:
            return msg

    return Echo


async def _ask_variants(variants: dict[str, tuple[type, bool, bool]], n: int) -> dict[str, list[int]]:
    """Ask each variant's actor ``n`` times (after a warm-up), chunk by chunk in rotating order; ns per ask."""
    pc = time.perf_counter_ns
    times: dict[str, list[int]] = {name: [] for name in variants}
    actors = {name: cls(name, 16, direct=direct) for name, (cls, direct, _) in variants.items()}
    async with anyio.create_task_group() as tg:
        for actor in actors.values():
            tg.start_soon(actor.run)
        await anyio.wait_all_tasks_blocked()
        for name, (_, _, public_checkpoint) in variants.items():
            if public_checkpoint:  # the base runtime resolves its checkpoint in run()
                actors[name]._checkpoint = anyio.lowlevel.checkpoint
        names = list(variants)
        for chunk in range(-1, n // CHUNK):  # chunk -1: warm-up, not recorded
            for name in names[chunk % len(names) :] + names[: chunk % len(names)]:
                actor, out = actors[name], times[name]
                for i in range(CHUNK):
                    t = pc()
                    await actor.ask(i)
                    dt = pc() - t
                    if chunk >= 0:
                        out.append(dt)
        for actor in actors.values():
            actor.close()
    return times


def ask_latency(backend: str, base: Any, n: int) -> list[dict[str, Any]]:
    """Rows of (a) for one backend: p50/p99/mean µs per variant."""
    from akv.actors.runtime import Actor

    new, old = echo_class(Actor), echo_class(base.Actor)
    variants = {
        "new direct": (new, True, False),
        "new queued": (new, False, False),
        "base direct": (old, True, False),
        "base direct, public checkpoint": (old, True, True),
        "base queued": (old, False, False),
    }
    gc.collect()
    times = run_on(backend, _ask_variants, variants, n)
    return [
        {
            "backend": backend,
            "variant": name,
            "asks": len(ts),
            "p50_us": pct(ts, 0.5) / 1e3,
            "p99_us": pct(ts, 0.99) / 1e3,
            "mean_us": sum(ts) / len(ts) / 1e3,
        }
        for name, ts in times.items()
    ]


# ----------------------------------------------------------------- (b) decode steps, one subprocess per tree and round


async def _decode(plan: Any, direct: bool) -> list[int]:
    from akv import KVCacheManager

    pc = time.perf_counter_ns
    step_ns: list[int] = []
    async with KVCacheManager(_config(plan)) as kv:
        res = await kv.step(admits=_admits(plan), want_metadata=True)
        for shard in kv._shards:  # reaching in on purpose, as the tests do
            shard.direct = direct
        gc.collect()
        for k, (commits, appends) in enumerate(plan.inputs):
            t = pc()
            res = await kv.step(commits=commits, appends=appends, want_metadata=True)
            dt = pc() - t
            if res.rejected:
                raise next(iter(res.rejected.values()))
            if k >= plan.warmup:
                step_ns.append(dt)
    return step_ns


def worker(args: argparse.Namespace) -> None:
    """Subprocess body: every backend, direct and queued (order by round), steps in ns as JSON on stdout."""
    import akv
    from akv.obs import configure_logging

    configure_logging(level="warning")
    plan = make_plan(args.batch, args.steps)
    paths = ["direct", "queued"] if args.round % 2 == 0 else ["queued", "direct"]
    out: dict[str, Any] = {"akv": akv.__file__}
    for backend in args.backends:
        for path in paths:
            out[f"{backend} {path}"] = run_on(backend, _decode, plan, path == "direct")
    print(json.dumps(out))


def decode_steps(args: argparse.Namespace, trees: dict[str, Path]) -> list[dict[str, Any]]:
    """Rows of (b): the trees alternate per round, each round a fresh process per tree."""
    pooled: dict[tuple[str, str], list[int]] = {}
    round_p50s: dict[tuple[str, str], list[float]] = {}
    script = Path(__file__).resolve()
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
        for label in order:
            env = {**os.environ, "PYTHONPATH": str(trees[label]), "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, str(script), "--worker", "--round", str(rnd), "--batch", str(args.batch)]
            cmd += ["--steps", str(args.steps), "--backends", *args.backends]
            doc = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
            if not doc.pop("akv").startswith(str(trees[label])):
                raise RuntimeError(f"the {label} worker imported akv from outside {trees[label]}")
            for key, ns in doc.items():
                pooled.setdefault((label, key), []).extend(ns)
                round_p50s.setdefault((label, key), []).append(pct(ns, 0.5) / 1e3)
            print(f"  decode round {rnd + 1}/{args.rounds}: {label} done", flush=True)
    return [
        {
            "tree": label,
            "backend": key.split()[0],
            "path": key.split()[1],
            "batch": args.batch,
            "steps": len(ns),
            "p50_us": pct(ns, 0.5) / 1e3,
            "p99_us": pct(ns, 0.99) / 1e3,
            "round_p50s_us": round_p50s[label, key],
            "median_round_p50_us": statistics.median(round_p50s[label, key]),
        }
        for (label, key), ns in sorted(pooled.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    ]


def base_tree(path: Path, commit: str) -> Path:
    """A worktree of ``commit`` at ``path`` (added if missing; an existing one is kept)."""
    if not (path / "akv").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True)
    head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    want = subprocess.run(["git", "-C", str(ROOT), "rev-parse", commit], capture_output=True, text=True, check=True)
    if head.stdout != want.stdout:
        raise SystemExit(f"{path} is not at {commit}")
    return path


def table(doc: dict) -> str:
    """Markdown tables of a result document."""
    lines = ["| backend | variant | asks | p50 µs | p99 µs | mean µs |", "|---|---|---|---|---|---|"]
    for r in doc["ask_latency"]:
        lines.append(
            f"| {r['backend']} | {r['variant']} | {r['asks']} | {r['p50_us']:.2f} | {r['p99_us']:.2f} "
            f"| {r['mean_us']:.2f} |"
        )
    lines += [
        "",
        "| backend | path | tree | B | steps | step p50 µs | step p99 µs | median of round p50s µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["decode_steps"]:
        lines.append(
            f"| {r['backend']} | {r['path']} | {r['tree']} | {r['batch']} | {r['steps']} | {r['p50_us']:.1f} "
            f"| {r['p99_us']:.1f} | {r['median_round_p50_us']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="0a4c218", help="commit whose runtime is the baseline")
    p.add_argument("--base-tree", default="/tmp/base-0a4", help="worktree of --base for (b)")
    p.add_argument("--asks", type=int, default=100_000, help="timed asks per variant and backend (a)")
    p.add_argument("--batch", type=int, default=64, help="decode batch size (b)")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per run (b)")
    p.add_argument("--rounds", type=int, default=8, help="subprocess rounds per tree (b)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output file ('' for none)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends if b in available_backends()]
    if args.worker:
        worker(args)
        return 0
    from akv.obs import configure_logging

    configure_logging(level="warning")
    load0 = list(os.getloadavg())
    base = load_base_runtime(args.base)
    asks = []
    for backend in args.backends:
        asks += ask_latency(backend, base, args.asks)
        print(f"  asks on {backend} done", flush=True)
    trees = {"new": ROOT, "base": base_tree(Path(args.base_tree), args.base)}
    doc = {
        "command": "python3 stress/bench_actor.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": versions(),
        "base": args.base,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "loadavg_before": load0,
        "ask_latency": asks,
        "decode_steps": decode_steps(args, trees),
        "loadavg_after": list(os.getloadavg()),
    }
    print()
    print(table(doc))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
