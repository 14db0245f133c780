"""Micro-benchmarks: actor ask round trip, per-step decode cost, and the actors' share of a step.

Three measurements, all on this machine, one process:

(a) **ask round trip**: ``await actor.ask(msg)`` to an :class:`akv.actors.runtime.Actor`
    whose handler returns the message (echo), on asyncio, on uvloop (anyio
    backend option ``use_uvloop``) and on trio (when installed). p50/p99 in µs.
    Twice: as the manager asks (an idle actor serves on the asking task, the
    direct hand-off) and through the inbox and the actor's task
    (``Actor(direct=False)``, the queued path).
(b) **decode step through the manager**: ``KVCacheManager.step(commits=..., appends=...,
    want_metadata=True)`` in metadata mode (``storage="none"``) with ``B`` running
    sequences, each committing its previous token and appending one ``int`` token per
    step (what ``stress/akv_adapter.py``'s decode does). Prompt lengths are staggered
    (``prompt_len + i % block_size``), so in every step about ``B / block_size``
    sequences cross a block boundary (a new block, and a full block published to the
    prefix tree), as in steady continuous batching. p50/p99 µs per step and µs per
    sequence-token (total time / (steps × B)).
(c) **actor-free**: the same step sequence, built into the same
    :class:`~akv.core.step.StepRequest` objects the manager sends its shard, applied
    by :meth:`akv.core.shard_state.ShardState.step` called directly (the state owns
    its :class:`~akv.core.radix_tree.RadixTree`).
    The actor share of a step is ``1 - actor_free / manager`` (per-step medians); it
    covers everything the manager adds around the shard's work: input validation,
    the shard ask, spans, metrics, tensor wrapping. As a diagnostic, the manager
    path also times its actors' ``handle`` (found through private attributes;
    skipped if they move), splitting each manager step into the time inside the
    handler (the shard's work) and outside it. The block tables and slot mappings
    of both paths are compared, step by step.

Paths (b) and (c) run in lockstep inside one process: each step goes through the
manager and, right before or after it (alternating), through the actor-free
path, so background load on a shared machine hits both alike. ``--repeats``
such runs per batch size, steps pooled. The actor share is reported as the median
of the per-step paired shares (robust to load) and from the means.

    python3 stress/bench_micro.py                       # ~1 min, JSON to stress/results/bench_micro.json
    python3 stress/bench_micro.py --batches 1 64 --steps 100 --asks 2000 --repeats 1 --out /tmp/m.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from akv import Admit, KVCacheConfig, KVCacheManager, ModelShape
from akv.actors.runtime import Actor
from akv.core.shard_state import ShardState
from akv.core.step import StepRequest
from akv.obs import configure_logging

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "stress" / "results" / "bench_micro.json"
BACKENDS = ("asyncio", "uvloop", "trio")


def pct(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0-1) of ``values`` (peer_bench's definition)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_on(backend: str, fn: Any, *args: Any) -> Any:
    """``anyio.run(fn, *args)`` on ``asyncio``, ``uvloop`` (asyncio + uvloop) or ``trio``."""
    if backend == "uvloop":
        return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(fn, *args, backend=backend)


def available_backends() -> list[str]:
    """Backends importable here (asyncio always)."""
    out = ["asyncio"]
    for name in ("uvloop", "trio"):
        try:
            __import__(name)
        except ImportError:
            continue
        out.append(name)
    return out


# ----------------------------------------------------------------- (a) ask round trip


class EchoActor(Actor):
    """Replies with the message itself."""

    def handle(self, msg: Any) -> Any:
        return msg


async def _ask_loop(n: int, warmup: int, direct: bool = True) -> list[int]:
    actor = EchoActor("echo", inbox_capacity=16, direct=direct)
    pc = time.perf_counter_ns
    times: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await anyio.sleep(0)  # let the actor reach its wait
        for i in range(warmup + n):
            t = pc()
            await actor.ask(i)
            dt = pc() - t
            if i >= warmup:
                times.append(dt)
        actor.close()
    return times


def ask_round_trip(backend: str, n: int = 20000, warmup: int = 1000, direct: bool = True) -> dict[str, Any]:
    """p50/p99/mean µs of an echo ask on ``backend`` (``direct``: the hand-off to an idle actor, else queued)."""
    gc.collect()
    times = run_on(backend, _ask_loop, n, warmup, direct)
    return {
        "backend": backend,
        "path": "direct" if direct else "queued",
        "asks": n,
        "p50_us": pct(times, 0.5) / 1e3,
        "p99_us": pct(times, 0.99) / 1e3,
        "mean_us": statistics.fmean(times) / 1e3,
    }


# ----------------------------------------------------------------- (b)/(c) decode steps


@dataclass
class DecodePlan:
    """A deterministic decode workload: ``batch`` sequences, ``warmup + steps`` decode steps."""

    batch: int
    steps: int
    warmup: int
    block_size: int
    num_blocks: int
    vocab: int
    prompts: list[np.ndarray]
    #: Per decode step: (commits, appends) dicts, exactly what both paths receive.
    inputs: list[tuple[dict[int, int], dict[int, int]]] = field(default_factory=list)


def make_plan(
    batch: int,
    steps: int,
    *,
    warmup: int = 5,
    prompt_len: int = 64,
    block_size: int = 16,
    vocab: int = 32000,
    seed: int = 0,
) -> DecodePlan:
    """Unique prompts of ``prompt_len + i % block_size`` tokens, then ``warmup + steps`` one-token decode steps."""
    rng = random.Random(seed)
    prompts = [
        np.array([rng.randrange(vocab) for _ in range(prompt_len + i % block_size)], dtype=np.int32)
        for i in range(batch)
    ]
    total = warmup + steps
    longest = prompt_len + block_size - 1 + total + 1
    num_blocks = batch * -(-longest // block_size) + 16
    plan = DecodePlan(batch, steps, warmup, block_size, num_blocks, vocab, prompts)
    for k in range(total):
        commits = {i: 1 for i in range(batch)} if k else {}
        appends = {i: rng.randrange(vocab) for i in range(batch)}
        plan.inputs.append((commits, appends))
    return plan


def _admits(plan: DecodePlan) -> list[Admit]:
    return [Admit(seq_id=i, prompt=p, prefill_done=True) for i, p in enumerate(plan.prompts)]


def _config(plan: DecodePlan) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=plan.num_blocks,
        block_size=plan.block_size,
        model=ModelShape(name="bench-micro", num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16"),
        storage="none",
        vocab_size=plan.vocab,
    )


@dataclass
class PathRun:
    """Per-step nanoseconds of the timed decode steps, plus (optionally) the metadata of every step."""

    step_ns: list[int]
    tables: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    #: Manager path: time spent inside the actors' message handlers in each timed step (ns);
    #: empty where the manager's actors cannot be found (private attributes, diagnostic only).
    handler_ns: list[int] = field(default_factory=list)
    #: Manager path: actor messages handled per timed step (shard asks, plus tree asks where a tree actor exists).
    asks_per_step: float | None = None


class _ActorFree:
    """The actor-free path: one ``ShardState`` (with its own tree), configured as the manager's shard."""

    def __init__(self, plan: DecodePlan) -> None:
        cfg = _config(plan)
        (block_ids,) = cfg.shard_ranges()
        self.state = ShardState(0, block_ids, plan.block_size, enable_prefix_cache=cfg.enable_prefix_cache)

    def step(self, req: StepRequest):
        out = self.state.step(req)
        if out.rejected:
            raise next(iter(out.rejected.values()))
        return out


