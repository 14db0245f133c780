"""Trace mode for the peer comparison: one Mooncake trace replay through akv, vLLM and SGLang.

Issue 5. The same first N requests of a Mooncake trace (block size 16, the same usable block
count for every manager) run through the real KV cache managers of vLLM v1
(``KVCacheManager``) and SGLang (``RadixCache``), driven by the adapters of
``../shared/peers/peer_bench.py``, and through akv (``stress/akv_adapter.py``, one run per
eviction policy). An offline simulator (``stress/bench_eviction.py``) replays the same
schedule with Belady's MIN (the hit-rate reference ceiling), with an LRU model of akv (a check
of the simulator against the real run) and with no eviction at all (the unbounded ceiling).

Commands (from the project root; each writes one JSON file under stress/results/)::

    # 1. schedule, pool sizes, simulators (Belady, LRU model, unbounded) + size sweep; ~1 min
    python stress/peer_trace.py sim --trace conversation
    python stress/peer_trace.py sim --trace synthetic
    # 2. the real managers, one pool size per command (each well under 5 min here)
    .peers-venv/bin/python stress/peer_trace.py run --trace conversation --size tight --managers vllm,sglang
    .peers-venv/bin/python stress/peer_trace.py run --trace conversation --size tight --managers akv:lru,akv:lfu
    ...  (the same for --size medium / roomy, and --trace synthetic --size medium)
    # 3. merge into stress/results/peer_trace.json (+ peer_trace_synthetic.json) and draw
    #    docs/hit_rate.png and docs/trace_step_latency.png
    python stress/peer_trace.py report

``--managers`` takes ``vllm``, ``sglang`` and ``akv:<policy>`` (``akv`` alone is
``akv:lru``); ``akv:all`` runs every name in ``akv.core.eviction_policy.EVICTION_POLICIES``
(only ``lru`` where that registry does not exist yet).

Schedule (identical for every manager; decided here, before any manager runs): requests in
trace order, all waiting from the start (arrival times are ignored: a saturated server), FCFS
continuous batching as in peer_bench: each step (1) decodes one token for every running
sequence, (2) admits waiting requests while fewer than ``--batch`` run and the step's prefill
budget (``--prefill-budget`` prompt tokens; the first request of a step always fits) is not
spent, and (3) frees the sequences that did their decode steps. No manager here preempts, so a
request is admitted only when the blocks reserved for every running sequence's full length
(prompt + output) plus its own fit the pool; a request larger than the pool is skipped and
counted. Output lengths are capped at ``--output-cap`` tokens (decode steps =
min(output_length, cap) - 1). Hit rate = prompt tokens served from the cache at admission /
prompt tokens admitted, whole blocks only, at most ``len(prompt) - 1`` tokens (as the peers
count).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "stress" / "results"
DOCS = ROOT / "docs"
PEER_BENCH = ROOT.parent / "shared" / "peers" / "peer_bench.py"
TRACES = {
    "conversation": ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl",
    "synthetic": ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl",
}
BLOCK = 16
VOCAB = 32_000

#: Per trace: requests replayed, batch cap, prefill budget, output cap, and the three pool
#: sizes in blocks (how they were chosen: docs/_draft_trace.md and ``sim``'s sweep).
PRESETS: dict[str, dict[str, Any]] = {
    "conversation": dict(limit=2000, batch=32, prefill_budget=16384, output_cap=256, sizes={}),
    "synthetic": dict(limit=1000, batch=32, prefill_budget=16384, output_cap=256, sizes={}),
}


def _load(name: str, path: Path):
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


def bench_eviction():
    """``stress/bench_eviction.py`` as a module (the offline simulators)."""
    return _load("bench_eviction", ROOT / "stress" / "bench_eviction.py")


# --------------------------------------------------------------------------- schedule (pure)


@dataclass(frozen=True, slots=True)
class Req:
    """One trace request as the schedule sees it."""

    rid: int
    input_length: int
    decode_steps: int
    hash_ids: tuple[int, ...]


def make_reqs(records, output_cap: int) -> list[Req]:
    """Trace records (``.input_length``, ``.output_length``, ``.hash_ids``) to schedule requests:
    decode steps = min(output_length, output_cap) - 1, at least 1."""
    return [
        Req(i, r.input_length, max(1, min(r.output_length, output_cap) - 1), tuple(r.hash_ids))
        for i, r in enumerate(records)
    ]


def reserve_blocks(req: Req, block_size: int = BLOCK) -> int:
    """Blocks a request holds at its largest: prompt plus every decoded token's KV."""
    return -(-(req.input_length + req.decode_steps) // block_size)


def build_schedule(reqs: list[Req], pool: int | None, batch: int, prefill_budget: int, block_size: int = BLOCK) -> dict:
    """FCFS continuous batching with full-length reservation (see the module docstring).

    Returns:
        ``steps``: per step ``(admitted rids, finished rids)``, in the order the driver runs
        them (decode all running, admit, finish); ``skipped``: rids larger than the pool;
        ``peak_reserved``: the most blocks reserved at once; ``peak_running``; ``pool_limited``:
        steps whose admission stopped on the pool (not on the batch cap or budget).
    """
    need = [reserve_blocks(r, block_size) for r in reqs]
    waiting = list(range(len(reqs)))
    waiting.reverse()
    running: list[int] = []
    decoded: dict[int, int] = {}
    reserved = 0
    steps: list[tuple[list[int], list[int]]] = []
    skipped: list[int] = []
    peak_reserved = peak_running = pool_limited = 0
    while waiting or running:
        for r in running:
            decoded[r] += 1
        new: list[int] = []
        spent = 0
        while waiting and len(running) + len(new) < batch:
            r = waiting[-1]
            if pool is not None and need[r] > pool:
                skipped.append(waiting.pop())
                continue
            if prefill_budget and new and spent + reqs[r].input_length > prefill_budget:
                break
            if pool is not None and reserved + need[r] > pool:
                pool_limited += 1
                break
            spent += reqs[r].input_length
            reserved += need[r]
            new.append(waiting.pop())
        peak_reserved = max(peak_reserved, reserved)
        peak_running = max(peak_running, len(running) + len(new))
        done = [r for r in running if decoded[r] >= reqs[r].decode_steps]
        for r in done:
            reserved -= need[r]
            del decoded[r]
        running = [r for r in running if r in decoded]
        for r in new:
            decoded[r] = 0
        running.extend(new)
        if not new and not done and not running and waiting:
            raise RuntimeError("schedule stalled")
        steps.append((new, done))
    return {
        "steps": steps,
        "skipped": skipped,
        "peak_reserved": peak_reserved,
        "peak_running": peak_running,
        "pool_limited": pool_limited,
    }


def schedule_events(reqs: list[Req], steps, block_size: int = BLOCK):
    """The event stream of a schedule, for :func:`bench_eviction.simulate`.

    Per step: a ``("G", r, 1)`` for every running sequence whose decode starts a new block
    (decode k writes the KV of position ``input_length + k - 1``), then the admissions
    ``("A", r)``, then the finishes ``("F", r)``, each phase closed by ``("S",)``.
    """
    running: list[int] = []
    decoded: dict[int, int] = {}
    for admits, finishes in steps:
        for r in running:
            if (reqs[r].input_length + decoded[r]) % block_size == 0:
                yield ("G", r, 1)
            decoded[r] += 1
        yield ("S",)
        for r in admits:
            yield ("A", r)
        yield ("S",)
        for r in finishes:
            yield ("F", r)
            del decoded[r]
        yield ("S",)
        running = [r for r in running if r in decoded]
        for r in admits:
            decoded[r] = 0
        running.extend(admits)


def sim_inputs(reqs: list[Req], block_size: int = BLOCK):
    """``blocks, caps, out_cached, tail_private`` for :func:`bench_eviction.simulate`.

    ``out_cached``: full output blocks an engine publishes (akv commits all but the last
    appended token: ``(input + decode - 1) // bs - input // bs``).
    """
    be = bench_eviction()
    if block_size != be.BLOCK:
        raise ValueError(f"the simulator's block ids assume block size {be.BLOCK}")
    blocks, caps, _ = be.block_ids(reqs)
    out_cached = [(r.input_length + r.decode_steps - 1) // block_size - r.input_length // block_size for r in reqs]
    tail = [r.input_length % block_size != 0 for r in reqs]
    return blocks, caps, out_cached, tail


def sim_hit_rate(reqs, steps, capacity, policy, watermarks=None, inputs=None) -> dict:
    """Run one simulator over a schedule; hit rate counted like the managers'."""
    be = bench_eviction()
    blocks, caps, out_cached, tail = inputs or sim_inputs(reqs)
    res = be.simulate(schedule_events(reqs, steps), blocks, caps, out_cached, capacity, policy, watermarks, tail)
    admitted = res["admitted"]
    prompt = sum(reqs[r].input_length for r in admitted)
    hit = sum(res["hits"].values()) * BLOCK
    return {
        "hit_rate": hit / max(prompt, 1),
        "cached_tokens": hit,
        "prompt_tokens": prompt,
        "evicted_blocks": res["evicted"],
        "peak_held_blocks": res["peak_held"],
        "per_request_cached": [res["hits"][r] * BLOCK for r in admitted],
    }


# --------------------------------------------------------------------------- trace setup


def trace_setup(trace: str, limit: int | None = None) -> dict:
    """Requests, preset and the pool-independent schedule of one trace."""
    from akv.trace import read_trace

    preset = dict(PRESETS[trace])
    if limit is not None:
        preset["limit"] = limit
    records = read_trace(TRACES[trace], limit=preset["limit"])
    reqs = make_reqs(records, preset["output_cap"])
    free = build_schedule(reqs, None, preset["batch"], preset["prefill_budget"])
    return {"trace": trace, "preset": preset, "reqs": reqs, "free_schedule": free}


def pool_sizes(setup: dict) -> dict[str, int]:
    """tight / medium / roomy in blocks: tight is the peak reservation of the schedule with an
    unlimited pool rounded up to a multiple of 1024 (so the batch is never pool-limited and the
    schedule is the same at every size); medium = 4x, roomy = 16x tight."""
    peak = setup["free_schedule"]["peak_reserved"]
    tight = -(-peak // 1024) * 1024
    return {"tight": tight, "medium": 4 * tight, "roomy": 16 * tight}


def schedule_for(setup: dict, pool: int) -> dict:
    p = setup["preset"]
    return build_schedule(setup["reqs"], pool, p["batch"], p["prefill_budget"])


def machine() -> dict:
    from importlib import metadata

    out = {
        "uname": " ".join((*platform.uname()[:3], platform.uname().machine)),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    for dist in ("numpy", "torch", "vllm", "sglang", "akv"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def _quantiles(values: list[int]) -> dict:
    """Per-step latencies (ns) summarized in µs: 0..100 percentiles, p99.9, mean."""
    if not values:
        return {}
    s = sorted(values)
    n = len(s)

    def q(x: float) -> float:
        k = (n - 1) * x
        lo, hi = int(k), min(int(k) + 1, n - 1)
        return (s[lo] + (s[hi] - s[lo]) * (k - lo)) / 1e3

    return {
        "percentiles_us": [round(q(i / 100), 2) for i in range(101)],
        "p50_us": round(q(0.5), 2),
        "p90_us": round(q(0.9), 2),
        "p99_us": round(q(0.99), 2),
        "p999_us": round(q(0.999), 2),
        "max_us": round(s[-1] / 1e3, 2),
        "mean_us": round(sum(s) / n / 1e3, 2),
    }


def _cmd(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    exe = ".peers-venv/bin/python" if args and args[0] == "run" else "python"
    return " ".join([exe, "stress/peer_trace.py", *args])


# --------------------------------------------------------------------------- sim


def akv_watermarks(capacity: int) -> tuple[float, float]:
    """akv's default eviction-loop watermarks for a one-shard pool, as the simulator's free fractions."""
    from akv.config import KVCacheConfig

    low, high = KVCacheConfig(num_blocks=capacity, storage="none").watermark_blocks(capacity)
    return low / capacity, high / capacity


def cmd_sim(a, argv) -> int:
    t_start = time.perf_counter()
    setup = trace_setup(a.trace, a.limit)
    reqs = setup["reqs"]
    sizes = pool_sizes(setup)
    inputs = sim_inputs(reqs)
    free = setup["free_schedule"]
    n_prompt = sum(r.input_length for r in reqs)
    print(
        f"{a.trace}: {len(reqs)} requests, {n_prompt:,} prompt tokens, {len(free['steps'])} steps, "
        f"peak reserved {free['peak_reserved']:,} blocks, sizes {sizes}",
        flush=True,
    )
    unb = sim_hit_rate(reqs, free["steps"], None, "lru", inputs=inputs)
    rows = {}
    for name, cap in sizes.items():
        sch = schedule_for(setup, cap)
        assert sch["steps"] == free["steps"], "tight must be >= the peak reservation"
        row = {"blocks": cap, "skipped": len(sch["skipped"]), "steps": len(sch["steps"])}
        for label, policy, wm in (
            ("belady", "belady", None),
            ("lru_model", "lru", None),
            ("lru_model_watermarks", "lru", akv_watermarks(cap)),
        ):
            t = time.perf_counter()
            r = sim_hit_rate(reqs, sch["steps"], cap, policy, wm, inputs=inputs)
            r["seconds"] = round(time.perf_counter() - t, 1)
            row[label] = r
        rows[name] = row
        print(
            f"  {name:<7}{cap:>9,}  Belady {row['belady']['hit_rate']:.4f}  LRU model "
            f"{row['lru_model']['hit_rate']:.4f}  (+akv watermarks {row['lru_model_watermarks']['hit_rate']:.4f})",
            flush=True,
        )
    sweep = []
    tight = sizes["tight"]
    for mult in a.sweep:
        cap = int(tight * mult)
        known = next((rows[k] for k, v in sizes.items() if v == cap), None)
        if known is not None:
            lru, bel = known["lru_model"]["hit_rate"], known["belady"]["hit_rate"]
        else:
            lru = sim_hit_rate(reqs, free["steps"], cap, "lru", inputs=inputs)["hit_rate"]
            bel = sim_hit_rate(reqs, free["steps"], cap, "belady", inputs=inputs)["hit_rate"]
        sweep.append({"blocks": cap, "lru_model": lru, "belady": bel})
        print(f"  sweep {cap:>9,}  LRU {lru:.4f}  Belady {bel:.4f}", flush=True)
    out = {
        "kind": "peer_trace_sim",
        "command": _cmd(argv),
        "trace": str(TRACES[a.trace]),
        "preset": setup["preset"],
        "requests": len(reqs),
        "prompt_tokens": n_prompt,
        "steps": len(free["steps"]),
        "peak_reserved_blocks": free["peak_reserved"],
        "peak_running": free["peak_running"],
        "sizes": sizes,
        "unbounded": {k: v for k, v in unb.items() if k != "per_request_cached"},
        "by_size": rows,
        "sweep": sweep,
        "machine": machine(),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    path = Path(a.out or RESULTS / f"peer_trace_sim_{a.trace}.json")
    path.write_text(json.dumps(out) + "\n")
    print(f"unbounded {unb['hit_rate']:.4f}; wrote {path} ({out['seconds']} s)")
    return 0


# --------------------------------------------------------------------------- run (peers venv)


def _policies() -> list[str]:
    try:
        from akv.core.eviction_policy import EVICTION_POLICIES
    except ImportError:
        return ["lru"]
    return list(EVICTION_POLICIES)


def _factories(specs: list[str], pb) -> list[tuple[str, Any]]:
    out = []
    for spec in specs:
        if spec == "vllm":
            out.append(("vllm", pb.VllmAdapter))
        elif spec == "sglang":
            out.append(("sglang", pb.SglangAdapter))
        elif spec == "akv" or spec.startswith("akv:"):
            mod = _load("akv_adapter", ROOT / "stress" / "akv_adapter.py")
            policy = spec.partition(":")[2] or "lru"
            for p in _policies() if policy == "all" else [policy]:
                out.append((f"akv:{p}", lambda w, p=p, mod=mod: mod.make(w, eviction_policy=p)))
        else:
            raise SystemExit(f"unknown manager {spec!r}: vllm, sglang, akv[:policy|:all]")
    return out


async def _drive(pb, adapter, reqs: list[Req], steps) -> dict:
    """Run one schedule through one adapter (peer_bench's ``_drive``, schedule given)."""
    import numpy as np

    from akv.trace import synthesize_output, synthesize_prompt

    maybe, noop = pb._maybe, pb._noop
    step_begin = getattr(adapter, "step_begin", noop)
    await maybe(getattr(adapter, "start", noop)())
    running: list = []
    step_ns: list[int] = []
    admit_ns: list[int] = []
    cached: dict[int, int] = {}
    peak = 0
    pc = time.perf_counter_ns
    gc.collect()
    wall0 = pc()
    for admits, finishes in steps:
        t0 = pc()
        r = step_begin()
        if r is not None:
            await maybe(r)
        t1 = pc()
        ta = tb = 0
        if running:
            toks = [s.out_tokens[s.decoded + 1] for s in running]
            ta = pc()
            r = adapter.decode(running, toks)
            if r is not None:
                await maybe(r)
            tb = pc()
            for s in running:
                s.decoded += 1
        new = []
        for rid in admits:  # token synthesis: not timed
            q = reqs[rid]
            prompt = synthesize_prompt(np.asarray(q.hash_ids, dtype=np.int64), q.input_length, vocab_size=VOCAB)
            out = synthesize_output(rid, q.decode_steps + 1, vocab_size=VOCAB)
            new.append(pb.Seq(rid, prompt.tolist(), out.tolist()))
        tc = td = 0
        if new:
            tc = pc()
            hits = adapter.admit(new)
            if not isinstance(hits, list):
                hits = await maybe(hits)
            td = pc()
            admit_ns.append(td - tc)
            for s, h in zip(new, hits):
                if h % BLOCK or h > len(s.prompt) - 1:
                    raise AssertionError(f"{adapter.name}: request {s.rid} reported {h} cached tokens")
                cached[s.rid] = h
        peak = max(peak, await maybe(adapter.active_blocks()))
        te = tf = 0
        if finishes:
            fin = set(finishes)
            done = [s for s in running if s.rid in fin]
            if any(s.decoded < reqs[s.rid].decode_steps for s in done) or len(done) != len(fin):
                raise AssertionError("driver and schedule disagree")
            te = pc()
            r = adapter.finish(done)
            if r is not None:
                await maybe(r)
            tf = pc()
            running = [s for s in running if s.rid not in fin]
            for s in done:
                s.prompt = s.out_tokens = None
        running.extend(new)
        step_ns.append((t1 - t0) + (tb - ta) + (td - tc) + (tf - te))
    wall = pc() - wall0
    idle = await maybe(adapter.idle_check())
    await maybe(getattr(adapter, "close", noop)())
    order = [rid for admits, _ in steps for rid in admits]
    prompt_tokens = sum(reqs[rid].input_length for rid in order)
    hit = sum(cached.values())
    return {
        "hit_rate": hit / max(prompt_tokens, 1),
        "cached_tokens": hit,
        "prompt_tokens": prompt_tokens,
        "admitted": len(order),
        "steps": len(step_ns),
        "wall_s": round(wall / 1e9, 3),
        "mgr_s": round(sum(step_ns) / 1e9, 3),
        "step_latency": _quantiles(step_ns),
        "admit_call_latency": _quantiles(admit_ns),
        "peak_active_blocks": peak,
        "idle_check": idle,
        "per_request_cached": [cached[rid] for rid in order],
    }


def _run_one(pb, factory, w, reqs, steps) -> dict:
    adapter = factory(w)
    coro = _drive(pb, adapter, reqs, steps)
    if not pb._is_async(adapter):
        try:
            coro.send(None)
        except StopIteration as stop:
            res = stop.value
        else:
            coro.close()
            raise RuntimeError(f"{adapter!r} suspended without an event loop")
    else:
        import asyncio

        res = asyncio.run(pb._await(coro))
    res["level"] = getattr(adapter, "level", "")
    return res


def cmd_run(a, argv) -> int:
    import logging
    import warnings

    from bench_peers import one_torch_thread  # stress/ is on sys.path: scripts run from there

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    torch_threads = one_torch_thread()
    print(f"torch threads: {torch_threads} for every manager (OMP_NUM_THREADS=1, torch.set_num_threads(1))")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    from akv.obs import configure_logging

    configure_logging(level="warning")
    pb = _load("peer_bench", PEER_BENCH)
    setup = trace_setup(a.trace, a.limit)
    reqs = setup["reqs"]
    sizes = pool_sizes(setup)
    pool = sizes[a.size] if a.size in sizes else int(a.size)
    sch = schedule_for(setup, pool)
    p = setup["preset"]
    admitted = [reqs[r] for adm, _ in sch["steps"] for r in adm]

    def workload(n_blocks_usable: int, subset: list[Req]):
        return pb.Workload(
            block_size=BLOCK,
            num_blocks=n_blocks_usable + 1,  # vLLM's block 0 is its null block
            num_requests=len(subset),
            batch=p["batch"],
            num_system_prompts=1,
            system_len=max(q.input_length for q in subset),
            unique_len=0,
            decode_steps=max(q.decode_steps for q in subset),
            prefill_budget=p["prefill_budget"],
            vocab=VOCAB,
        )

    w = workload(pool, admitted)
    factories = _factories(a.managers.split(","), pb)
    # Untimed warm-up on a small schedule (imports, first-call costs), then freeze the heap.
    warm_reqs = reqs[:16]
    warm_pool = sum(reserve_blocks(q) for q in warm_reqs)
    warm_sched = build_schedule(warm_reqs, warm_pool, 8, p["prefill_budget"])
    ww = workload(warm_pool, warm_reqs)
    for _, f in factories:
        _run_one(pb, f, ww, warm_reqs, warm_sched["steps"])
    gc.collect()
    gc.freeze()
    results = {}
    for label, f in factories:
        res = _run_one(pb, f, w, reqs, sch["steps"])
        results[label] = res
        lat = res["step_latency"]
        print(
            f"{a.trace} {a.size} ({pool:,} blocks) {label:<10} hit {res['hit_rate']:.4f}  "
            f"mgr {res['mgr_s']:.1f}s wall {res['wall_s']:.1f}s  step p50 {lat['p50_us']:.0f} µs "
            f"p99 {lat['p99_us']:.0f} µs  peak active {res['peak_active_blocks']:,}  idle {res['idle_check']}",
            flush=True,
        )
        gc.collect()
    out = {
        "kind": "peer_trace_run",
        "command": _cmd(argv),
        "trace": str(TRACES[a.trace]),
        "preset": p,
        "size": a.size,
        "pool_blocks": pool,
        "skipped": len(sch["skipped"]),
        "machine": machine(),
        "torch_threads": torch_threads,
        "loadavg": list(os.getloadavg()),
        "stubs": list(pb._SGLANG_STUBS),
        "results": results,
    }
    tag = a.managers.replace(":", "-").replace(",", "+")
    path = Path(a.out or RESULTS / f"peer_trace_run_{a.trace}_{a.size}_{tag}.json")
    path.write_text(json.dumps(out) + "\n")
    print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------- report


def _label_sort(name: str) -> tuple:
    return (0 if name.startswith("akv") else 1, name)


def cmd_report(a, argv) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged: dict[str, dict] = {}
    for trace in TRACES:
        sim_path = RESULTS / f"peer_trace_sim_{trace}.json"
        if not sim_path.exists():
            continue
        sim = json.loads(sim_path.read_text())
        runs = []
        for path in sorted(RESULTS.glob(f"peer_trace_run_{trace}_*.json")):
            runs.append(json.loads(path.read_text()))
        table: dict[str, dict] = {}
        commands = {"sim": sim["command"]}
        latency: dict[str, dict] = {}
        size_of = {v: k for k, v in sim["sizes"].items()}
        for run in runs:
            size = size_of.get(run["pool_blocks"], str(run["pool_blocks"]))
            for label, res in run["results"].items():
                row = table.setdefault(size, {})
                row[label] = {
                    "hit_rate": res["hit_rate"],
                    "mgr_s": res["mgr_s"],
                    "wall_s": res["wall_s"],
                    "step_p50_us": res["step_latency"]["p50_us"],
                    "step_p99_us": res["step_latency"]["p99_us"],
                    "step_max_us": res["step_latency"]["max_us"],
                    "peak_active_blocks": res["peak_active_blocks"],
                    "idle_check": res["idle_check"],
                    "command": run["command"],
                }
                latency.setdefault(size, {})[label] = res["step_latency"]
                if label == "akv:lru":
                    model = sim["by_size"][size]
                    ref = model["lru_model_watermarks"]["per_request_cached"]
                    got = res["per_request_cached"]
                    row[label]["requests_differing_from_lru_model_watermarks"] = sum(
                        1 for x, y in zip(ref, got) if x != y
                    )
        for size, row in table.items():
            s = sim["by_size"].get(size)
            if s is None:
                continue
            bel = s["belady"]["hit_rate"]
            for label in list(row):
                row[label]["of_belady"] = row[label]["hit_rate"] / bel if bel else None
            row["belady"] = {"hit_rate": bel, "command": sim["command"]}
            row["lru_model"] = {"hit_rate": s["lru_model"]["hit_rate"], "command": sim["command"]}
            row["lru_model_watermarks"] = {
                "hit_rate": s["lru_model_watermarks"]["hit_rate"],
                "command": sim["command"],
            }
            row["unbounded"] = {"hit_rate": sim["unbounded"]["hit_rate"], "command": sim["command"]}
        out = {
            "kind": "peer_trace",
            "trace": sim["trace"],
            "preset": sim["preset"],
            "requests": sim["requests"],
            "prompt_tokens": sim["prompt_tokens"],
            "steps": sim["steps"],
            "peak_reserved_blocks": sim["peak_reserved_blocks"],
            "sizes": sim["sizes"],
            "machine": runs[0]["machine"] if runs else sim["machine"],
            "sim_machine": sim["machine"],
            "stubs": runs[0]["stubs"] if runs else [],
            "hit_rates": {k: table[k] for k in sorted(table, key=lambda k: sim["sizes"].get(k, 0))},
            "step_latency": latency,
            "sweep": sim["sweep"],
            "commands": commands
            | {f"run {r['size']} {'+'.join(r['results'])}": r["command"] for r in runs}
            | {"report": _cmd(argv)},
        }
        name = "peer_trace.json" if trace == "conversation" else f"peer_trace_{trace}.json"
        (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n")
        merged[trace] = out
        print(f"wrote {RESULTS / name}")
        cols = sorted({k for row in out["hit_rates"].values() for k in row}, key=_label_sort)
        print(f"\n{trace} hit rate (akv share of Belady in parentheses)\n")
        print("| size | blocks | " + " | ".join(cols) + " |")
        print("|---|---:|" + "---:|" * len(cols))
        for size, row in out["hit_rates"].items():
            cells = []
            for c in cols:
                v = row.get(c)
                if v is None:
                    cells.append("–")
                elif "of_belady" in v and c != "belady":
                    cells.append(f"{v['hit_rate']:.2%} ({v['of_belady']:.0%})")
                else:
                    cells.append(f"{v['hit_rate']:.2%}")
            print(f"| {size} | {out['sizes'].get(size, '?'):,} | " + " | ".join(cells) + " |")
        print(f"\n{trace} per-step manager latency (µs)\n")
        print("| size | manager | p50 | p90 | p99 | p99.9 | max | mean | mgr s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for size, lat in out["step_latency"].items():
            for label in sorted(lat, key=_label_sort):
                q = lat[label]
                print(
                    f"| {size} | {label} | {q['p50_us']:.0f} | {q['p90_us']:.0f} | {q['p99_us']:.0f} | "
                    f"{q['p999_us']:.0f} | {q['max_us']:.0f} | {q['mean_us']:.0f} | "
                    f"{out['hit_rates'][size][label]['mgr_s']:.1f} |"
                )
        for size in out["hit_rates"]:
            row = out["hit_rates"][size]
            cells = "  ".join(
                f"{k} {v['hit_rate']:.4f}" for k, v in sorted(row.items(), key=lambda kv: _label_sort(kv[0]))
            )
            print(f"  {trace} {size}: {cells}")

    # hit rate vs pool size
    traces = [t for t in merged if merged[t]["hit_rates"]]
    if not traces:
        return 0
    fig, axes = plt.subplots(1, len(traces), figsize=(6.5 * len(traces), 4.8), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        m = merged[trace]
        sweep = m["sweep"]
        xs = [p["blocks"] for p in sweep]
        ax.plot(xs, [p["belady"] for p in sweep], "k-", marker="x", lw=1.5, label="Belady (MIN), simulated")
        ax.plot(xs, [p["lru_model"] for p in sweep], "k:", marker="+", lw=1, label="LRU model, simulated")
        ax.axhline(
            next(iter(m["hit_rates"].values()))["unbounded"]["hit_rate"],
            color="grey",
            ls="--",
            lw=1,
            label="unbounded ceiling",
        )
        labels = sorted(
            {k for row in m["hit_rates"].values() for k in row if k.startswith("akv") or k in ("vllm", "sglang")},
            key=_label_sort,
        )
        markers = {"vllm": ("s", "tab:blue"), "sglang": ("^", "tab:orange")}
        akv_colors = ["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink"]
        for i, label in enumerate(labels):
            pts = [
                (m["sizes"][s], row[label]["hit_rate"])
                for s, row in m["hit_rates"].items()
                if label in row and s in m["sizes"]
            ]
            pts.sort()
            mk, col = markers.get(label, ("o", akv_colors[i % len(akv_colors)]))
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=mk,
                color=col,
                ls="-" if label.startswith("akv") else "none",
                ms=7,
                mfc="none" if label == "sglang" else col,
                label=label,
            )
        for s, v in m["sizes"].items():
            ax.axvline(v, color="#ddd", lw=0.8, zorder=0)
            ax.text(v, 0.002, s, rotation=90, va="bottom", ha="right", fontsize=8, color="grey")
        ax.set_xscale("log")
        ax.set_xlabel("pool size (blocks of 16 tokens)")
        ax.set_ylabel("prefix hit rate (cached prompt tokens / prompt tokens)")
        ax.set_title(f"Mooncake {trace}: first {m['requests']} requests, B={m['preset']['batch']}")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(DOCS / "hit_rate.png", dpi=110)
    print(f"wrote {DOCS / 'hit_rate.png'}")

    # per-step latency CDFs (conversation trace), one panel per size
    m = merged.get("conversation") or merged[traces[0]]
    sizes = [s for s in m["sizes"] if s in m["step_latency"]]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 4.4), squeeze=False, sharey=True)
    for ax, size in zip(axes[0], sizes):
        lat = m["step_latency"][size]
        for label in sorted(lat, key=_label_sort):
            pcts = lat[label]["percentiles_us"]
            ax.plot(
                [max(p, 0.5) for p in pcts],
                [i / 100 for i in range(101)],
                label=label,
                lw=2 if label in ("vllm", "sglang") else 1.2,
            )
        ax.set_xscale("log")
        ax.set_xlabel("manager time per scheduler step (µs, log)")
        ax.set_title(f"{size} pool ({m['sizes'][size]:,} blocks)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of steps (CDF)")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Per-step manager latency, Mooncake {m['trace'].rsplit('/', 1)[-1]} replay ({m['steps']} steps)")
    fig.tight_layout()
    fig.savefig(DOCS / "trace_step_latency.png", dpi=110)
    print(f"wrote {DOCS / 'trace_step_latency.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sim", help="schedule, pool sizes, Belady / LRU model / unbounded")
    s.add_argument("--trace", choices=sorted(TRACES), default="conversation")
    s.add_argument("--limit", type=int, help="requests (default: the preset's)")
    s.add_argument("--sweep", type=float, nargs="*", default=[1, 2, 4, 8, 16], help="sweep sizes, x tight")
    s.add_argument("--out")
    r = sub.add_parser("run", help="real managers (peers venv)")
    r.add_argument("--trace", choices=sorted(TRACES), default="conversation")
    r.add_argument("--limit", type=int, help="requests (default: the preset's)")
    r.add_argument("--size", default="medium", help="tight, medium, roomy or a block count")
    r.add_argument("--managers", default="vllm,sglang,akv:lru")
    r.add_argument("--out")
    rp = sub.add_parser("report", help="merge results, draw the plots")
    del rp
    a = ap.parse_args(argv)
    return {"sim": cmd_sim, "run": cmd_run, "report": cmd_report}[a.cmd](a, argv)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if "triton" in sys.modules:
        os._exit(rc)  # skip teardown: triton's bindings print a spurious leak report
    sys.exit(rc)
