"""``akv snapshot``: look into, check and make snapshot directories.

- ``akv snapshot info DIR [--json]``: what the current generation holds.
- ``akv snapshot verify DIR [--model NAME --block-size N --vocab-size N]``:
  every check a load makes (exit 0 valid; exit 2 with the cause in one line);
  with ``--model``, also that it was saved under that configuration.
- ``akv snapshot demo DIR --blocks N``: write a random valid snapshot (for
  trying the other two, and for tests).

Exit codes are those of :mod:`akv.cli`: a refused snapshot is a
:class:`~akv.errors.SnapshotError`, which ``akv`` reports as one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import time

from akv.argtypes import int_range
from akv.config import MAX_BLOCK_SIZE, MAX_VOCAB_SIZE, MODEL_SHAPES, KVCacheConfig, model_shape


def _add_config_options(parser: argparse.ArgumentParser, model_help: str, model_default: str | None) -> None:
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default=model_default, help=model_help)
    parser.add_argument(
        "--block-size", type=int_range(1, MAX_BLOCK_SIZE), default=16, help="tokens per block (default 16)"
    )
    parser.add_argument(
        "--vocab-size", type=int_range(1, MAX_VOCAB_SIZE), default=128_256, help="vocabulary size (default 128,256)"
    )


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``snapshot`` sub-command (with ``info``, ``verify``, ``demo``) to ``akv``'s sub-parsers.

    Returns:
        The new sub-parser (its ``command`` is ``"snapshot"``).
    """
    sp = sub.add_parser(
        "snapshot",
        help="inspect, verify or create a prefix-cache snapshot directory",
        description="Inspect, verify or create a prefix-cache snapshot directory (docs/persistence.md).",
    )
    actions = sp.add_subparsers(dest="snapshot_command", required=True)
    info = actions.add_parser("info", help="print what the current generation holds")
    info.add_argument("directory", help="snapshot directory")
    info.add_argument("--json", action="store_true", dest="as_json", help="print as JSON")
    verify = actions.add_parser("verify", help="check every file and checksum (exit 0 valid, 2 refused)")
    verify.add_argument("directory", help="snapshot directory")
    _add_config_options(verify, "also refuse a snapshot not saved under this model (with the sizes below)", None)
    demo = actions.add_parser("demo", help="write a random valid snapshot")
    demo.add_argument("directory", help="snapshot directory (created if absent)")
    demo.add_argument("--blocks", type=int_range(0, 1 << 24), default=1000, help="saved blocks (default 1000)")
    demo.add_argument("--storage", choices=("tensors", "none"), default="tensors", help="with K/V or metadata only")
    demo.add_argument("--seed", type=int_range(0, (1 << 32) - 1), default=0, help="seed (default 0)")
    _add_config_options(demo, "attention shape preset (default tiny)", "tiny")
    return sp


def _config(args: argparse.Namespace, storage: str = "none") -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=1,
        block_size=args.block_size,
        vocab_size=args.vocab_size,
        model=model_shape(args.model),
        storage=storage,
    )


def main_snapshot(args: argparse.Namespace) -> int:
    """Run ``akv snapshot ACTION`` from parsed options and print the result.

    Returns:
        0 (a refused snapshot raises instead).

    Raises:
        SnapshotError: The snapshot is refused or cannot be written (exit 2).
    """
    from akv.storage.snapshot_demo import save_demo_snapshot
    from akv.storage.snapshot_reader import snapshot_info, verify_snapshot

    if args.snapshot_command == "demo":
        generation = save_demo_snapshot(args.directory, _config(args, args.storage), args.blocks, args.seed)
        print(f"{args.directory}: wrote generation {generation} ({args.blocks} blocks)")
        return 0
    if args.snapshot_command == "verify":
        fingerprint = None if args.model is None else _config(args).fingerprint()
        verify_snapshot(args.directory, fingerprint)
        info = snapshot_info(args.directory)
        print(f"{args.directory}: valid, generation {info['generation']}, {info['num_blocks']} blocks")
        return 0
    info = snapshot_info(args.directory)
    if args.as_json:
        print(json.dumps(info, indent=2))
        return 0
    model = info["fingerprint"]["model"]
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["created_unix_s"]))
    print(f"{info['directory']}: generation {info['generation']}, created {created}")
    print(f"  {info['num_blocks']} blocks, storage {info['storage']}, {info['num_namespaces']} namespaces")
    print(
        f"  model {model['name']} ({model['num_layers']} layers, {model['num_kv_heads']} KV heads, "
        f"head dim {model['head_dim']}, {model['dtype']}), block size {info['fingerprint']['block_size']}"
    )
    print(f"  {info['bytes']:,} bytes in {len(info['files'])} files; generations present: {info['generations']}")
    return 0