def _requests(plan: DecodePlan) -> list[StepRequest]:
    """The StepRequests the manager builds from the plan's inputs (built ahead, outside the timing)."""
    return [StepRequest(commits=c, appends=a, want_metadata=True) for c, a in plan.inputs]


async def _manager_run(plan: DecodePlan, record: bool, paired: bool) -> tuple[PathRun, PathRun | None]:
    pc = time.perf_counter_ns
    run = PathRun([])
    free_run = PathRun([]) if paired else None
    free = _ActorFree(plan) if paired else None
    requests = _requests(plan) if paired else []
    async with KVCacheManager(_config(plan)) as kv:
        res = await kv.step(admits=_admits(plan), want_metadata=True)
        if res.rejected:
            raise next(iter(res.rejected.values()))
        if record:
            run.tables.append((res.block_tables.numpy().copy(), res.slot_mapping.numpy().copy()))
        if free is not None:
            out = free.step(StepRequest(admits=_admits(plan), want_metadata=True))
            if record:
                free_run.tables.append((out.block_tables.copy(), out.slot_mapping.copy()))
        actors = _instrument_actors(kv)
        in_handlers = [0]
        for actor in actors:
            actor.handle = _timed_handler(actor.handle, in_handlers)
        gc.collect()
        asks0 = 0
        for k, (commits, appends) in enumerate(plan.inputs):
            if k == plan.warmup:
                asks0 = sum(a.messages_handled for a in actors)
            in_handlers[0] = 0
            # Paired: the actor-free step runs right before (odd k) or after (even k) the manager's.
            if free is not None and k % 2:
                t = pc()
                out = free.step(requests[k])
                dt_free = pc() - t
            t = pc()
            res = await kv.step(commits=commits, appends=appends, want_metadata=True)
            dt = pc() - t
            if free is not None and not k % 2:
                t = pc()
                out = free.step(requests[k])
                dt_free = pc() - t
            if res.rejected:
                raise next(iter(res.rejected.values()))
            if k >= plan.warmup:
                run.step_ns.append(dt)
                if actors:
                    run.handler_ns.append(in_handlers[0])
                if free is not None:
                    free_run.step_ns.append(dt_free)
            if record:
                run.tables.append((res.block_tables.numpy().copy(), res.slot_mapping.numpy().copy()))
                if free is not None:
                    free_run.tables.append((out.block_tables.copy(), out.slot_mapping.copy()))
        if actors:
            run.asks_per_step = (sum(a.messages_handled for a in actors) - asks0) / plan.steps
    return run, free_run


