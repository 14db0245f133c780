"""Seeded bookkeeping bugs: does ``akv stress`` catch each on its own?

Each mutant is a small source patch (exact text replaced once) applied to a
scratch copy of akv in a temporary directory; the harness then runs on the
copy (``python -m akv.cli stress``, driven by a program count) with a few
configurations until one run fails. A mutant is *caught* when a run exits
non-zero. The unpatched copy must pass every configuration first (no false
alarm). ``--pytest`` also runs the default test suite (``pytest -x -q``) on
each mutant.

    python stress/mutants.py                      # JSON to stress/results/mutants.json
    python stress/mutants.py --only namespace_dropped --pytest
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    """A seeded bug: ``(file, old text, new text)`` patches, each old text found exactly once."""

    name: str
    what: str
    patches: tuple[tuple[str, str, str], ...]


SHARD = "akv/core/shard_state.py"
MUTANTS = (
    Mutant(
        "lost_decref_shared_free",
        "a step freeing several sequences that share blocks takes the distinct-blocks path (references lost)",
        ((SHARD, "self.pool.decref(ids, distinct=len(freed_rows) == 1)", "self.pool.decref(ids, distinct=True)"),),
    ),
    Mutant(
        "published_partial_tail",
        "a sequence's partial tail block is published with its full blocks",
        (
            (
                "akv/core/publish.py",
                "full = min(seq.num_computed // bs, len(seq.block_ids))",
                "full = min(-(-seq.num_computed // bs), len(seq.block_ids))",
            ),
        ),
    ),
    Mutant(
        "namespace_dropped",
        "the namespace is dropped from the tree key (tenants share blocks)",
        ((SHARD, "return (self.shard_index, namespace)", "return (self.shard_index, None)"),),
    ),
    Mutant(
        "eviction_order_reversed",
        "LRU evicts the most recently released block first",
        (
            (
                "akv/core/block_pool.py",
                "out = [popitem(last=False)[0] for _ in range(min(max_blocks, len(lru)))]",
                "out = [popitem(last=True)[0] for _ in range(min(max_blocks, len(lru)))]",
            ),
        ),
    ),
    Mutant(
        "inner_node_evicted",
        "the tree removes a block that is not a leaf (a run's inner block, or a last block with children)",
        (
            (
                "akv/core/radix_tree.py",
                "if node is None or node.children or top != len(node.blocks) - 1 or node.blocks[top] != top_block:",
                "if node is None or node.blocks[top] != top_block:",
            ),
            (
                "akv/core/radix_tree.py",
                "if node is None or node.children or pos != len(node.blocks) - 1:",
                "if node is None:",
            ),
        ),
    ),
    Mutant(
        "free_not_shielded",
        "free() is not shielded from cancellation (a cancelled request's free is dropped)",
        (
            (
                "akv/manager.py",
                'with self._tracer.span("akv.free", attributes={"akv.seq_id": str(seq_id)}), anyio.CancelScope(shield=True):',
                'with self._tracer.span("akv.free", attributes={"akv.seq_id": str(seq_id)}):',
            ),
        ),
    ),
    Mutant(
        "cow_skipped_in_decode",
        "a decode step writes into a shared partial tail without copying it",
        (
            (
                "akv/core/decode.py",
                "if pool.refcount(tables.last_block(r)) > 1:\n                self._copy_on_write(ids[i], r, out)",
                "if pool.refcount(tables.last_block(r)) > 99:\n                self._copy_on_write(ids[i], r, out)",
            ),
        ),
    ),
    Mutant(
        "fork_without_incref",
        "a fork shares the parent's blocks without taking references",
        ((SHARD, "                pool.incref(ids, distinct=True)\n", "                pass\n"),),
    ),
    Mutant(
        "published_before_commit",
        "blocks are published once their tokens are appended, before their K/V is committed",
        (
            (
                "akv/core/publish.py",
                "full = min(seq.num_computed // bs, len(seq.block_ids))",
                "full = min(seq.num_tokens // bs, len(seq.block_ids))",
            ),
        ),
    ),
    Mutant(
        "copy_destination_not_pinned",
        "a copy-on-write destination can be handed out again before its copy ran",
        (
            ("akv/core/decode.py", "pool.pin_for_copy((old, new))", "pool.pin_for_copy((old,))"),
            (
                "akv/actors/pool_shard.py",
                "self._pinned.append((ticket, src + dst))",
                "self._pinned.append((ticket, src))",
            ),
        ),
    ),
    Mutant(
        "pending_hit_evicted",
        "eviction ignores the blocks a step's admissions are about to hit",
        (
            (
                "akv/core/block_pool.py",
                "out = self._keyed.pop_first(max_blocks, skip)",
                "out = self._keyed.pop_first(max_blocks, frozenset())",
            ),
            ("akv/core/block_pool.py", "        elif not skip:\n", "        elif True:\n"),
        ),
    ),
    Mutant(
        "copy_ticket_dropped",
        "a one-shard step's copy ticket is not recorded, so wait_copies() and check() do not wait for it",
        (
            (
                "akv/manager.py",
                "Step(request, self._tracer.context()), self._track_step)",
                "Step(request, self._tracer.context()))",
            ),
        ),
    ),
)

#: Harness configurations, tried in order until one fails (a program count each, not a time).
RUNS = (
    ["--seed", "1", "--shards", "1", "--eviction-policy", "random", "--namespaces", "3"],
    [
        "--seed",
        "2",
        "--shards",
        "2",
        "--eviction-policy",
        "lru",
        "--fault",
        "slow_copies",
        "--fault-after-programs",
        "1",
    ],
)


def scratch_copy(dest: Path) -> None:
    """Copy akv, its tests and stress scripts to ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for name in ("akv", "tests", "stress"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def apply(mutant: Mutant, tree: Path) -> None:
    """Apply every patch of ``mutant`` to the copy at ``tree``.

    Raises:
        ValueError: A patch's old text is not found exactly once (the source moved on).
    """
    for rel, old, new in mutant.patches:
        path = tree / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise ValueError(f"{mutant.name}: {rel}: patch text found {text.count(old)} times")
        path.write_text(text.replace(old, new))


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}


