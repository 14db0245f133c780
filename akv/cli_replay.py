"""The ``akv replay`` command: its options, the pool they describe, the run and its outputs.

Wiring (in :mod:`akv.cli`): :func:`register` adds the sub-command and
:func:`main_replay` runs it. Every option is range-checked while parsing
(:mod:`akv.argtypes`); a trace record above ``--max-request-tokens`` is a
trace error before anything is allocated; a replay that could do nothing (an
empty trace, every request larger than a shard) raises
:class:`~akv.argtypes.UsageError` (exit 2) saying what to change.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path

from akv.argtypes import UsageError, float_range, input_path, int_range, log_level, output_path, png_path, write_output
from akv.cli_signals import run_async
from akv.config import MODEL_SHAPES, KVCacheConfig, model_shape
from akv.trace import MAX_REQUEST_TOKENS, TraceRequest

__all__ = ["MAX_BLOCK_SIZE", "MAX_LIMIT", "MAX_NUM_BLOCKS", "MAX_SHARDS", "main_replay", "register"]

#: Largest ``--num-blocks`` (also after ``--pool-gib``): about 40 bytes of metadata a block, 2.7 GB at this size.
MAX_NUM_BLOCKS = 1 << 26
#: Largest ``--shards`` (one actor each).
MAX_SHARDS = 1024
#: Largest ``--block-size`` (tokens per block).
MAX_BLOCK_SIZE = 1 << 16
#: Largest ``--limit`` (requests replayed).
MAX_LIMIT = 1 << 40


def _add_logging_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-json", type=output_path, help="write structured logs as JSON lines to this path")
    parser.add_argument(
        "--log-level", type=log_level, default="warning", help="console log level only (default warning)"
    )
    parser.add_argument(
        "--log-json-level", type=log_level, default="debug", help="level of the --log-json file (default debug)"
    )


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``replay`` sub-command to ``akv``'s sub-parsers.

    Returns:
        The new sub-parser (its ``command`` is ``"replay"``).
    """
    rp = sub.add_parser(
        "replay",
        help="replay a Mooncake request trace through the KV cache manager",
        description=(
            "Replay a Mooncake JSONL request trace through a continuous-batching scheduler "
            "driving a KVCacheManager. With no TRACE, replays the first 3,000 requests of the "
            "Mooncake conversation trace shipped inside the package."
        ),
    )
    rp.add_argument("trace", nargs="?", type=input_path, help="Mooncake JSONL trace (.jsonl or .jsonl.gz)")
    rp.add_argument(
        "--limit", type=int_range(1, MAX_LIMIT), help=f"replay only the first N requests, 1 to {MAX_LIMIT:,}"
    )
    rp.add_argument(
        "--start",
        type=int_range(0, MAX_LIMIT),
        default=0,
        help="skip the first N requests of the trace (--limit counts from there; default 0)",
    )
    rp.add_argument(
        "--block-size",
        type=int_range(1, MAX_BLOCK_SIZE),
        default=16,
        help=f"tokens per block, 1 to {MAX_BLOCK_SIZE:,} (default 16)",
    )
    size = rp.add_mutually_exclusive_group()
    size.add_argument(
        "--num-blocks", type=int_range(1, MAX_NUM_BLOCKS), help=f"blocks in the pool, 1 to {MAX_NUM_BLOCKS:,}"
    )
    size.add_argument(
        "--pool-gib", type=float_range(0.0, None, min_open=True), help="pool size in GiB (blocks = GiB / block bytes)"
    )
    host = rp.add_mutually_exclusive_group()
    host.add_argument(
        "--host-blocks",
        type=int_range(0, MAX_NUM_BLOCKS),
        default=0,
        help="blocks of the host-memory tier (default 0: none; see docs/host_tier.md)",
    )
    host.add_argument(
        "--host-gib", type=float_range(0.0, None, min_open=True), help="host tier size in GiB instead of --host-blocks"
    )
    rp.add_argument(
        "--copy-thread",
        action="store_true",
        help="with CPU tensors, run the host tier's copies on a worker thread, not in a child process",
    )
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
    rp.add_argument("--max-batch", type=int_range(1), default=256, help="running sequences at most (default 256)")
    rp.add_argument(
        "--step-ms",
        type=float_range(0.0, None, min_open=True),
        default=20.0,
        help="simulated ms per decode step (default 20)",
    )
    rp.add_argument(
        "--max-output-tokens", type=int_range(1, MAX_REQUEST_TOKENS), help="cap each request's output length"
    )
    rp.add_argument(
        "--max-request-tokens",
        type=int_range(1, 1 << 31),
        default=MAX_REQUEST_TOKENS,
        help=f"a trace record with more input + output tokens is a trace error (default {MAX_REQUEST_TOKENS:,})",
    )
    rp.add_argument(
        "--shards", type=int_range(1, MAX_SHARDS), default=1, help=f"pool shards, 1 to {MAX_SHARDS:,} (default 1)"
    )
    rp.add_argument(
        "--seed", type=int_range(0, (1 << 64) - 1), default=0, help="seed of the synthesized token ids (default 0)"
    )
    rp.add_argument("--json", type=output_path, dest="json_path", help="write the report as JSON to this path")
    rp.add_argument(
        "--events-out",
        type=output_path,
        help="write the cache event batches as JSON lines to this path (turns events on; see docs/events.md)",
    )
    rp.add_argument(
        "--requests-out",
        type=output_path,
        help="write one JSON line per request: its index in the trace, prompt tokens, cached tokens",
    )
    rp.add_argument(
        "--warm-start",
        type=input_path,
        metavar="DIR",
        help="load this snapshot directory before the first request (a refused snapshot is exit 2)",
    )
    rp.add_argument(
        "--save-snapshot", type=input_path, metavar="DIR", help="save a snapshot to this directory after the replay"
    )
    _add_logging_options(rp)
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")
    rp.add_argument(
        "--metrics-out", type=output_path, help="write the final metrics in the Prometheus text format to this path"
    )
    rp.add_argument(
        "--metrics-port",
        type=int_range(0, 65535),
        help="serve the metrics on http://ADDR:PORT/metrics during the run (0: any free port, printed)",
    )
    rp.add_argument("--metrics-addr", default="127.0.0.1", help="address of --metrics-port (default 127.0.0.1)")
    rp.add_argument(
        "--plot", type=png_path, help="write a PNG: pool by state, hit rate, evictions, preemptions (needs matplotlib)"
    )
    return rp