def _instrument_actors(kv: KVCacheManager) -> list[Actor]:
    """The manager's shard (and tree, if any) actors, found through private attributes; [] if the layout changed."""
    found = [*getattr(kv, "_shards", []), *([kv._tree] if getattr(kv, "_tree", None) is not None else [])]
    return [a for a in found if isinstance(a, Actor)]


def _timed_handler(handle: Any, acc: list[int]) -> Any:
    """Wrap an actor's bound ``handle`` so that the time spent in it adds to ``acc[0]``."""
    pc = time.perf_counter_ns

    def timed(msg: Any) -> Any:
        t = pc()
        try:
            return handle(msg)
        finally:
            acc[0] += pc() - t

    return timed


def manager_run(plan: DecodePlan, record: bool = False, backend: str = "asyncio") -> PathRun:
    """The plan through ``KVCacheManager.step`` (actors running) on ``backend``."""
    return run_on(backend, _manager_run, plan, record, False)[0]


def paired_run(plan: DecodePlan, record: bool = False, backend: str = "asyncio") -> tuple[PathRun, PathRun]:
    """Both paths in lockstep: every step through the manager and, right next to it, through the actor-free path.

    The order alternates per step, so load on a shared machine hits both
    paths alike and the per-step times can be compared pair by pair.
    """
    return run_on(backend, _manager_run, plan, record, True)


def actor_free_run(plan: DecodePlan, record: bool = False) -> PathRun:
    """The plan through ``ShardState.step``, called directly."""
    free = _ActorFree(plan)
    out = free.step(StepRequest(admits=_admits(plan), want_metadata=True))
    run = PathRun([])
    if record:
        run.tables.append((out.block_tables.copy(), out.slot_mapping.copy()))
    requests = _requests(plan)
    pc = time.perf_counter_ns
    gc.collect()
    for k, req in enumerate(requests):
        t = pc()
        out = free.step(req)
        dt = pc() - t
        if k >= plan.warmup:
            run.step_ns.append(dt)
        if record:
            run.tables.append((out.block_tables.copy(), out.slot_mapping.copy()))
    return run


def same_metadata(a: PathRun, b: PathRun) -> bool:
    """Whether two recorded runs produced identical block tables and slot mappings at every step."""
    if len(a.tables) != len(b.tables) or not a.tables:
        return False
    return all(np.array_equal(ta, tb) and np.array_equal(sa, sb) for (ta, sa), (tb, sb) in zip(a.tables, b.tables))


