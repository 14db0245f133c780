"""Seeded bugs against the manager machine: does akv.testing.ManagerMachine catch each one?

Each mutant is one text replacement in a scratch copy of the tree (the
checkout itself is never changed); the machine then runs from that copy with
a fixed example budget, generation only (no shrinking), and the first failure
line is reported. Usage::

    OMP_NUM_THREADS=1 python3 stress/machine_mutants.py [--examples 150] [--only NAME ...]

Prints one line per mutant and writes ``machine_mutants.json`` (name ->
caught, examples run, first failure line).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: name -> (file, old text, new text): each a bookkeeping or data bug of the kind the issue lists.
MUTANTS: dict[str, tuple[str, str, str]] = {
    "free of several sequences loses a decref": (
        "akv/core/shard_state.py",
        "self.pool.decref(ids, distinct=len(freed_rows) == 1)",
        "self.pool.decref(ids[:-1] if len(freed_rows) > 1 else ids, distinct=len(freed_rows) == 1)",
    ),
    "fork skips the incref of the first block": (
        "akv/core/shard_state.py",
        "pool.incref(ids, distinct=True)",
        "pool.incref(ids[1:], distinct=True)",
    ),
    "namespace dropped from the tree key": (
        "akv/core/shard_state.py",
        "return (self.shard_index, namespace)",
        "return (self.shard_index, None)",
    ),
    "copy-on-write copies all but the first slot": (
        "akv/storage/kv_pool.py",
        "raw.index_copy_(1, dst, raw.index_select(1, src))",
        "raw[:, dst, 1:] = raw[:, src, 1:]",
    ),
    "no copy-on-write for a tail shared by two": (
        "akv/core/shard_state.py",
        "tail = start % bs != 0 and pool.refcount(blocks.last()) > 1",
        "tail = start % bs != 0 and pool.refcount(blocks.last()) > 2",
    ),
    "inner tree node evicted": (
        "akv/core/radix_tree.py",
        "if not 0 <= block_id < n or nchild[block_id] != 0:",
        "if not 0 <= block_id < n or nchild[block_id] < 0:",
    ),
    "lookup counts the last prompt token's block": (
        "akv/core/shard_state.py",
        "n = (len(prompt) - 1) // self.block_size if len(prompt) else 0",
        "n = len(prompt) // self.block_size",
    ),
    "a full committed tail published with its partial successor": (
        "akv/core/shard_state.py",
        "full = min(seq.num_computed // bs, len(seq.block_ids))",
        "full = min(-(-seq.num_computed // bs), len(seq.block_ids))",
    ),
    "later admissions' prefix hits not protected from eviction": (
        "akv/core/shard_state.py",
        "protected.add(i, hits)",
        "pass",
    ),
    "write scatters K/V to reversed slots": (
        "akv/storage/kv_pool.py",
        "flat[0].index_copy_(0, slots, _raw(key))",
        "flat[0].index_copy_(0, slots.flip(0), _raw(key))",
    ),
}

RUNNER = """
import sys, logging, structlog
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from akv.testing.manager_machine import ManagerMachine
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
run_state_machine_as_test(ManagerMachine, settings=settings(
    max_examples=int(sys.argv[1]), stateful_step_count=30, deadline=None, database=None,
    phases=[Phase.generate], suppress_health_check=list(HealthCheck)))
"""


def run_mutant(name: str, examples: int) -> dict:
    """Apply one mutant to a scratch copy of akv/ and run the machine there."""
    path, old, new = MUTANTS[name]
    with tempfile.TemporaryDirectory(prefix="akv-mutant-") as tmp:
        shutil.copytree(ROOT / "akv", Path(tmp) / "akv", ignore=shutil.ignore_patterns("__pycache__"))
        target = Path(tmp) / path
        text = target.read_text()
        if text.count(old) != 1:
            return {"caught": None, "line": f"mutant text found {text.count(old)} times in {path}"}
        target.write_text(text.replace(old, new))
        env = {**os.environ, "PYTHONPATH": tmp, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", RUNNER, str(examples)], env=env, capture_output=True, text=True, timeout=1800
        )
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Error" in ln or "assert" in ln]
    return {"caught": proc.returncode != 0, "line": lines[-1].strip() if lines else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=150)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    results = {}
    for name in args.only or MUTANTS:
        results[name] = res = run_mutant(name, args.examples)
        print(f"{'CAUGHT' if res['caught'] else 'missed':7} {name}: {res['line'][:160]}", flush=True)
    Path("machine_mutants.json").write_text(json.dumps({"examples": args.examples, "mutants": results}, indent=2))
    caught = sum(1 for r in results.values() if r["caught"])
    print(f"{caught} of {len(results)} mutants caught with {args.examples} examples each")


if __name__ == "__main__":
    main()
