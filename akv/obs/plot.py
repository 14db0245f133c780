"""Timeline pictures from a JSON-lines log (matplotlib, the ``plot`` extra; imported only when asked)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from akv.obs.inspect import LogFile


def plot_log(log: LogFile, path: Path | str) -> int:
    """Write a PNG: shard usage around eviction batches and cumulative evicted blocks over wall time.

    The log holds one line per eviction batch at info (nothing per step), so
    the usage curve is sampled at eviction batches.

    Returns:
        The number of eviction batches plotted.

    Raises:
        ImportError: matplotlib is not installed (``pip install akv[plot]``).
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    times, usage, cumulative = [], [], []
    t0, total = None, 0
    for e in log.events:
        if e["event"] != "eviction.batch" or not isinstance(e.get("timestamp"), str):
            continue
        t = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        t0 = t if t0 is None else t0
        total += int(e.get("blocks", 0))
        times += [t - t0, t - t0]
        usage += [e.get("usage_before"), e.get("usage_after")]
        cumulative += [total - int(e.get("blocks", 0)), total]
    fig = Figure(figsize=(9, 5), layout="constrained")
    ax_usage, ax_evicted = fig.subplots(2, 1, sharex=True)
    ax_usage.plot(times, usage, drawstyle="steps-post", color="tab:blue")
    ax_usage.set_ylabel("shard usage (0-1)")
    ax_usage.set_ylim(0, 1.05)
    ax_usage.set_title("eviction batches")
    ax_evicted.plot(times, cumulative, color="tab:red")
    ax_evicted.set_ylabel("evicted blocks (cumulative)")
    ax_evicted.set_xlabel("wall time since the first batch (s)")
    fig.savefig(path, dpi=100)
    return len(times) // 2


def plot_replay(timeline: list[dict], path: Path | str) -> None:
    """Write a PNG of a replay over simulated time: blocks by state, hit rate, evictions and preemptions.

    Args:
        timeline: ``ReplayReport.timeline`` samples (``ReplayOptions.timeline_every_steps``).
        path: PNG to write.

    Raises:
        ImportError: matplotlib is not installed (``pip install akv[plot]``).
    """
    from matplotlib.figure import Figure

    t = [x["simulated_s"] for x in timeline]
    fig = Figure(figsize=(9, 8), layout="constrained")
    ax_blocks, ax_hits, ax_events = fig.subplots(3, 1, sharex=True)
    states = ("active", "in_flight", "cached", "free")
    ax_blocks.stackplot(t, *[[x[s] for x in timeline] for s in states], labels=states)
    ax_blocks.set_ylabel("blocks")
    ax_blocks.legend(loc="upper right", fontsize="small")
    ax_blocks.set_title("pool by state")
    ax_hits.plot(t, [x["hit_rate"] for x in timeline], color="tab:green")
    ax_hits.set_ylabel("prefix hit rate (cumulative)")
    ax_hits.set_ylim(0, 1)
    ax_events.plot(t, [x["evictions"] for x in timeline], color="tab:red", label="evicted blocks")
    ax_events.set_ylabel("evicted blocks")
    ax_pre = ax_events.twinx()
    ax_pre.plot(t, [x["preemptions"] for x in timeline], color="tab:purple", label="preemptions")
    ax_pre.set_ylabel("preemptions")
    ax_events.set_xlabel("simulated time (s)")
    fig.savefig(path, dpi=100)
