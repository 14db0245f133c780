"""akv against vLLM v1 and SGLang on the peer harness: repeated interleaved runs, medians, ratios, latency plot.

Imports ``../shared/peers/peer_bench.py`` by path and calls its own ``run_once`` on
its ``Workload`` presets with its built-in ``vllm`` and ``sglang`` adapters and akv's
``stress/akv_adapter.py:make``, so every number is peer_bench's own measurement.
Runs are interleaved: round ``r`` runs every manager once, the order rotated by
``r`` (round 0: vllm, sglang, akv; round 1: sglang, akv, vllm; ...), so slow drifts
of the shared machine hit all managers alike. As in ``peer_bench.main``, each
manager first gets one small untimed warm-up run, then ``gc.collect(); gc.freeze()``.

Reported per manager: per-field medians over the rounds (``peer_bench.median_result``);
for akv, the ratios akv/vllm and akv/sglang of decode µs/seq·tok, admit µs/req, free
µs/req, step p99 and decode@B p99, both as the ratio of the medians and as the
median of the per-round ratios (paired within a round).

Per-step latencies for the distribution plot come from a timing proxy around each
adapter: it forwards ``step_begin``/``decode``/``admit``/``finish`` (sync methods
stay sync and async ones stay ``async def``, so peer_bench's ``_is_async`` and
``_maybe`` treat the proxy exactly like the adapter), times each call with
``perf_counter_ns`` and sums the calls of one step (from one ``step_begin`` to the
next): the same definition as peer_bench's ``step p50/p99``. Its cost (one extra
call and two clock reads per call, well under a microsecond) falls inside
peer_bench's timed region; the JSON carries both p99s so the two can be compared.

Run with the peers' venv (see ../shared/peers/README.md)::

    .peers-venv/bin/python stress/bench_peers.py --size large --rounds 5 --plot docs/step_latency.png
    .peers-venv/bin/python stress/bench_peers.py --size small --rounds 1 --json /tmp/peers.json   # quick check

Writes ``stress/results/bench_peers.json`` (``--json FILE`` to change). The plot needs
matplotlib; the peers' venv has none, so the plot is drawn by ``python3`` (any
interpreter with matplotlib, ``$AKV_PLOT_PYTHON`` to choose) from the JSON::

    python3 stress/bench_peers.py --plot-from stress/results/bench_peers.json --plot docs/step_latency.png
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import inspect
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PEER_BENCH = ROOT.parent / "shared" / "peers" / "peer_bench.py"
DEFAULT_ADAPTER = ROOT / "stress" / "akv_adapter.py"
DEFAULT_JSON = ROOT / "stress" / "results" / "bench_peers.json"
MANAGERS = ("vllm", "sglang", "akv")
#: (Result field, label) pairs whose akv/peer ratio is reported (lower is better for akv).
RATIO_FIELDS = [
    ("decode_us_per_seq", "decode µs/seq·tok"),
    ("admit_us_per_req", "admit µs/req"),
    ("free_us_per_req", "free µs/req"),
    ("step_p99_us", "step p99 µs"),
    ("decodeB_p99_us", "decode@B p99 µs"),
]
MEDIAN_COLUMNS = [
    ("wall_s", "wall s", "{:.2f}"),
    ("mgr_s", "mgr s", "{:.3f}"),
    ("step_p50_us", "step p50 µs", "{:.0f}"),
    ("step_p99_us", "step p99 µs", "{:.0f}"),
    ("decodeB_p50_us", "decode@B p50 µs", "{:.0f}"),
    ("decodeB_p99_us", "decode@B p99 µs", "{:.0f}"),
    ("admit_us_per_req", "admit µs/req", "{:.1f}"),
    ("decode_us_per_seq", "decode µs/seq·tok", "{:.2f}"),
    ("free_us_per_req", "free µs/req", "{:.1f}"),
    ("hit_rate", "hit %", "{:.1%}"),
    ("peak_active_blocks", "peak active blocks", "{}"),
    ("idle_check", "idle", "{}"),
]


def load_peer_bench(path: Path) -> Any:
    """Import peer_bench.py by path (registered in ``sys.modules`` so its dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location("peer_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["peer_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- timing proxy

_TIMED = ("step_begin", "decode", "admit", "finish")


class StepTimer:
    """Wraps an adapter and records the summed duration of its timed calls per step.

    A step opens at ``step_begin`` (peer_bench calls it first in every step) and
    holds every ``decode``/``admit``/``finish`` call until the next one. Each
    wrapper has the same kind as the wrapped method (``async def`` for a coroutine
    function, plain otherwise), so the harness sees the same sync/async adapter.
    Everything else is forwarded unchanged.

    Attributes:
        steps_ns: Per-step summed call time (ns), one entry per step.
        decode_ns: ``(batch, ns)`` of every decode call.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.steps_ns: list[int] = []
        self.decode_ns: list[tuple[int, int]] = []
        self._cur: int | None = None
        for name in _TIMED:
            method = getattr(inner, name, None)
            if method is None:  # peer_bench substitutes a no-op; still mark the step boundary
                method = _noop
            setattr(self, name, self._wrap(name, method))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def flush(self) -> None:
        """Close the last open step (call after the run)."""
        if self._cur is not None:
            self.steps_ns.append(self._cur)
            self._cur = None

    def _wrap(self, name: str, method: Callable) -> Callable:
        from time import perf_counter_ns as pc

        begin = name == "step_begin"
        record_decode = name == "decode"

        def account(dt: int, args: tuple) -> None:
            if begin:
                if self._cur is not None:
                    self.steps_ns.append(self._cur)
                self._cur = dt
            else:
                self._cur = (self._cur or 0) + dt
                if record_decode:
                    self.decode_ns.append((len(args[0]), dt))

        if inspect.iscoroutinefunction(method):

            async def async_wrapper(*args):
                t = pc()
                result = await method(*args)
                account(pc() - t, args)
                return result

            return async_wrapper

        def sync_wrapper(*args):
            t = pc()
            result = method(*args)
            if result is not None and inspect.isawaitable(result):  # a sync method handing back an awaitable

                async def finish():
                    value = await result
                    account(pc() - t, args)
                    return value

                return finish()
            account(pc() - t, args)
            return result

        return sync_wrapper


def _noop(*_args) -> None:
    return None


# ----------------------------------------------------------------------------- the runs


def rotation(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` rotated left by ``r``."""
    k = r % len(names)
    return names[k:] + names[:k]


def make_factories(pb: Any, adapter_spec: str) -> dict[str, Callable]:
    """Factory per manager name, each returning the adapter (not yet wrapped)."""
    akv_make = pb.load_factory(adapter_spec)
    return {
        "vllm": lambda w: pb.BUILTIN["vllm"](w, breakdown=False),
        "sglang": lambda w: pb.BUILTIN["sglang"](w, breakdown=False),
        "akv": akv_make,
    }


def run_rounds(pb: Any, w: Any, factories: dict[str, Callable], rounds: int, backend: str, log=print) -> dict:
    """Warm up each manager, then ``rounds`` interleaved rounds; returns raw per-run data."""
    names = list(factories)
    warm = pb.Workload(**{**asdict(w), "num_requests": min(32, w.num_requests), "batch": min(8, w.batch)})
    for name in names:
        pb.run_once(factories[name], warm, False, backend)
    gc.collect()
    gc.freeze()
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in rotation(names, r):
            holder: list[StepTimer] = []

            def factory(wl, _f=factories[name], _h=holder):
                proxy = StepTimer(_f(wl))
                _h.append(proxy)
                return proxy

            result = pb.run_once(factory, w, False, backend)
            proxy = holder[-1]
            proxy.flush()
            runs[name].append(
                {
                    "round": r,
                    "result": result,
                    "steps_ns": proxy.steps_ns,
                    "decodeB_ns": [ns for b, ns in proxy.decode_ns if b == w.batch],
                }
            )
            log(
                f"round {r} {name}: mgr {result.mgr_s:.3f}s step p99 {result.step_p99_us:.0f} µs "
                f"decode {result.decode_us_per_seq:.2f} µs/seq·tok admit {result.admit_us_per_req:.1f} "
                f"free {result.free_us_per_req:.1f} hit {result.hit_rate:.1%} idle {result.idle_check}",
            )
    return runs


def summarize(pb: Any, w: Any, runs: dict[str, list[dict]]) -> dict:
    """Medians per manager, akv/peer ratios (of medians and paired per round)."""
    medians = {n: asdict(pb.median_result([x["result"] for x in rs])) for n, rs in runs.items()}
    ratios: dict[str, dict] = {}
    for peer in ("vllm", "sglang"):
        if peer not in runs or "akv" not in runs:
            continue
        rows = {}
        for key, label in RATIO_FIELDS:
            paired = [
                a["result"].__getattribute__(key) / p["result"].__getattribute__(key)
                for a, p in zip(runs["akv"], runs[peer])
            ]
            rows[key] = {
                "label": label,
                "ratio_of_medians": medians["akv"][key] / medians[peer][key],
                "median_of_round_ratios": statistics.median(paired),
            }
        ratios[f"akv/{peer}"] = rows
    proxy_check = {}
    for n, rs in runs.items():
        proxy_p99 = statistics.median(pb.pct(x["steps_ns"], 0.99) / 1e3 for x in rs)
        proxy_check[n] = {"proxy_step_p99_us": proxy_p99, "peer_bench_step_p99_us": medians[n]["step_p99_us"]}
    return {"medians": medians, "ratios": ratios, "proxy_check": proxy_check}


def targets(summary: dict) -> list[dict]:
    """The issue's targets, evaluated on the medians (True = met)."""
    m = summary["medians"]
    if not all(k in m for k in MANAGERS):
        return []
    v, s, a = m["vllm"], m["sglang"], m["akv"]

    def best(key: str) -> float:
        return min(v[key], s[key])

    return [
        {
            "target": "decode µs/seq·tok <= faster peer (aim: half)",
            "akv": a["decode_us_per_seq"],
            "bound": best("decode_us_per_seq"),
            "aim": best("decode_us_per_seq") / 2,
            "met": a["decode_us_per_seq"] <= best("decode_us_per_seq"),
            "aim_met": a["decode_us_per_seq"] <= best("decode_us_per_seq") / 2,
        },
        {
            "target": "admit µs/req <= half the faster peer",
            "akv": a["admit_us_per_req"],
            "bound": best("admit_us_per_req") / 2,
            "met": a["admit_us_per_req"] <= best("admit_us_per_req") / 2,
        },
        {
            "target": "free µs/req <= faster peer",
            "akv": a["free_us_per_req"],
            "bound": best("free_us_per_req"),
            "met": a["free_us_per_req"] <= best("free_us_per_req"),
        },
        {
            "target": "step p99 below both peers",
            "akv": a["step_p99_us"],
            "bound": best("step_p99_us"),
            "met": a["step_p99_us"] < best("step_p99_us"),
        },
    ]


# ----------------------------------------------------------------------------- output


def tables(doc: dict) -> str:
    """Markdown: medians, ratios, targets."""
    med = doc["medians"]
    out = [
        "| manager | " + " | ".join(c[1] for c in MEDIAN_COLUMNS) + " |",
        "|---|" + "---|" * len(MEDIAN_COLUMNS),
    ]
    for n, r in med.items():
        cells = [fmt.format(r[k]) for k, _, fmt in MEDIAN_COLUMNS]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    if doc["ratios"]:
        out += ["", "| metric | " + " | ".join(f"{k} (medians) | {k} (paired)" for k in doc["ratios"]) + " |"]
        out.append("|---|" + "---|---|" * len(doc["ratios"]))
        for key, label in RATIO_FIELDS:
            cells = []
            for rows in doc["ratios"].values():
                cells += [f"{rows[key]['ratio_of_medians']:.2f}", f"{rows[key]['median_of_round_ratios']:.2f}"]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    if doc.get("targets"):
        out += ["", "| target | akv | bound | met |", "|---|---|---|---|"]
        for t in doc["targets"]:
            met = "yes" if t["met"] else "no"
            if "aim_met" in t:
                met += f" (aim {t['aim']:.2f}: {'yes' if t['aim_met'] else 'no'})"
            out.append(f"| {t['target']} | {t['akv']:.2f} | {t['bound']:.2f} | {met} |")
    return "\n".join(out)


def dump_json(doc: dict, path: Path) -> None:
    """Indented JSON with every list of numbers kept on one line."""
    text = json.dumps(doc, indent=2, ensure_ascii=False)
    text = re.sub(
        r"\[\s+(-?[\d.e+-]+(?:,\s+-?[\d.e+-]+)*)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def plot(doc: dict, png: Path) -> None:
    """CDFs (log x) of per-step latency and of the decode call at batch B, all rounds pooled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    w = doc["workload"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {"vllm": "tab:blue", "sglang": "tab:orange", "akv": "tab:green"}
    for ax, key, title in (
        (axes[0], "steps_us", "all manager calls of one step"),
        (axes[1], "decodeB_us", f"decode call at batch B={w['batch']}"),
    ):
        for name, lat in doc["latencies"].items():
            xs = np.sort(np.concatenate([np.asarray(r, dtype=float) for r in lat[key]]))
            if not len(xs):
                continue
            ys = np.arange(1, len(xs) + 1) / len(xs)
            p50, p99 = np.percentile(xs, 50), np.percentile(xs, 99)
            ax.step(xs, ys, where="post", color=colors.get(name), label=f"{name}: p50 {p50:.0f} µs, p99 {p99:.0f} µs")
            ax.plot([p99], [0.99], "o", color=colors.get(name), ms=4)
        ax.set_xscale("log")
        ax.axhline(0.99, color="grey", lw=0.6, ls="--")
        ax.axhline(0.5, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("latency (µs, log scale)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("fraction of steps ≤ x")
    rounds = doc["rounds"]
    fig.suptitle(
        f"Per-step KV-manager latency, peer_bench {doc['size']} (R={w['num_requests']}, B={w['batch']}), "
        f"{rounds} interleaved rounds pooled",
        fontsize=11,
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot_or_delegate(json_path: Path, png: Path) -> None:
    """Plot here if matplotlib imports, else with ``$AKV_PLOT_PYTHON`` / ``python3`` from the JSON."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        python = os.environ.get("AKV_PLOT_PYTHON") or shutil.which("python3")
        if not python:
            print("no matplotlib and no python3 to plot with; skipped", file=sys.stderr)
            return
        cmd = [python, __file__, "--plot-from", str(json_path), "--plot", str(png)]
        if subprocess.run(cmd, check=False).returncode:
            print(f"plotting failed: {' '.join(cmd)}", file=sys.stderr)
        return
    plot(json.loads(json_path.read_text()), png)
    print(f"wrote {png}")


def versions(pb: Any) -> dict:
    from importlib import metadata

    out = dict(pb.versions())
    for dist in ("akv", "numpy", "anyio", "uvloop"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    out["uname"] = " ".join(platform.uname()).strip()
    out["cpu_count"] = os.cpu_count()
    if "akv" in sys.modules:
        from bench_micro import akv_provenance  # stress/ is on sys.path: scripts run from there

        out.update(akv_provenance())
    return out


def one_torch_thread() -> int:
    """Pin torch (and OpenMP) to one thread for every manager in this process; return the count.

    SGLang's CPU path slows 4-9x under load with torch's default thread count, which would
    flatter akv; one thread each makes the comparison measure the managers, not the machine.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["small", "large"], default="large", help="peer_bench preset (default large)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--json", default=str(DEFAULT_JSON), help=f"result file (default {DEFAULT_JSON.relative_to(ROOT)})")
    p.add_argument("--plot", help="per-step latency CDF PNG, e.g. docs/step_latency.png")
    p.add_argument("--plot-from", help="only draw --plot from this result JSON (no runs)")
    p.add_argument("--peer-bench", default=str(DEFAULT_PEER_BENCH), help="path of peer_bench.py")
    p.add_argument("--adapter", default=f"{DEFAULT_ADAPTER}:make", help="akv adapter, file.py:factory")
    p.add_argument("--managers", default=",".join(MANAGERS), help="subset of vllm,sglang,akv")
    p.add_argument("--async-backend", default="asyncio", choices=["asyncio", "uvloop", "trio"])
    a = p.parse_args(argv)

    if a.plot_from:
        if not a.plot:
            p.error("--plot-from needs --plot")
        plot(json.loads(Path(a.plot_from).read_text()), Path(a.plot))
        print(f"wrote {a.plot}")
        return 0

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    torch_threads = one_torch_thread()
    print(f"torch threads: {torch_threads} for every manager (OMP_NUM_THREADS=1, torch.set_num_threads(1))")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    pb = load_peer_bench(Path(a.peer_bench))
    w = pb.Workload(**pb.SIZES[a.size])
    pb.check_fits(w)
    all_factories = make_factories(pb, a.adapter)
    names = [n for n in a.managers.split(",") if n]
    for n in names:
        if n not in all_factories:
            p.error(f"unknown manager {n!r}")
    factories = {n: all_factories[n] for n in names}
    print(f"workload: {json.dumps(asdict(w))}", flush=True)
    load0 = list(os.getloadavg())
    runs = run_rounds(pb, w, factories, a.rounds, a.async_backend, log=lambda s: print(s, flush=True))
    summary = summarize(pb, w, runs)
    cmd = " ".join(["stress/bench_peers.py", *(argv if argv is not None else sys.argv[1:])])
    doc = {
        "command": f".peers-venv/bin/python {cmd}",
        "size": a.size,
        "rounds": a.rounds,
        "order": "round r runs the managers rotated left by r: "
        + "; ".join(", ".join(rotation(names, r)) for r in range(min(a.rounds, len(names)))),
        "async_backend": a.async_backend,
        "workload": asdict(w),
        "versions": versions(pb),
        "torch_threads": torch_threads,
        "loadavg_before": load0,
        "loadavg_after": list(os.getloadavg()),
        "stubs": list(getattr(pb, "_SGLANG_STUBS", [])),
        **summary,
        "targets": targets(summary),
        "runs": {n: [asdict(x["result"]) for x in rs] for n, rs in runs.items()},
        "latencies": {
            n: {
                "steps_us": [[round(ns / 1e3, 1) for ns in x["steps_ns"]] for x in rs],
                "decodeB_us": [[round(ns / 1e3, 1) for ns in x["decodeB_ns"]] for x in rs],
            }
            for n, rs in runs.items()
        },
    }
    print()
    print(tables(doc))
    json_path = Path(a.json)
    dump_json(doc, json_path)
    print(f"\nwrote {json_path}")
    if a.plot:
        plot_or_delegate(json_path, Path(a.plot))
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if "triton" in sys.modules:  # as peer_bench: skip teardown, triton's bindings print a spurious leak report
        os._exit(rc)
    sys.exit(rc)