def _summary(step_ns: list[int], batch: int) -> dict[str, float]:
    return {
        "p50_us": pct(step_ns, 0.5) / 1e3,
        "p99_us": pct(step_ns, 0.99) / 1e3,
        "us_per_seq_tok": sum(step_ns) / len(step_ns) / batch / 1e3,
        "p50_us_per_seq_tok": pct(step_ns, 0.5) / batch / 1e3,
    }


def bench_batch(
    batch: int, steps: int, *, repeats: int = 3, backend: str = "asyncio", ask_p50_us: float | None = None
) -> dict:
    """(b) and (c) at one batch size: ``repeats`` paired runs (:func:`paired_run`), steps pooled.

    Every run records the metadata of both paths and compares them
    (``same_metadata``). The actor share is reported three ways: from the
    per-step medians (``actor_share_p50``), from the means
    (``actor_share_mean``) and as the median over steps of the paired
    per-step share ``1 - actor_free_k / manager_k`` (``actor_share_paired``,
    the most robust to background load).
    """
    plan = make_plan(batch, steps)
    mgr_ns: list[int] = []
    free_ns: list[int] = []
    handler_ns: list[int] = []
    same, asks = True, None
    for _ in range(repeats):
        m, f = paired_run(plan, record=True, backend=backend)
        same = same and same_metadata(m, f)
        mgr_ns += m.step_ns
        free_ns += f.step_ns
        handler_ns += m.handler_ns
        asks = m.asks_per_step
    mgr, free = _summary(mgr_ns, batch), _summary(free_ns, batch)
    row = {
        "batch": batch,
        "steps": steps,
        "repeats": repeats,
        "manager": mgr,
        "actor_free": free,
        "actor_share_p50": 1 - free["p50_us"] / mgr["p50_us"],
        "actor_share_mean": 1 - free["us_per_seq_tok"] / mgr["us_per_seq_tok"],
        "actor_share_paired": statistics.median(1 - fk / mk for mk, fk in zip(mgr_ns, free_ns)),
        "asks_per_step": asks,
        "same_metadata": same,
    }
    if handler_ns:
        # Where the manager's extra time goes: inside the actor's handler (the shard's work) or outside it
        # (facade: validation, request and result building, spans, metrics; plus the ask hops).
        row["manager_in_handler_p50_us"] = pct(handler_ns, 0.5) / 1e3
        row["manager_outside_handler_p50_us"] = pct([m - h for m, h in zip(mgr_ns, handler_ns)], 0.5) / 1e3
    if ask_p50_us is not None:
        row["ask_fraction_of_step"] = ask_p50_us * (asks or 1) / mgr["p50_us"]
    return row


