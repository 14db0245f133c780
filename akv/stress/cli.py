"""The ``akv stress`` command: argument parsing, logging, progress bar, report, exit code.

The lead's ``akv/cli.py`` wires it in with::

    from akv.stress import main_stress, register
    register(sub)                      # sub = parser.add_subparsers(dest="command")
    ...
    if args.command == "stress":
        return main_stress(args)

``stress/run_stress.py`` builds a stand-alone parser with :func:`add_arguments`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from akv.stress.metrics import Metrics
from akv.stress.options import BACKENDS, StressOptions
from akv.stress.report import StressReport, print_summary
from akv.stress.runner import run_stress


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the stress options to ``parser``."""
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    parser.add_argument("--duration-s", type=_positive_float, default=20.0, help="seconds to run (default 20)")
    parser.add_argument("--sequences", type=_positive_int, default=256, help="concurrent tasks (default 256)")
    parser.add_argument(
        "--num-blocks",
        type=_positive_int,
        default=None,
        help="pool blocks (default: 3.5 blocks of 16 tokens per task, so eviction never stops)",
    )
    parser.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--backend", choices=BACKENDS, default="asyncio", help="anyio event loop (default asyncio)")
    parser.add_argument("--json", type=Path, dest="json_path", help="write the JSON report to this path")
    parser.add_argument("--log-json", type=Path, help="write structured logs as JSON lines to this path")
    parser.add_argument("--log-level", default="warning", help="console log level (default warning)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--inject-crash-after-s",
        type=float,
        default=None,
        metavar="X",
        help="make a pool shard raise after X s; every caller must fail fast and a fresh manager must work",
    )


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``stress`` subcommand to an ``add_subparsers()`` object; returns its parser.

    The parser's defaults carry ``handler=main_stress``.
    """
    parser = subparsers.add_parser(
        "stress",
        help="hundreds of concurrent forking sequences against one manager, every read verified",
        description=(
            "Drive N concurrent tasks (add, append, fork, beam search, parallel sampling, abort, "
            "cancellation) against one KVCacheManager with real CPU tensors and debug invariants; "
            "verify every K/V read; exit 0 only with no corrupted read, invariant violation or leak."
        ),
    )
    add_arguments(parser)
    parser.set_defaults(handler=main_stress)
    return parser


def options_from_args(args: argparse.Namespace) -> StressOptions:
    """The :class:`StressOptions` of parsed arguments."""
    return StressOptions(
        seed=args.seed,
        duration_s=args.duration_s,
        sequences=args.sequences,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        backend=args.backend,
        progress=not args.no_progress,
        inject_crash_after_s=args.inject_crash_after_s,
    )


@contextmanager
def progress_bar(duration_s: float, *, enabled: bool) -> Iterator[Callable[[float, Metrics], None] | None]:
    """A progress callback drawing a rich bar on stderr when it is a terminal; ``None`` otherwise."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    columns = (TextColumn("stress"), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=duration_s)

        def update(elapsed_s: float, m: Metrics) -> None:
            text = f"{m.operations:,} ops, {m.cancellations:,} cancelled, {m.corrupted_reads} corrupted"
            bar.update(task, completed=min(elapsed_s, duration_s), description=text)

        yield update


def main_stress(args: argparse.Namespace) -> int:
    """Run ``akv stress`` from parsed arguments; print the summary; return the exit code.

    Returns:
        0 when the report is clean (no corrupted read, invariant violation,
        leak, hang or unexpected error; with fault injection: every caller
        failed fast and a fresh manager worked), 1 otherwise, 2 for bad options.
    """
    from akv.obs.logging import configure_logging

    try:
        options = options_from_args(args)
    except ValueError as exc:
        sys.stderr.write(f"akv stress: error: {exc}\n")
        return 2
    configure_logging(level=args.log_level, json_path=args.log_json)
    # Last resort against a hang inside a shielded call (a cancel scope cannot end it).
    faulthandler.dump_traceback_later(options.duration_s + 600, exit=True)
    try:
        with progress_bar(options.duration_s, enabled=options.progress) as progress:
            report = _run(options, progress)
    finally:
        faulthandler.cancel_dump_traceback_later()
    print_summary(report)
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(report.as_json(), indent=2) + "\n")
    return 0 if report.ok else 1


def _run(options: StressOptions, progress: Callable[[float, Metrics], None] | None) -> StressReport:
    backend, backend_options = options.backend, {}
    if backend == "uvloop":
        backend, backend_options = "asyncio", {"use_uvloop": True}

    async def main() -> StressReport:
        return await run_stress(options, progress=progress)

    return anyio.run(main, backend=backend, backend_options=backend_options)
