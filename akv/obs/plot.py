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