def _replay_config(args: argparse.Namespace) -> KVCacheConfig:
    shape = model_shape(args.model)
    storage = args.storage or ("cpu" if args.model == "tiny" else "none")
    block_bytes = shape.bytes_per_block(args.block_size)
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
    elif args.pool_gib is not None:
        num_blocks = int(args.pool_gib * 2**30 // block_bytes)
        if not 1 <= num_blocks <= MAX_NUM_BLOCKS:
            raise UsageError(
                f"--pool-gib {args.pool_gib:g} holds {num_blocks:,} blocks of {block_bytes:,} bytes; "
                f"it must hold 1 to {MAX_NUM_BLOCKS:,}"
            )
    else:
        num_blocks = 32_768 if storage != "none" or args.model == "tiny" else int(64 * 2**30 // block_bytes)
    host_blocks = args.host_blocks if args.host_gib is None else int(args.host_gib * 2**30 // block_bytes)
    if args.host_gib is not None and not 1 <= host_blocks <= MAX_NUM_BLOCKS:
        raise UsageError(
            f"--host-gib {args.host_gib:g} holds {host_blocks:,} blocks of {block_bytes:,} bytes; "
            f"it must hold 1 to {MAX_NUM_BLOCKS:,}"
        )
    if args.copy_thread and (storage == "none" or not host_blocks):
        raise UsageError(
            "--copy-thread needs a host tier with tensors (--host-blocks or --host-gib, not --storage none)"
        )
    if host_blocks and host_blocks < args.shards:
        raise UsageError(f"a host tier of {host_blocks:,} blocks cannot be split over {args.shards:,} shards")
    if storage != "none":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host_bytes = host_blocks * block_bytes
        device_bytes = num_blocks * block_bytes if storage == "cpu" else 0
        if device_bytes + host_bytes > memory // 2:
            raise UsageError(
                f"a pool of {num_blocks:,} blocks and a host tier of {host_blocks:,} blocks x {block_bytes:,} bytes "
                f"({(device_bytes + host_bytes) / 2**30:,.1f} GiB of host memory) exceeds half of this machine's "
                f"memory ({memory / 2**30:,.1f} GiB); pass smaller sizes, or --storage none to simulate without tensors"
            )
    if args.shards > num_blocks:
        raise UsageError(f"--shards {args.shards:,} exceeds the {num_blocks:,} blocks of the pool")
    return KVCacheConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        model=shape,
        storage="none" if storage == "none" else "tensors",
        device=storage if storage != "none" else "cpu",
        num_shards=args.shards,
        enable_events=args.events_out is not None,
        host_blocks=host_blocks,
        copy_process=not args.copy_thread,
    )


def _too_large_hint(config: KVCacheConfig) -> str:
    shard_blocks = config.num_blocks // config.num_shards
    return (
        f"a shard holds {shard_blocks:,} blocks of {config.block_size} tokens "
        f"({config.num_blocks:,} blocks / {config.num_shards:,} shards); "
        "pass a larger --num-blocks or --pool-gib, or fewer --shards"
    )


def _check_requests(requests: list[TraceRequest], path: Path, config: KVCacheConfig) -> None:
    """Refuse, before anything is allocated, a replay that could do nothing."""
    if not requests:
        raise UsageError(f"{path}: the trace holds no request; nothing to replay")
    shard_blocks = config.num_blocks // config.num_shards
    smallest = min(-(-r.input_length // config.block_size) for r in requests)
    if smallest > shard_blocks:
        raise UsageError(
            f"every one of the {len(requests):,} requests would be dropped: the smallest prompt needs "
            f"{smallest:,} blocks but {_too_large_hint(config)}"
        )


def _serve_metrics(kv: object, args: argparse.Namespace) -> ExitStack:
    """Start the ``--metrics-port`` server (if asked) and say where it listens."""
    from akv.obs.export import serve_metrics

    stack = ExitStack()
    if args.metrics_port is None:
        return stack
    try:
        port = stack.enter_context(serve_metrics(kv.metrics_registry, args.metrics_port, addr=args.metrics_addr))
    except OSError as exc:
        raise UsageError(f"cannot serve metrics on {args.metrics_addr}:{args.metrics_port}: {exc}") from None
    host = f"[{args.metrics_addr}]" if ":" in args.metrics_addr else args.metrics_addr  # an IPv6 address
    print(f"akv: serving metrics on http://{host}:{port}/metrics", file=sys.stderr)
    return stack


def _requests_lines(report: object, requests: list[TraceRequest]) -> str:
    """``--requests-out``: one JSON line per request, in trace order."""
    lines = []
    for req, cached, admitted in zip(
        requests, report.cached_tokens_per_request, report.admitted_unix_s_per_request, strict=True
    ):
        line = {"index": req.index, "prompt_tokens": req.input_length, "cached_tokens": cached}
        lines.append(json.dumps({**line, "admitted_unix_s": admitted}) + "\n")
    return "".join(lines)


def _write_outputs(
    args: argparse.Namespace,
    report: object,
    config: KVCacheConfig,
    path: Path,
    registry: object,
    requests: list[TraceRequest],
) -> None:
    """The summary and the output files, the JSON report first: a failed plot never loses it."""
    from akv.obs.export import metrics_text
    from akv.replay.report import print_summary

    print_summary(report, config, path)
    if args.json_path is not None:
        data = report.as_json()
        data.update(
            trace=str(path),
            model=config.model.name,
            storage=config.storage,
            pool_bytes=config.pool_bytes,
            bytes_per_block=config.bytes_per_block,
        )
        write_output("--json", args.json_path, json.dumps(data, indent=2) + "\n")
    if args.requests_out is not None:
        write_output("--requests-out", args.requests_out, _requests_lines(report, requests))
    if args.metrics_out is not None:
        write_output("--metrics-out", args.metrics_out, metrics_text(registry))
    if args.plot is not None:
        from akv.obs.plot import plot_replay

        try:
            plot_replay(report.timeline, args.plot)
        except OSError as exc:
            raise UsageError(f"--plot {str(args.plot)!r}: cannot write: {exc.strerror or exc}") from None


def main_replay(args: argparse.Namespace) -> int:
    """Run ``akv replay`` from parsed options; print the summary; return the exit code (0).

    Raises:
        TraceError: The trace is missing or a record is malformed (exit 2).
        UsageError: The options describe no usable pool, or the replay could do
            nothing: an empty trace, every request larger than a shard (exit 2).
        InvalidInput: The configuration is refused (exit 2).
        SnapshotError: ``--warm-start`` names a refused snapshot, or
            ``--save-snapshot`` cannot write (exit 2, with the cause).
    """
    from akv.manager import KVCacheManager
    from akv.replay import ReplayOptions, replay
    from akv.replay.events_out import replay_with_events
    from akv.replay.report import progress_bar
    from akv.trace import default_trace_path, read_trace

    path = args.trace or default_trace_path()
    limit = None if args.limit is None else args.start + args.limit
    requests = read_trace(path, limit=limit, max_request_tokens=args.max_request_tokens)[args.start :]
    config = _replay_config(args)
    _check_requests(requests, path, config)
    options = ReplayOptions(
        max_batch=args.max_batch,
        step_ms=args.step_ms,
        max_output_tokens=args.max_output_tokens,
        seed=args.seed,
        want_metadata=config.storage != "none",
        timeline_every_steps=10 if args.plot is not None else 0,
    )
    kv = KVCacheManager(config)

    async def run() -> object:
        async with kv:
            loaded = await kv.load_snapshot(args.warm_start) if args.warm_start is not None else None
            with progress_bar(len(requests), enabled=not args.no_progress) as progress:
                if args.events_out is None:
                    report = await replay(kv, requests, options, progress=progress)
                else:
                    report, report.final_cached_blocks, _ = await replay_with_events(
                        kv, lambda: replay(kv, requests, options, progress=progress), args.events_out
                    )
            if loaded is not None:
                report.warm_start_blocks, report.warm_start_s = loaded.loaded_blocks, loaded.seconds
            if args.save_snapshot is not None:
                await kv.save_snapshot(args.save_snapshot)
            return report

    with _serve_metrics(kv, args):
        report = run_async(run)
    _write_outputs(args, report, config, path, kv.metrics_registry, requests)
    if report.requests_rejected and not report.requests_finished:
        raise UsageError(
            f"no request finished: all {report.requests_rejected:,} were dropped, each needing more blocks "
            f"than a shard holds; {_too_large_hint(config)}"
        )
    if report.requests_rejected:
        print(
            f"akv: note: {report.requests_rejected:,} of {report.requests:,} requests were dropped, each needing "
            f"more blocks than a shard holds; {_too_large_hint(config)}",
            file=sys.stderr,
        )
    return 0
