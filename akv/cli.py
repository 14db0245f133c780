"""The ``akv`` command line: ``akv replay`` (the main job) and friends.

This is an application, so it configures logging (library code never does).
Exit codes: 0 the command did its work, 1 an unexpected error (one line on
stderr; ``akv --debug ...`` prints the traceback), 2 bad input (a bad option,
a malformed trace, a run that could do nothing, an output that cannot be
written), 130 interrupted (SIGINT), 143 terminated (SIGTERM: the manager shuts
down as on Ctrl-C, saving its snapshot if asked to), 141 stdout closed early
(``akv inspect LOG | head``: no message, as a process killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from akv.argtypes import UsageError, input_path, png_path
from akv.cli_signals import on_sigterm, terminated
from akv.errors import ActorCrashed, AkvError


def _add_inspect_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ip = sub.add_parser(
        "inspect",
        help="summarize a JSON-lines log written with --log-json",
        description=(
            "Summarize a JSON-lines log: events by name and level, errors with their sequences, "
            "eviction bursts; --seq ID prints one sequence's history; --plot PATH draws the timeline."
        ),
    )
    ip.add_argument(
        "logfile",
        type=input_path,
        help="JSON-lines log, .jsonl or .jsonl.gz (unreadable lines, e.g. a crashed run's truncated last one, are skipped and listed)",
    )
    ip.add_argument("--seq", help="print every event naming this sequence id")
    ip.add_argument("--plot", type=png_path, help="write a PNG timeline of the eviction batches (needs matplotlib)")
    ip.add_argument("--json", action="store_true", dest="as_json", help="print the summary as JSON")
    return ip


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="akv", description="Paged KV cache manager for LLM inference.")
    debug = {"action": "store_true", "help": "print the traceback of an unexpected error"}
    parser.add_argument("--debug", **debug)
    sub = parser.add_subparsers(dest="command", required=True)

    from akv.cli_replay import register as register_replay
    from akv.cli_snapshot import register as register_snapshot
    from akv.generate import register as register_generate
    from akv.stress import register as register_stress

    commands = [
        register_replay(sub),
        _add_inspect_parser(sub),
        register_stress(sub),
        register_generate(sub),
        register_snapshot(sub),
    ]
    for command in commands:  # also after the command name; SUPPRESS keeps the global value
        if "--debug" not in command._option_string_actions:
            command.add_argument("--debug", **debug, default=argparse.SUPPRESS)
    return parser


def _configure_logging(args: argparse.Namespace) -> None:
    """Console at ``--log-level``; the ``--log-json`` file (if any) at ``--log-json-level``."""
    from akv.obs.logging import configure_logging

    try:
        configure_logging(
            level=getattr(args, "log_level", "warning"),
            json_path=getattr(args, "log_json", None),
            json_level=getattr(args, "log_json_level", "debug"),
            tracebacks=getattr(args, "debug", False),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _cmd_inspect(args: argparse.Namespace) -> int:
    from akv.obs.inspect import eviction_bursts, read_log, sequence_history, summarize

    log = read_log(args.logfile)
    if not log.events:
        raise UsageError(
            f"{args.logfile}: no event could be read ({len(log.bad_lines)} unreadable lines); "
            "give a JSON-lines log written with --log-json"
        )
    if args.seq is not None:
        history = sequence_history(log, args.seq)
        if not history:
            raise UsageError(f"no event names sequence {args.seq!r} (is the log at --log-json-level debug?)")
        for event in history:
            print(json.dumps(event, default=str))
        return 0
    summary = summarize(log)
    bursts = eviction_bursts(log)
    if args.plot is not None:
        from akv.obs.plot import plot_log

        plot_log(log, args.plot)
    if args.as_json:
        print(json.dumps({**summary, "eviction_bursts": bursts}, indent=2, default=str))
        return 0
    _print_inspect(args.logfile, log, summary, bursts)
    return 0


def _print_inspect(path: Path, log: object, summary: dict, bursts: list[dict]) -> None:
    print(f"{path}: {len(log.events)} events, {len(log.bad_lines)} unreadable lines {log.bad_lines[:5]}")
    print("by level: " + ", ".join(f"{k}={v}" for k, v in summary["levels"].items()))
    print("by event:")
    for name, n in summary["events"].items():
        print(f"  {n:>8}  {name}")
    print(f"errors: {len(summary['errors'])}")
    for event in summary["errors"][:20]:
        who = event.get("seq_id") or event.get("actor") or ""
        print(f"  {event.get('timestamp', '?')}  {event['event']}  {who}  {event.get('error', '')}")
    print(f"eviction bursts: {len(bursts)}")
    for b in bursts[:20]:
        print(
            f"  {b['start']}  {b['batches']} batches, {b['blocks']} blocks in {b['duration_s']} s, "
            f"usage {b['usage_before']} -> {b['usage_after']}, shards {b['shards']}"
        )
    for run in summary["runs"]:
        keys = ("requests_finished", "hit_rate", "preemptions", "evictions", "ok", "operations")
        print(f"{run['event']}: " + ", ".join(f"{k}={run[k]}" for k in keys if k in run))


def _run_command(args: argparse.Namespace) -> int:
    if args.command == "replay":
        from akv.cli_replay import main_replay

        return main_replay(args)
    if args.command == "inspect":
        return _cmd_inspect(args)
    if args.command == "stress":
        from akv.stress import main_stress

        return main_stress(args)
    if args.command == "snapshot":
        from akv.cli_snapshot import main_snapshot

        return main_snapshot(args)
    from akv.generate import main_generate

    return main_generate(args)


def _describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, looking through exception groups of one."""
    exc = _innermost(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``akv`` command.

    Args:
        argv: Arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code: 0 done, 1 an unexpected error or a crashed manager
        (one line on stderr; with ``--debug`` also the traceback), 2 bad
        input (options, trace, files, a run that could do nothing, an output
        or the --log-json file that could not be written), 130 interrupted,
        143 terminated (SIGTERM, handled while ``main`` runs in the main
        thread), 141 stdout closed early (no message).

    Raises:
        SystemExit: From argparse (exit 2) on a bad option, or for ``--help``.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    if clash := _same_file(args):  # before the log file is opened: it would truncate the other one
        print(f"akv {args.command}: error: {clash}", file=sys.stderr)
        return 2
    terminated.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        _configure_logging(args)
        code = _run_command(args)
        _check_log_file()
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except SystemExit as exc:
        if isinstance(exc.__context__, BrokenPipeError):  # rich's console exits 1 on a closed stdout
            return 141
        raise
    except BaseException as exc:  # the one place that turns any error into one line and an exit code
        if _innermost(exc).__class__ is BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
            return 141
        code, line = _exit_for(exc, debug=args.debug, prog=f"akv {args.command}")
        if args.debug:
            traceback.print_exception(exc)
        print(line, file=sys.stderr)
        return code
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


#: Path arguments of every command, by argparse ``dest``, with the name an error gives them.
_PATH_ARGS = (
    ("trace", "the trace"),
    ("logfile", "the log"),
    ("json_path", "--json"),
    ("metrics_out", "--metrics-out"),
    ("log_json", "--log-json"),
    ("plot", "--plot"),
    ("events_out", "--events-out"),
    ("requests_out", "--requests-out"),
)


def _same_file(args: argparse.Namespace) -> str | None:
    """A message if two path arguments name one file (an output would overwrite an input or another output)."""
    seen: dict[str, str] = {}
    for dest, name in _PATH_ARGS:
        path = getattr(args, dest, None)
        if path is None:
            continue
        key = os.path.realpath(path)
        if key in seen:
            return f"{seen[key]} and {name} name the same file {str(path)!r}: give each its own path"
        seen[key] = name
    return None


def _check_log_file() -> None:
    from akv.obs.logging import log_file_error

    if (failed := log_file_error()) is not None:
        path, exc = failed
        raise UsageError(f"--log-json {path!r}: cannot write: {exc.strerror or exc}")


def _innermost(exc: BaseException) -> BaseException:
    while len(inner := getattr(exc, "exceptions", ())) == 1 and isinstance(inner[0], BaseException):
        exc = inner[0]
    return exc


def _exit_for(exc: BaseException, *, debug: bool, prog: str) -> tuple[int, str]:
    """The exit code and the one stderr line (``prog: error: ...``) for an exception that ended a command."""
    if isinstance(exc, (UsageError, OSError)):
        return 2, f"{prog}: error: {exc}"
    if isinstance(exc, ActorCrashed):
        return 1, f"{prog}: internal error, the manager failed: {exc}"
    if isinstance(exc, AkvError):
        return 2, f"{prog}: error: {exc}"
    if isinstance(exc, KeyboardInterrupt) or (
        terminated.is_set() and isinstance(_innermost(exc), asyncio.CancelledError)
    ):
        return (143, f"{prog}: terminated") if terminated.is_set() else (130, f"{prog}: interrupted")
    hint = "" if debug else " (run with --debug for the traceback)"
    return 1, f"{prog}: error: unexpected {_describe(exc)}{hint}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
