"""Metadata bytes per cached block: the prefix tree and the pool's per-block state, old tree vs new in one run.

For each akv source tree given (default: this checkout and, if present, the
worktree of the commit before the run-compressed tree, ``/tmp/base-0a4``), a
subprocess with that tree on ``PYTHONPATH`` builds one ``ShardState`` and
caches the first ``--limit`` conversation-trace prompts in it (each admitted
with ``prefill_done``, so its full blocks are published, then freed, so they
are cached), with a pool large enough that nothing is evicted, under
``tracemalloc``; then it builds the same shard with the prefix cache off
(nothing published, nothing cached). The live bytes of the first minus those
of the second, divided by the cached blocks, are the metadata a cached block
costs: its tree entry (nodes, token bytes, per-block arrays, dict entries,
the int objects they hold) and its place in the pool's eviction order. The
shard's fixed per-block state (pool states and refcounts, the free queue,
the token array beside each block's K/V: 4 bytes per token of every pool
block) is in both and reported per pool block.

Usage::

    PYTHONPATH=$PWD python3 stress/bench_tree_memory.py [--limit 300] [--tree PATH ...]

Prints one line per tree and writes ``stress/results/tree_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
OLD_TREE = Path("/tmp/base-0a4")

# Run in the subprocess, with the measured akv first on sys.path.
_MEASURE = r"""
import gc, json, sys, tracemalloc
from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepRequest
from akv.trace import read_trace
from akv.trace.tokens import synthesize_prompt

trace, limit, bs = sys.argv[1], int(sys.argv[2]), 16
records = read_trace(trace, limit=limit)
prompts = [synthesize_prompt(r.hash_ids, r.input_length) for r in records]
num_blocks = sum(-(-len(p) // bs) for p in prompts) + 1

def build(enable):
    gc.collect()
    tracemalloc.start(1)
    state = ShardState(0, range(0, num_blocks), bs, enable_prefix_cache=enable)
    for i, p in enumerate(prompts):
        state.step(StepRequest(admits=[Admit(seq_id=i, prompt=p, prefill_done=True)], want_metadata=False))
        state.step(StepRequest(frees=[i], want_metadata=False))
    gc.collect()
    live = tracemalloc.get_traced_memory()[0]
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    by_file = {}
    for stat in snap.statistics("filename"):
        name = stat.traceback[0].filename.rsplit("/", 1)[-1]
        by_file[name] = by_file.get(name, 0) + stat.size
    state.check()
    return state, live, by_file

plain, plain_live, _ = build(False)
del plain
state, live, by_file = build(True)
cached = state.pool.num_cached
assert cached == len(state.tree), (cached, len(state.tree))
print(json.dumps(dict(
    akv=__import__("akv").__file__, prompts=len(prompts), cached_blocks=cached, pool_blocks=num_blocks,
    live_bytes=live, live_bytes_without_prefix_cache=plain_live, tree_nodes=getattr(state.tree, "num_nodes", None),
    cache_bytes_per_cached_block=(live - plain_live) / cached,
    shard_bytes_per_pool_block_without_prefix_cache=plain_live / num_blocks,
    live_bytes_by_file={k: v for k, v in sorted(by_file.items(), key=lambda kv: -kv[1])[:10]},
)))
"""


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def measure(tree: Path, limit: int) -> dict:
    """One subprocess run of the measurement against the akv at ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(TRACE), str(limit)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"measurement failed for {tree}:\n{proc.stderr}")
    return {"tree": str(tree), "commit": _commit(tree), **json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure each tree, print and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=300, help="conversation-trace requests to cache")
    ap.add_argument("--tree", type=Path, action="append", help="akv source tree (repeatable)")
    ap.add_argument("--out", type=Path, default=ROOT / "stress" / "results" / "tree_memory.json")
    a = ap.parse_args(argv)
    trees = a.tree or [t for t in (OLD_TREE, ROOT) if (t / "akv").is_dir()]
    rows = [measure(t, a.limit) for t in trees]
    for r in rows:
        print(
            f"{r['commit']:>10}  {r['cached_blocks']:,} cached blocks ({r['prompts']} prompts)  "
            f"cache metadata {r['cache_bytes_per_cached_block']:.0f} B/cached block  "
            f"shard without a cache {r['shard_bytes_per_pool_block_without_prefix_cache']:.0f} B/pool block  "
            f"tree nodes {r['tree_nodes']}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"limit": a.limit, "block_size": 16, "runs": rows}, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