def steps_for(batch: int, budget: int) -> int:
    """Timed steps for ``batch``: about ``budget`` sequence-tokens, between 100 and 1000 steps."""
    return max(100, min(1000, budget // batch))


def akv_provenance() -> dict[str, Any]:
    """Where the imported akv comes from: its path, and the git commit of the tree it lives in."""
    import subprocess

    import akv

    src = Path(akv.__file__).resolve().parent
    out: dict[str, Any] = {"akv_path": str(src)}
    try:
        git = ["git", "-C", str(src.parent)]
        out["git_commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", str(src)], capture_output=True, text=True, check=True
        ).stdout
        out["akv_uncommitted_changes"] = bool(dirty.strip())
    except (OSError, subprocess.CalledProcessError):  # e.g. a `git archive` snapshot on PYTHONPATH
        out["git_commit"] = os.environ.get("AKV_GIT_COMMIT")
    return out


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "uname": " ".join(platform.uname()).strip()}
    for dist in ("akv", "anyio", "uvloop", "trio", "numpy", "torch"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    out.update(akv_provenance())
    return out


def run(args: argparse.Namespace) -> dict:
    """All measurements; returns the JSON document."""
    load0 = list(os.getloadavg())
    backends = [b for b in args.backends if b in available_backends()]
    asks, queued = [], []
    for b in backends:
        asks.append(ask_round_trip(b, args.asks))
        queued.append(ask_round_trip(b, args.asks, direct=False))
        print(
            f"ask {b}: p50 {asks[-1]['p50_us']:.1f} µs, p99 {asks[-1]['p99_us']:.1f} µs "
            f"(queued: p50 {queued[-1]['p50_us']:.1f} µs, p99 {queued[-1]['p99_us']:.1f} µs)",
            flush=True,
        )
    ask_p50 = next((a["p50_us"] for a in asks if a["backend"] == args.step_backend), None)
    rows = []
    for batch in args.batches:
        steps = args.steps or steps_for(batch, args.seq_tokens)
        row = bench_batch(batch, steps, repeats=args.repeats, backend=args.step_backend, ask_p50_us=ask_p50)
        rows.append(row)
        m, f = row["manager"], row["actor_free"]
        print(
            f"B={batch}: manager p50 {m['p50_us']:.0f} p99 {m['p99_us']:.0f} µs ({m['us_per_seq_tok']:.2f} µs/seq·tok), "
            f"actor-free p50 {f['p50_us']:.0f} p99 {f['p99_us']:.0f} µs ({f['us_per_seq_tok']:.2f}); "
            f"actor share {row['actor_share_paired']:.0%} (paired), same metadata: {row['same_metadata']}",
            flush=True,
        )
    return {
        "command": "python3 stress/bench_micro.py " + " ".join(sys.argv[1:]),
        "versions": versions(),
        "cpu_count": os.cpu_count(),
        "loadavg_before": load0,
        "loadavg_after": list(os.getloadavg()),
        "step_backend": args.step_backend,
        "ask_round_trip": asks,
        "ask_round_trip_queued": queued,
        "decode_steps": rows,
    }


def table(doc: dict) -> str:
    """Markdown tables of a result document."""
    lines = ["| backend | path | ask p50 µs | ask p99 µs | mean µs |", "|---|---|---|---|---|"]
    for a in [*doc["ask_round_trip"], *doc.get("ask_round_trip_queued", [])]:
        path = a.get("path", "queued")  # documents from before the direct hand-off: every ask was queued
        lines.append(f"| {a['backend']} | {path} | {a['p50_us']:.1f} | {a['p99_us']:.1f} | {a['mean_us']:.1f} |")
    lines += [
        "",
        "| B | steps | manager p50 µs | manager p99 µs | manager µs/seq·tok | actor-free p50 µs | actor-free p99 µs "
        "| actor-free µs/seq·tok | actor share (paired) | actor share (mean) | in handler p50 µs | outside handler p50 µs "
        "| asks/step | ask share | same metadata |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["decode_steps"]:
        m, f = r["manager"], r["actor_free"]
        asks = "" if r.get("asks_per_step") is None else f"{r['asks_per_step']:.2f}"
        inside = f"{r['manager_in_handler_p50_us']:.0f}" if "manager_in_handler_p50_us" in r else ""
        outside = f"{r['manager_outside_handler_p50_us']:.0f}" if "manager_outside_handler_p50_us" in r else ""
        ask_share = f"{r['ask_fraction_of_step']:.1%}" if "ask_fraction_of_step" in r else ""
        lines.append(
            f"| {r['batch']} | {r['steps']} | {m['p50_us']:.0f} | {m['p99_us']:.0f} | {m['us_per_seq_tok']:.2f} "
            f"| {f['p50_us']:.0f} | {f['p99_us']:.0f} | {f['us_per_seq_tok']:.2f} | {r['actor_share_paired']:.0%} | {r['actor_share_mean']:.0%} "
            f"| {inside} | {outside} | {asks} | {ask_share} | {r['same_metadata']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 1024], help="decode batch sizes")
    p.add_argument("--steps", type=int, default=0, help="timed steps per run (default: by batch, see --seq-tokens)")
    p.add_argument("--seq-tokens", type=int, default=51200, help="sequence-tokens per run when --steps is 0")
    p.add_argument("--repeats", type=int, default=3, help="alternating manager/actor-free runs per batch size")
    p.add_argument("--asks", type=int, default=20000, help="timed asks per backend")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS, help="ask backends")
    p.add_argument("--step-backend", default="asyncio", choices=BACKENDS, help="event loop of the manager path")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output file ('' for none)")
    args = p.parse_args(argv)
    configure_logging(level="warning")
    doc = run(args)
    print()
    print(table(doc))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0 if all(r["same_metadata"] for r in doc["decode_steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
