"""Timeline pictures of a replay and of a JSON-lines log (matplotlib, the ``plot`` extra; imported only when asked).

Every axis fits its data: counts start at zero and end just above their
largest value (an all-zero series gets ``0..1`` with integer ticks, not
matplotlib's ``-0.04..0.04``), and ratios such as the hit rate or pool usage
span their own range instead of a fixed ``0..1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from akv.obs.inspect import LogFile

_MARGIN = 0.08  # fraction of the data's span added above (and below, for ratios)


def fit_ylim(values: Sequence[float | None], *, from_zero: bool) -> tuple[float, float]:
    """The y range that shows ``values`` (a plotted series) without wasted space.

    Args:
        values: The series; entries that are not finite numbers are ignored.
        from_zero: Start at 0 (counts); otherwise fit the minimum too (ratios;
            the bottom never goes below 0).

    Returns:
        ``(bottom, top)`` with ``bottom < top``: ``(0, 1)`` for an empty or
        all-zero series; ``max * (1 + margin)`` on top for counts; a margin of
        the span (or of the value, if constant) around ratios.
    """
    data = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not data or (max(data) == 0 and min(data) == 0):
        return 0.0, 1.0
    lo, hi = (0.0 if from_zero else min(data)), max(data)
    pad = (hi - lo) * _MARGIN if hi > lo else abs(hi) * _MARGIN
    return (lo if from_zero else max(0.0, lo - pad)), hi + pad


def _count_axis(ax: Any, values: Sequence[float]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_ylim(*fit_ylim(values, from_zero=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def plot_log(log: LogFile, path: Path | str) -> int:
    """Write a PNG: shard usage around eviction batches and cumulative evicted blocks over wall time.

    The log holds one line per eviction batch at info (nothing per step), so
    the usage curve is sampled at eviction batches.

    Args:
        log: A log read by :func:`akv.obs.inspect.read_log`.
        path: PNG to write.

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
        blocks = e.get("blocks") if isinstance(e.get("blocks"), int) else 0
        total += blocks
        times += [t - t0, t - t0]
        usage += [e.get("usage_before"), e.get("usage_after")]
        cumulative += [total - blocks, total]
    fig = Figure(figsize=(9, 5), layout="constrained")
    ax_usage, ax_evicted = fig.subplots(2, 1, sharex=True)
    ax_usage.plot(times, usage, drawstyle="steps-post", color="tab:blue")
    ax_usage.set_ylabel("shard usage (fraction)")
    ax_usage.set_ylim(*fit_ylim(usage, from_zero=False))
    ax_usage.set_title("eviction batches" if times else "eviction batches: none in this log")
    ax_evicted.plot(times, cumulative, color="tab:red")
    ax_evicted.set_ylabel("evicted blocks (cumulative)")
    _count_axis(ax_evicted, cumulative)
    ax_evicted.set_xlabel("wall time since the first batch (s)")
    if not times:
        ax_evicted.set_xlim(0.0, 1.0)
    fig.savefig(path, dpi=100)
    return len(times) // 2


def plot_replay(timeline: list[dict], path: Path | str) -> Any:
    """Write a PNG of a replay over simulated time: blocks by state, hit rate, evictions and preemptions.

    Args:
        timeline: ``ReplayReport.timeline`` samples (``ReplayOptions.timeline_every_steps``).
        path: PNG to write.

    Returns:
        The ``matplotlib.figure.Figure`` written: axes 0 blocks by state, 1 hit
        rate, 2 evicted blocks, 3 preemptions (a twin of axes 2).

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
    _count_axis(ax_blocks, [sum(x[s] for s in states) for x in timeline])
    ax_blocks.legend(loc="upper right", fontsize="small")
    ax_blocks.set_title("pool by state")
    hits = [100.0 * x["hit_rate"] for x in timeline]
    ax_hits.plot(t, hits, color="tab:green")
    ax_hits.set_ylabel("prefix hit rate, % (cumulative)")
    ax_hits.set_ylim(*fit_ylim(hits, from_zero=False))
    evictions = [x["evictions"] for x in timeline]
    preemptions = [x["preemptions"] for x in timeline]
    ax_events.plot(t, evictions, color="tab:red", label="evicted blocks")
    ax_events.set_ylabel("evicted blocks", color="tab:red")
    _count_axis(ax_events, evictions)
    ax_pre = ax_events.twinx()
    ax_pre.plot(t, preemptions, color="tab:purple", label="preemptions")
    ax_pre.set_ylabel("preemptions", color="tab:purple")
    _count_axis(ax_pre, preemptions)
    ax_events.set_xlabel("simulated time (s)")
    fig.savefig(path, dpi=100)
    return fig
