"""Presentation of a replay: the summary table and the progress bar (rich)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from akv.config import KVCacheConfig
from akv.replay.options import ReplayReport


@contextmanager
def progress_bar(total: int, *, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback drawing a bar on a terminal; a no-op elsewhere."""
    if not enabled or not sys.stderr.isatty():
        yield lambda done, total: None
        return
    with Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("replay", total=total)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def print_summary(report: ReplayReport, config: KVCacheConfig, trace: Path) -> None:
    """Print the replay's numbers as a table on stdout."""
    table = Table(title=f"akv replay: {trace.name}", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    gib = config.pool_bytes / 2**30
    rows = [
        (
            "requests (finished / dropped)",
            f"{report.requests_finished:,} / {report.requests_rejected:,} of {report.requests:,}",
        ),
        ("model / storage", f"{config.model.name} / {'metadata only' if config.storage == 'none' else config.device}"),
        ("pool", f"{config.num_blocks:,} blocks x {config.block_size} tokens ({gib:,.2f} GiB)"),
        ("prompt tokens", f"{report.prompt_tokens:,}"),
        ("cached tokens (prefix hits)", f"{report.cached_tokens:,}"),
        ("hit rate", f"{report.hit_rate:.2%}"),
        ("output tokens", f"{report.output_tokens:,}"),
        ("decode steps", f"{report.decode_steps:,}"),
        ("peak blocks in use", f"{report.peak_blocks_in_use:,} ({report.peak_blocks_in_use / config.num_blocks:.1%})"),
        ("peak running sequences", f"{report.peak_running:,}"),
        ("evicted blocks", f"{report.evictions:,}"),
        ("preemptions (re-admissions)", f"{report.preemptions:,} ({report.readmissions:,})"),
        (
            "step latency p50 / p99",
            f"{report.step_latency_us.get('p50', 0):,.0f} / {report.step_latency_us.get('p99', 0):,.0f} us",
        ),
        ("simulated time", f"{report.simulated_s:,.1f} s"),
        ("wall time", f"{report.wall_s:,.2f} s"),
    ]
    if report.copy_wait_s:
        rows.append(("of which awaiting copies", f"{report.copy_wait_s:,.2f} s"))
    if config.num_host_blocks:
        host_gib = config.num_host_blocks * config.bytes_per_block / 2**30
        rows[3:3] = [("host tier", f"{config.num_host_blocks:,} blocks ({host_gib:,.2f} GiB)")]
        rows += [
            ("hit tokens device / host", f"{report.device_hit_tokens:,} / {report.host_hit_tokens:,}"),
            ("demoted / promoted blocks", f"{report.demoted_blocks:,} / {report.promoted_blocks:,}"),
            ("host blocks in use at the end", f"{report.host_in_use:,}"),
        ]
        if report.swapped_out:
            rows.append(("sequences swapped out / in", f"{report.swapped_out:,} / {report.swapped_in:,}"))
    if report.warm_start_blocks:
        rows.append(("warm start (blocks, seconds)", f"{report.warm_start_blocks:,} in {report.warm_start_s:,.2f} s"))
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
