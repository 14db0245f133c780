"""Benchmark: KV blocks saved by sharing and copy-on-write (PagedAttention, SOSP 2023, section 6.3).

For parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) over
prompt and output lengths of requests drawn from the Mooncake synthetic trace,
count the KV blocks in use with sharing (one prompt copy; children forked,
copy-on-write of the shared partial tail; beams forked and freed) and without
(every sequence owns a full copy of its prompt and history), through the real
manager in metadata mode (``storage="none"``: block tables, refcounts, no
tensors). Both counts come from ``kv.blocks_in_use`` after every decode step;
the unshared count is also checked against ``sum(ceil(len / block_size))``.

    python stress/bench_sharing.py                    # 200 requests, scales 1/4 and 1, JSON + PNG
    python stress/bench_sharing.py --requests 50 --scales 0.25 --no-plot

Saving = 1 - blocks with sharing / blocks without, time-averaged over all
decode steps of all requests (the paper's Figure 15 metric; the peak, at the
last step of each request, is reported too). Internal fragmentation: unused
slots in each sequence's tail block at the end of its generation.

Beam survival model (no real model runs here): at each step every live beam
draws next-token log-probabilities ``log_softmax(sigma * z)``, ``z ~ N(0, 1)``
over a ``--vocab``-token vocabulary, from a generator seeded per request; the
``width`` best (beam, token) pairs by cumulative log-probability survive
(:func:`akv.testing.generation.select_beams`). A beam with ``c`` survivors is
continued once and forked ``c - 1`` times; a beam with none is freed. The same
survival plan drives the shared and the unshared run of a request. ``sigma``
sets how peaked the distributions are, hence how often beams branch; the
default 2.0 and a sensitivity sweep are reported.

Scaling: prompt and output lengths are multiplied by ``--scales`` (ceil, at
least 1 token each). At 1/4, the longest request of the trace (191,386 prompt
+ output tokens) at width 6 without sharing needs 17,946 blocks of 16 tokens,
which fits the 30,720-block pool of Llama-3-8B on an 80 GB GPU (60 GiB of KV);
at 1 (no scaling, possible because metadata mode holds no tensors) the pool
is sized to the largest request.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio
import numpy as np
import torch

from akv import Admit, KVCacheConfig, KVCacheManager, model_shape
from akv.obs.logging import configure_logging
from akv.testing.generation import select_beams
from akv.trace import TraceRequest, read_trace, shared_trace_path, synthesize_prompt

#: Memory saving reported by Kwon et al. (SOSP 2023), section 6.3 / Figure 15, in percent.
PAPER_RANGES = {
    "parallel": {"Alpaca": (6.1, 9.8), "ShareGPT": (16.2, 30.5)},
    "beam": {"Alpaca": (37.6, 55.2), "ShareGPT": (44.3, 66.3)},
}
POOL_80GB_LLAMA3_8B = 30_720  # blocks of 16 tokens in 60 GiB (2 MiB per block)


@dataclass
class Tally:
    """Block counts of one (kind, width, mode) over all requests (units: blocks, slots, steps)."""

    block_steps: int = 0  # sum over decode steps of blocks in use
    steps: int = 0
    peak_blocks: int = 0  # sum over requests of blocks in use at their last step
    sequences: int = 0  # sequences alive at the end of generation, all requests
    unused_slots: int = 0  # their unused tail-block slots
    slots_at_end: int = 0  # blocks in use at the end * block_size, all requests
    forks: int = 0
    cow_copies: int = 0


@dataclass
class Result:
    """One row of the report."""

    kind: str
    width: int
    workload: str
    requests: int
    shared: Tally = field(default_factory=Tally)
    unshared: Tally = field(default_factory=Tally)

    def as_json(self, block_size: int) -> dict:
        s, u = self.shared, self.unshared
        return {
            "kind": self.kind,
            "width": self.width,
            "workload": self.workload,
            "requests": self.requests,
            "decode_steps": s.steps,
            "avg_blocks_shared": s.block_steps / s.steps,
            "avg_blocks_unshared": u.block_steps / u.steps,
            "saving_pct": 100.0 * (1 - s.block_steps / u.block_steps),
            "peak_saving_pct": 100.0 * (1 - s.peak_blocks / u.peak_blocks),
            "unused_tail_slots_per_seq": s.unused_slots / s.sequences,
            "unused_tail_slots_per_seq_pct_of_block": 100.0 * s.unused_slots / s.sequences / block_size,
            "unused_slots_pct_shared": 100.0 * s.unused_slots / s.slots_at_end,
            "unused_slots_pct_unshared": 100.0 * u.unused_slots / u.slots_at_end,
            "forks": s.forks,
            "cow_copies": s.cow_copies,
            "shared": asdict(s),
            "unshared": asdict(u),
        }


def beam_plan(width: int, steps: int, *, sigma: float, vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Seeded survival plan: per step, the parent index and token of each surviving beam, best first."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.zeros(1, dtype=torch.float64)
    plan = []
    for _ in range(steps):
        z = torch.randn(scores.numel(), vocab, generator=gen, dtype=torch.float64)
        parents, tokens, scores = select_beams(scores, torch.log_softmax(sigma * z, dim=-1), width)
        plan.append((parents, tokens))
    return plan


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


async def _end_of_generation(kv: KVCacheManager, ids: list[Hashable], tally: Tally, block_size: int) -> None:
    in_use = kv.blocks_in_use
    tally.peak_blocks += in_use
    tally.slots_at_end += in_use * block_size
    for seq_id in ids:
        info = await kv.sequence(seq_id)
        tally.sequences += 1
        tally.unused_slots += len(info.block_ids) * block_size - info.num_tokens
    await kv.step(frees=ids, want_metadata=False)


async def run_parallel(
    kv: KVCacheManager, prompt: np.ndarray, out_len: int, n: int, shared: bool, tally: Tally
) -> None:
    """n samples of ``out_len`` tokens; shared: one prompt, n - 1 forks; unshared: n prompt copies."""
    bs = kv.config.block_size
    ids = [f"s{i}" for i in range(n)]
    if shared:
        await kv.step(admits=[Admit(seq_id=ids[0], prompt=prompt, prefill_done=True)], want_metadata=False)
    else:
        await kv.step(admits=[Admit(seq_id=s, prompt=prompt, prefill_done=True) for s in ids], want_metadata=False)
    for step in range(out_len):
        forks = [(ids[0], ids[1:])] if shared and step == 0 and n > 1 else []
        await kv.step(forks=forks, appends={s: (step + i) % 1000 for i, s in enumerate(ids)}, want_metadata=False)
        in_use = kv.blocks_in_use
        if not shared and in_use != n * _blocks(len(prompt) + step + 1, bs):
            raise AssertionError(f"unshared parallel sampling holds {in_use} blocks, expected another count")
        tally.block_steps += in_use
        tally.steps += 1
    await _end_of_generation(kv, ids, tally, bs)


async def run_beam(
    kv: KVCacheManager, prompt: np.ndarray, plan: list[tuple[list[int], list[int]]], shared: bool, tally: Tally
) -> None:
    """Beam search following ``plan``; shared: fork / free with CoW; unshared: a child copies its parent's history."""
    bs = kv.config.block_size
    ids: list[Hashable] = ["b0"]
    lengths = [len(prompt)]
    histories = [prompt] if not shared else []
    fresh = iter(range(1, 1 << 62))
    await kv.step(admits=[Admit(seq_id="b0", prompt=prompt, prefill_done=True)], want_metadata=False)
    for parents, tokens in plan:
        new_ids: list[Hashable] = []
        forks: dict[Hashable, list[Hashable]] = {}
        appends: dict[Hashable, int] = {}
        admits = []
        new_histories = []
        for parent, token in zip(parents, tokens):
            parent_id = ids[parent]
            if parent_id not in new_ids:
                new_ids.append(parent_id)
                appends[parent_id] = token
            else:
                child = f"b{next(fresh)}"
                new_ids.append(child)
                if shared:
                    forks.setdefault(parent_id, []).append(child)
                    appends[child] = token
                else:  # the child owns a full copy of the parent's history plus its token
                    admits.append(Admit(seq_id=child, prompt=np.append(histories[parent], token), prefill_done=True))
            if not shared:
                new_histories.append(np.append(histories[parent], token))
        frees = [s for s in ids if s not in new_ids]
        await kv.step(frees=frees, forks=list(forks.items()), appends=appends, admits=admits, want_metadata=False)
        lengths = [lengths[p] + 1 for p in parents]
        ids, histories = new_ids, new_histories
        in_use = kv.blocks_in_use
        if not shared and in_use != sum(_blocks(n, bs) for n in lengths):
            raise AssertionError(
                f"unshared beam search holds {in_use} blocks, not {sum(_blocks(n, bs) for n in lengths)}"
            )
        tally.block_steps += in_use
        tally.steps += 1
    await _end_of_generation(kv, ids, tally, bs)


