"""The ``akv`` command line: ``akv replay`` (the main job) and friends.

This is an application, so it configures logging (library code never does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import anyio

from akv.config import MODEL_SHAPES, KVCacheConfig, model_shape
from akv.errors import ActorCrashed, AkvError, TraceError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _output_path(text: str) -> Path:
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    if not path.parent.exists():
        raise argparse.ArgumentTypeError(f"directory {str(path.parent)!r} does not exist")
    return path


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="akv", description="Paged KV cache manager for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    rp = sub.add_parser(
        "replay",
        help="replay a Mooncake request trace through the KV cache manager",
        description=(
            "Replay a Mooncake JSONL request trace through a continuous-batching scheduler "
            "driving a KVCacheManager. With no TRACE, replays the first 3,000 requests of the "
            "Mooncake conversation trace shipped inside the package."
        ),
    )
    rp.add_argument("trace", nargs="?", type=Path, help="Mooncake JSONL trace (.jsonl or .jsonl.gz)")
    rp.add_argument("--limit", type=_positive_int, help="replay only the first N requests")
    rp.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (default 16)")
    size = rp.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=_positive_int, help="blocks in the pool")
    size.add_argument("--pool-gib", type=_positive_float, help="pool size in GiB (blocks = GiB / bytes per block)")
    rp.add_argument(
        "--model",
        default="tiny",
        choices=sorted(MODEL_SHAPES),
        help="attention shape preset (default tiny: real CPU tensors; real shapes suit --storage none)",
    )
    rp.add_argument(
        "--storage",
        choices=("none", "cpu", "cuda"),
        default=None,
        help="where K/V tensors live: none = metadata only (default: cpu for tiny, none otherwise)",
    )
    rp.add_argument("--max-batch", type=_positive_int, default=256, help="running sequences at most (default 256)")
    rp.add_argument("--step-ms", type=_positive_float, default=20.0, help="simulated ms per decode step (default 20)")
    rp.add_argument("--max-output-tokens", type=int, default=None, help="cap each request's output length")
    rp.add_argument("--shards", type=_positive_int, default=1, help="pool shards (default 1)")
    rp.add_argument("--seed", type=int, default=0, help="seed of the synthesized token ids (default 0)")
    rp.add_argument("--json", type=_output_path, dest="json_path", help="write the report as JSON to this path")
    rp.add_argument("--log-json", type=Path, help="write structured logs as JSON lines to this path")
    rp.add_argument("--log-level", default="warning", help="console log level (default warning)")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")
    rp.add_argument(
        "--metrics-out", type=Path, help="write the final metrics in the Prometheus text format to this path"
    )
    rp.add_argument(
        "--metrics-port", type=int, help="serve the metrics on http://ADDR:PORT/metrics during the run (0: any port)"
    )
    rp.add_argument(
        "--plot", type=Path, help="write a PNG: pool by state, hit rate, evictions, preemptions (needs matplotlib)"
    )
    rp.add_argument("--metrics-addr", default="127.0.0.1", help="address of --metrics-port (default 127.0.0.1)")

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
        type=Path,
        help="JSON-lines log (unreadable lines, e.g. a crashed run's truncated last one, are skipped and listed)",
    )
    ip.add_argument("--seq", help="print every event naming this sequence id")
    ip.add_argument("--plot", type=Path, help="write a PNG timeline of the eviction batches (needs matplotlib)")
    ip.add_argument("--json", action="store_true", dest="as_json", help="print the summary as JSON")

    from akv.generate import register as register_generate
    from akv.stress import register as register_stress

    register_stress(sub)
    register_generate(sub)
    return parser


def _configure_logging(level: str, log_json: Path | None) -> object:
    """Send structlog events to the console (at ``level``) and, optionally, a JSON-lines file."""
    from akv.obs.logging import configure_logging

    return configure_logging(level=level, json_path=log_json)


def _replay_config(args: argparse.Namespace) -> KVCacheConfig:
    shape = model_shape(args.model)
    storage = args.storage or ("cpu" if args.model == "tiny" else "none")
    block_bytes = shape.bytes_per_block(args.block_size)
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
    elif args.pool_gib is not None:
        if args.pool_gib <= 0:
            raise ValueError("--pool-gib must be positive")
        num_blocks = int(args.pool_gib * 2**30 // block_bytes)
    else:
        num_blocks = 32_768 if storage != "none" or args.model == "tiny" else int(64 * 2**30 // block_bytes)
    if num_blocks < 1:
        raise ValueError(f"the pool holds no block of {block_bytes} bytes")
    if storage == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if num_blocks * block_bytes > memory // 2:
            raise ValueError(
                f"a pool of {num_blocks:,} blocks x {block_bytes:,} bytes ({num_blocks * block_bytes / 2**30:,.1f} GiB) "
                f"of CPU tensors exceeds half of this machine's memory ({memory / 2**30:,.1f} GiB); "
                "pass a smaller --num-blocks or --pool-gib, or --storage none to simulate without tensors"
            )
    return KVCacheConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        model=shape,
        storage="none" if storage == "none" else "tensors",
        device=storage if storage != "none" else "cpu",
        num_shards=args.shards,
    )


def _cmd_replay(args: argparse.Namespace) -> int:
    from akv.manager import KVCacheManager
    from akv.replay import ReplayOptions, replay
    from akv.replay.report import print_summary
    from akv.trace import default_trace_path, read_trace

    path = args.trace or default_trace_path()
    requests = read_trace(path, limit=args.limit)
    config = _replay_config(args)
    options = ReplayOptions(
        max_batch=args.max_batch,
        step_ms=args.step_ms,
        max_output_tokens=args.max_output_tokens,
        seed=args.seed,
        want_metadata=config.storage != "none",
        timeline_every_steps=10 if args.plot is not None else 0,
    )

    from contextlib import nullcontext

    from akv.obs.export import serve_metrics, write_metrics

    kv = KVCacheManager(config)

    async def run() -> object:
        async with kv:
            from akv.replay.report import progress_bar

            with progress_bar(len(requests), enabled=not args.no_progress) as progress:
                return await replay(kv, requests, options, progress=progress)

    serving = (
        serve_metrics(kv.metrics_registry, args.metrics_port, addr=args.metrics_addr)
        if args.metrics_port is not None
        else nullcontext()
    )
    with serving:
        report = anyio.run(run)
    if args.metrics_out is not None:
        write_metrics(kv.metrics_registry, args.metrics_out)
    if args.plot is not None:
        from akv.obs.plot import plot_replay

        plot_replay(report.timeline, args.plot)
    print_summary(report, config, path)
    if report.requests_rejected:
        print(
            f"akv: note: {report.requests_rejected:,} requests were dropped: each needs more blocks than a "
            f"shard holds ({config.num_blocks // config.num_shards:,})",
            file=sys.stderr,
        )
    if args.json_path is not None:
        data = report.as_json()
        data.update(
            trace=str(path),
            model=config.model.name,
            storage=config.storage,
            pool_bytes=config.pool_bytes,
            bytes_per_block=config.bytes_per_block,
        )
        args.json_path.write_text(json.dumps(data, indent=2) + "\n")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from akv.obs.inspect import eviction_bursts, read_log, sequence_history, summarize

    log = read_log(args.logfile)
    if args.seq is not None:
        history = sequence_history(log, args.seq)
        for event in history:
            print(json.dumps(event, default=str))
        if not history:
            print(f"akv: no event names sequence {args.seq!r}", file=sys.stderr)
            return 1
        return 0
    summary = summarize(log)
    bursts = eviction_bursts(log)
    if args.plot is not None:
        from akv.obs.plot import plot_log

        plot_log(log, args.plot)
    if args.as_json:
        print(json.dumps({**summary, "eviction_bursts": bursts}, indent=2, default=str))
        return 0
    print(f"{args.logfile}: {len(log.events)} events, {len(log.bad_lines)} unreadable lines {log.bad_lines[:5]}")
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
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``akv`` command. Returns the exit code (0 ok, 2 bad input)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        _configure_logging(getattr(args, "log_level", "warning"), getattr(args, "log_json", None))
        if args.command == "replay":
            return _cmd_replay(args)
        if args.command == "inspect":
            return _cmd_inspect(args)
        if args.command == "stress":
            from akv.stress import main_stress

            return main_stress(args)
        if args.command == "generate":
            from akv.generate import main_generate

            return main_generate(args)
    except TraceError as exc:
        print(f"akv: error: {exc}", file=sys.stderr)
        return 2
    except ActorCrashed as exc:
        print(f"akv: internal error, the manager failed: {exc}", file=sys.stderr)
        return 1
    except (AkvError, ValueError, OSError) as exc:
        print(f"akv: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