def run_harness(tree: Path, extra: list[str], args: argparse.Namespace) -> dict:
    """One ``akv stress`` run on the copy at ``tree``; its exit code, failures and seconds."""
    report = tree / "report.json"
    report.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "akv.cli", "stress", "--no-progress", "--operations", str(args.operations),
        "--sequences", str(args.sequences), "--duration-s", "600", "--json", str(report), *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=args.timeout_s)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-400:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, "timed out"
    failures = json.loads(report.read_text())["failures"] if report.exists() else [tail]
    return {"args": extra, "exit_code": rc, "failures": failures, "seconds": round(time.perf_counter() - start, 1)}


def run_pytest(tree: Path, timeout_s: float, ignore: list[str]) -> dict:
    """The default suite (less ``ignore``d files) on the copy at ``tree``: exit code and pytest's last line."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests"]
    cmd += [f"--ignore={path}" for path in ignore]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout_s)
        rc, last = proc.returncode, (proc.stdout.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        rc, last = -1, "timed out"
    return {"exit_code": rc, "caught": rc != 0, "summary": last, "seconds": round(time.perf_counter() - start, 1)}


def try_mutant(mutant: Mutant | None, args: argparse.Namespace) -> dict:
    """Run the harness configurations (and optionally the suite) on a scratch copy with ``mutant``."""
    with tempfile.TemporaryDirectory(prefix="akv-mutant-") as tmp:
        tree = Path(tmp)
        scratch_copy(tree)
        if mutant is not None:
            apply(mutant, tree)
        runs = []
        for extra in RUNS:
            runs.append(run_harness(tree, extra, args))
            if runs[-1]["exit_code"] != 0 and mutant is not None:
                break
        out = {
            "name": mutant.name if mutant else "unpatched",
            "what": mutant.what if mutant else "",
            "caught_by_stress": any(r["exit_code"] != 0 for r in runs),
            "runs": runs,
        }
        if args.pytest and mutant is not None:
            out["pytest"] = run_pytest(tree, args.timeout_s * 4, args.pytest_ignore)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every chosen mutant; write the JSON; exit 1 if the unpatched copy fails (a false alarm)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--operations", type=int, default=400, help="programs per harness run (default 400)")
    parser.add_argument("--sequences", type=int, default=32, help="concurrent tasks per run (default 32)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="limit per harness run (default 300)")
    parser.add_argument("--pytest", action="store_true", help="also run the default test suite on each mutant")
    parser.add_argument(
        "--pytest-ignore",
        nargs="*",
        default=[],
        metavar="PATH",
        help="test files left out of the suite run (e.g. tests/test_stress.py, whose probes catch most mutants)",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "stress" / "results" / "mutants.json")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    baseline = try_mutant(None, args)
    print(f"unpatched: {'passes' if not baseline['caught_by_stress'] else 'FAILS'}", flush=True)
    results: list[dict] = []
    for mutant in chosen:
        res = try_mutant(mutant, args)
        results.append(res)
        suite = f", pytest {'caught' if res['pytest']['caught'] else 'missed'}" if "pytest" in res else ""
        verdict = "caught" if res["caught_by_stress"] else "NOT caught"
        print(f"{mutant.name}: stress {verdict}{suite}; {res['runs'][-1]['failures'][:2]}", flush=True)
        summary = _write(args, argv, baseline, results)  # after each mutant: a cut-off run keeps what it has
    print(f"stress caught {summary['caught_by_stress']} of {len(results)}; JSON in {args.json}")
    return 0 if summary["baseline_passes"] else 1


def _write(args: argparse.Namespace, argv: list[str] | None, baseline: dict, results: list[dict]) -> dict:
    summary = {
        "command": " ".join(["python", "stress/mutants.py", *(argv if argv is not None else sys.argv[1:])]),
        "operations": args.operations,
        "sequences": args.sequences,
        "baseline_passes": not baseline["caught_by_stress"],
        "caught_by_stress": sum(r["caught_by_stress"] for r in results),
        "caught_by_pytest": sum(r["pytest"]["caught"] for r in results if "pytest" in r) if args.pytest else None,
        "pytest_ignored": args.pytest_ignore,
        "mutants": len(results),
        "baseline": baseline,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