@dataclass(frozen=True)
class Item:
    """One request of a workload: its index (seeds its beam plan), prompt tokens and output length."""

    index: int
    prompt: np.ndarray  # int32 (prompt_len,)
    output_len: int


def mooncake_workload(requests: list[TraceRequest], scale: float, seed: int) -> list[Item]:
    """Trace requests with both lengths multiplied by ``scale`` (ceil, at least 1 token)."""
    items = []
    for r in requests:
        p_len = max(1, math.ceil(r.input_length * scale))
        items.append(
            Item(r.index, synthesize_prompt(r.hash_ids, p_len, seed=seed), max(1, math.ceil(r.output_length * scale)))
        )
    return items


def fixed_workload(prompt_len: int, output_len: int, count: int) -> list[Item]:
    """``count`` requests of fixed lengths (the paper datasets' mean lengths, for calibration)."""
    return [Item(i, (np.arange(prompt_len, dtype=np.int32) * 7 + i) % 1000, output_len) for i in range(count)]


async def run_config(workload: list[Item], label: str, kind: str, width: int, args: argparse.Namespace) -> Result:
    """Run every request (one at a time, so only sharing within a request counts) in both modes."""
    bs = args.block_size
    need = max(width * _blocks(len(it.prompt) + it.output_len, bs) for it in workload) + 16
    result = Result(kind=kind, width=width, workload=label, requests=len(workload))
    plans = [
        beam_plan(width, it.output_len, sigma=args.sigma, vocab=args.vocab, seed=args.seed * 1_000_003 + it.index)
        if kind == "beam"
        else []
        for it in workload
    ]
    for shared in (True, False):
        config = KVCacheConfig(
            num_blocks=max(need, POOL_80GB_LLAMA3_8B),
            block_size=bs,
            model=model_shape("llama-3-8b"),
            storage="none",
            enable_prefix_cache=False,  # sharing within a request only: forks, not prefix hits across requests
            low_watermark=0.0,
            high_watermark=0.0,
        )
        tally = result.shared if shared else result.unshared
        async with KVCacheManager(config) as kv:
            for it, plan in zip(workload, plans):
                if kind == "parallel":
                    await run_parallel(kv, it.prompt, it.output_len, width, shared, tally)
                else:
                    await run_beam(kv, it.prompt, plan, shared, tally)
            stats = await kv.stats()
            if stats.active or stats.num_sequences:
                raise AssertionError(f"blocks left after freeing every sequence: {stats}")
            tally.forks, tally.cow_copies = stats.forks, stats.cow_copies
    return result


