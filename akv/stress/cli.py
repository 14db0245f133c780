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
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from akv.argtypes import float_range, int_range, log_level, output_path
from akv.cli_signals import run_async
from akv.stress.metrics import Metrics
from akv.stress.options import BACKENDS, FAULTS, POLICIES, StressOptions
from akv.stress.report import StressReport, print_summary
from akv.stress.runner import run_stress

_positive_int = int_range(1, 1_000_000)
_seconds = float_range(0.0, 86_400.0, min_open=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the stress options to ``parser``."""
    parser.add_argument(
        "--seed", type=int_range(0, 2**63 - 1), default=0, help="seed of every random choice (default 0)"
    )
    parser.add_argument(
        "--duration-s",
        type=_seconds,
        default=20.0,
        help="seconds to run; an upper bound with --operations (default 20)",
    )
    parser.add_argument(
        "--operations",
        type=_positive_int,
        default=None,
        metavar="N",
        help="end after N programs (requests) in all, whatever the time (default: run for --duration-s)",
    )
    parser.add_argument("--sequences", type=int_range(1, 100_000), default=256, help="concurrent tasks (default 256)")
    parser.add_argument(
        "--num-blocks",
        type=int_range(8, 10_000_000),
        default=None,
        help="pool blocks; each shard must hold the longest sequence, 21 blocks of 16 tokens "
        "(default: 3.5 blocks of 16 tokens per task, so eviction never stops)",
    )
    parser.add_argument("--block-size", type=int_range(1, 4096), default=16, help="tokens per block (default 16)")
    parser.add_argument("--shards", type=int_range(1, 4), default=1, help="pool shards, 1-4 (default 1)")
    parser.add_argument(
        "--eviction-policy",
        choices=POLICIES,
        default="slru",
        help="eviction policy; random picks one from the seed (default slru)",
    )
    parser.add_argument(
        "--namespaces", type=int_range(1, 16), default=3, help="tenants sharing the prompts, 1-16 (default 3)"
    )
    parser.add_argument(
        "--audits",
        type=int_range(0, 1000),
        default=3,
        help="quiescent points that recount refcounts and check the prefix cache, besides the end (default 3)",
    )
    parser.add_argument("--backend", choices=BACKENDS, default="asyncio", help="anyio event loop (default asyncio)")
    parser.add_argument("--json", type=output_path, dest="json_path", help="write the JSON report to this path")
    parser.add_argument("--log-json", type=output_path, help="write structured logs as JSON lines to this path")
    parser.add_argument(
        "--log-json-level", type=log_level, default="debug", help="level of the --log-json file (default debug)"
    )
    parser.add_argument("--log-level", type=log_level, default="warning", help="console log level (default warning)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--events",
        action="store_true",
        help="turn cache events on and check them with a subscriber (consecutive numbers, removals of stored keys)",
    )
    parser.add_argument(
        "--host-blocks",
        type=int_range(0, 10_000_000),
        default=0,
        metavar="N",
        help="host-memory tier of N blocks: demotion, promotion and swap preemption, every read verified "
        "(default 0: none)",
    )
    parser.add_argument(
        "--host-gib",
        type=float_range(0.0, 1024.0, min_open=True),
        default=None,
        metavar="X",
        help="host-memory tier of X GiB instead of --host-blocks",
    )
    parser.add_argument(
        "--inject-crash-after-s",
        type=float_range(0.0, 86_400.0),
        default=None,
        metavar="X",
        help="make a pool shard raise after X s; every caller must fail fast and a fresh manager must work",
    )
    parser.add_argument(
        "--fault",
        choices=FAULTS,
        default=None,
        help="inject a fault: crash (shard 0), shard_exception (another shard, --shards >= 2), eviction_crash, "
        "failing_copies, slow_copies (not fatal)",
    )
    parser.add_argument(
        "--fault-after-s",
        type=float_range(0.0, 86_400.0),
        default=None,
        help="seconds before the --fault fires (default 1; only with --fault)",
    )
    parser.add_argument(
        "--fault-after-programs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="inject the --fault once N programs have started (a count; overrides --fault-after-s; only with --fault)",
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
    """The :class:`StressOptions` of parsed arguments.

    Raises:
        ValueError: Options that cannot work together (``--fault-after-s`` or
            ``--fault-after-programs`` without ``--fault``, a pool shard too
            small for the workload, ...); the message names them.
    """
    for flag, value in (("--fault-after-s", args.fault_after_s), ("--fault-after-programs", args.fault_after_programs)):
        if value is not None and args.fault is None:
            raise ValueError(f"{flag} needs --fault (it says when the fault fires)")
    return StressOptions(
        seed=args.seed,
        duration_s=args.duration_s,
        sequences=args.sequences,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        backend=args.backend,
        progress=not args.no_progress,
        inject_crash_after_s=args.inject_crash_after_s,
        operations=args.operations,
        shards=args.shards,
        eviction_policy=args.eviction_policy,
        namespaces=args.namespaces,
        audits=args.audits,
        fault=args.fault,
        fault_after_s=1.0 if args.fault_after_s is None else args.fault_after_s,
        fault_after_programs=args.fault_after_programs,
        events=args.events,
        host_blocks=args.host_blocks,
        host_gib=args.host_gib,
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
        failed fast and a fresh manager worked), 1 when a check failed, 2 for
        bad options or a ``--json``/``--log-json`` file that could not be
        written (one line on stderr naming the option and path).
    """
    from akv.obs.logging import configure_logging

    try:
        options = options_from_args(args)
    except ValueError as exc:
        return _usage_error(str(exc))
    configure_logging(level=args.log_level, json_path=args.log_json, json_level=args.log_json_level)
    log_failures = _watch_log_file()
    # Last resort against a hang inside a shielded call (a cancel scope cannot end it).
    faulthandler.dump_traceback_later(options.duration_s + 600, exit=True)
    try:
        with progress_bar(options.duration_s, enabled=options.progress) as progress:
            report = _run(options, progress)
    finally:
        faulthandler.cancel_dump_traceback_later()
    print_summary(report)
    if args.json_path is not None:
        try:
            args.json_path.write_text(json.dumps(report.as_json(), indent=2) + "\n")
        except OSError as exc:
            return _usage_error(f"argument --json: cannot write {str(args.json_path)!r}: {exc.strerror or exc}")
    if log_failures:
        exc = log_failures[0]
        return _usage_error(f"argument --log-json: cannot write {str(args.log_json)!r}: {exc.strerror or exc}")
    return 0 if report.ok else 1


def _usage_error(message: str) -> int:
    sys.stderr.write(f"akv stress: error: {message}\n")
    return 2


def _watch_log_file() -> list[OSError]:
    """Make a failing ``--log-json`` file record its first error and detach, instead of printing tracebacks.

    Returns:
        The list the error lands in (empty while every write succeeds).
    """
    failures: list[OSError] = []
    root = logging.getLogger("akv")
    for handler in root.handlers:
        if isinstance(handler, logging.FileHandler):

            def failed(record: logging.LogRecord, handler: logging.Handler = handler) -> None:
                exc = sys.exc_info()[1]
                failures.append(exc if isinstance(exc, OSError) else OSError(str(exc)))
                root.removeHandler(handler)

            handler.handleError = failed  # type: ignore[method-assign]
    return failures


def _run(options: StressOptions, progress: Callable[[float, Metrics], None] | None) -> StressReport:
    backend, backend_options = options.backend, {}
    if backend == "uvloop":
        backend, backend_options = "asyncio", {"use_uvloop": True}

    async def main() -> StressReport:
        return await run_stress(options, progress=progress)

    return run_async(main, backend=backend, **backend_options)