def plot(rows: list[dict], path: Path) -> None:
    """Bars of the saving per configuration and workload, with the paper's ranges as bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    for ax, kind, title in zip(axes, ("parallel", "beam"), ("Parallel sampling (n)", "Beam search (width)")):
        widths = sorted({r["width"] for r in rows if r["kind"] == kind})
        x = np.arange(len(widths))
        bar_w = 0.8 / len(labels)
        for i, label in enumerate(labels):
            saving = {r["width"]: r["saving_pct"] for r in rows if r["kind"] == kind and r["workload"] == label}
            bars = ax.bar(
                x + (i - (len(labels) - 1) / 2) * bar_w, [saving[w] for w in widths], bar_w, label=label, zorder=2
            )
            ax.bar_label(bars, fmt="%.0f", fontsize=6)
        # The paper's ranges in colours and hatches that no bar uses.
        for (dataset, (lo, hi)), color, hatch in zip(
            PAPER_RANGES[kind].items(), ("tab:gray", "tab:olive"), ("//", "..")
        ):
            label = f"paper, {dataset}, {kind} ({lo}-{hi}%)"
            ax.axhspan(lo, hi, facecolor=color, alpha=0.2, hatch=hatch, edgecolor=color, lw=0, zorder=0, label=label)
        ax.set_xticks(x, [str(w) for w in widths])
        ax.set_title(title)
        ax.set_ylim(0, 100)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("KV blocks saved by sharing (%)")
    handles = {}
    for ax in axes:  # bars once, then both panels' paper bands
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("akv: memory saved by block sharing and copy-on-write (time-averaged over decode steps)", fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=None, help="default: ../shared/traces/mooncake_synthetic.jsonl")
    parser.add_argument("--requests", type=int, default=200, help="requests sampled from the trace (seeded)")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.25, 1.0], help="length multipliers")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sigma", type=float, default=2.0, help="spread of the synthetic next-token logits")
    parser.add_argument(
        "--sigma-sweep",
        type=float,
        nargs="*",
        default=[0.5, 1.0, 4.0, 8.0],
        help="extra sigmas for beam width 4 on the first and the calibration workloads (sensitivity)",
    )
    parser.add_argument(
        "--calibration",
        type=int,
        default=50,
        help="requests of fixed Alpaca / ShareGPT mean lengths (paper, Fig. 11) run alongside; 0: none",
    )
    parser.add_argument("--vocab", type=int, default=1000, help="synthetic vocabulary of the beam model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("stress/results/bench_sharing.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/sharing.png"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON, run nothing")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.json.read_text())["rows"], args.png)
        return 0
    configure_logging(level="warning")
    torch.set_num_threads(1)  # tiny tensors: OpenMP threads only add synchronization

    path = args.trace or shared_trace_path("mooncake_synthetic.jsonl")
    if path is None:
        print("bench_sharing: ../shared/traces/mooncake_synthetic.jsonl not found; pass --trace", file=sys.stderr)
        return 2
    trace = read_trace(path)
    requests = sorted(random.Random(args.seed).sample(trace, min(args.requests, len(trace))), key=lambda r: r.index)
    workloads = {
        f"Mooncake, lengths x{scale:g}": mooncake_workload(requests, scale, args.seed) for scale in args.scales
    }
    if args.calibration:
        workloads["Alpaca mean lengths (19 / 58)"] = fixed_workload(19, 58, args.calibration)
        workloads["ShareGPT mean lengths (161 / 338)"] = fixed_workload(161, 338, args.calibration)
    t0 = time.perf_counter()
    rows, sweep = [], []
    for label, workload in workloads.items():
        for kind in ("parallel", "beam"):
            for width in args.widths:
                t = time.perf_counter()
                row = anyio.run(run_config, workload, label, kind, width, args).as_json(args.block_size)
                row["wall_s"] = round(time.perf_counter() - t, 2)
                rows.append(row)
                print(
                    f"{label:34} {kind:8} {width}  saving {row['saving_pct']:5.1f}% (peak {row['peak_saving_pct']:5.1f}%)  "
                    f"avg blocks {row['avg_blocks_shared']:9.1f} vs {row['avg_blocks_unshared']:9.1f}  "
                    f"tail waste {row['unused_tail_slots_per_seq']:.1f} slots/seq  {row['wall_s']} s"
                )
    sigma = args.sigma
    swept = [label for label in workloads if label == next(iter(workloads)) or not label.startswith("Mooncake")]
    for label in swept:
        workload = workloads[label]
        for s in args.sigma_sweep:
            args.sigma = s
            row = anyio.run(run_config, workload, label, "beam", 4, args).as_json(args.block_size)
            sweep.append({"workload": label, "sigma": s, "saving_pct": row["saving_pct"], "forks": row["forks"]})
            print(f"{label:34} beam 4 sigma {s:g}: saving {row['saving_pct']:.1f}%, {row['forks']} forks")
    args.sigma = sigma
    lengths = np.array([[r.input_length, r.output_length] for r in requests])
    data = {
        "trace": str(path),
        "requests": len(requests),
        "sample": f"random.Random({args.seed}).sample of the trace's {len(trace)} requests",
        "prompt_tokens_mean": float(lengths[:, 0].mean()),
        "output_tokens_mean": float(lengths[:, 1].mean()),
        "block_size": args.block_size,
        "beam_model": {"sigma": args.sigma, "vocab": args.vocab, "seed": args.seed},
        "sigma_sweep_beam4": sweep,
        "workloads": {label: len(w) for label, w in workloads.items()},
        "paper_ranges_pct": PAPER_RANGES,
        "rows": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    if not args.no_plot:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
