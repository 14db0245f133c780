"""The ``akv generate`` command: a tiny seeded transformer decoding through the paged cache.

``akv generate --check`` runs greedy decoding (cold and with prefix-cache
hits), beam search and parallel sampling through a
:class:`~akv.manager.KVCacheManager` and through a dense per-sequence KV cache,
prints a comparison table and exits 0 only if every check matches (tokens
equal, logits or beam scores within tolerance, the expected prefix hits,
copy-on-write copies, shared blocks and no leaked block). Without
``--check`` it prints what the paged runs generated.

Wiring (in :mod:`akv.cli`): ``register(subparsers)`` adds the sub-command and
``main_generate(args)`` runs it and returns the exit code. Importing this
module is cheap (argparse and rich); torch and the manager load when the
command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from akv.argtypes import float_range, int_range, log_level
from akv.cli_signals import run_async

if TYPE_CHECKING:
    from akv.testing.equivalence import CheckResult

__all__ = ["main_generate", "register"]


#: Largest ``--steps`` and ``--prompt-len`` (the dense reference attends over all tokens).
MAX_TOKENS = 4096
#: Largest ``--beam-width`` and ``--samples``.
MAX_WIDTH = 64


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``generate`` sub-command to ``akv``'s sub-parsers.

    Returns:
        The new sub-parser (its ``command`` is ``"generate"``).
    """
    gp = subparsers.add_parser(
        "generate",
        help="decode with a tiny seeded transformer through the paged cache (--check: compare with a dense cache)",
        description=(
            "Run greedy decoding, beam search and parallel sampling with a tiny seeded random "
            "transformer whose attention reads K/V through the KV cache manager's block tables. "
            "With --check, run the same through a dense per-sequence KV cache, print a comparison "
            "and exit non-zero on any mismatch."
        ),
    )
    gp.add_argument("--check", action="store_true", help="compare with the dense-cache reference; exit 1 on mismatch")
    gp.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device of weights and K/V (default cpu)")
    gp.add_argument(
        "--seed", type=int_range(0, (1 << 63) - 1), default=0, help="seed of weights, prompts and samplers (default 0)"
    )
    gp.add_argument(
        "--steps", type=int_range(1, MAX_TOKENS), default=32, help="tokens generated per sequence (default 32)"
    )
    gp.add_argument("--beam-width", type=int_range(1, MAX_WIDTH), default=4, help="beams kept per step (default 4)")
    gp.add_argument("--samples", type=int_range(1, MAX_WIDTH), default=4, help="parallel samples n (default 4)")
    gp.add_argument("--block-size", type=int_range(1, MAX_TOKENS), default=4, help="tokens per block (default 4)")
    gp.add_argument("--prompt-len", type=int_range(1, MAX_TOKENS), default=21, help="prompt tokens (default 21)")
    gp.add_argument(
        "--tolerance", type=float_range(0.0), default=1e-4, help="max |logit| or |score| difference (default 1e-4)"
    )
    gp.add_argument(
        "--threads",
        type=int_range(1, 1024),
        default=1,
        help="torch intra-op threads while running (default 1: the model is tiny, more threads only add sync)",
    )
    gp.add_argument("--log-level", type=log_level, default="warning", help="console log level (default warning)")
    return gp


def main_generate(args: argparse.Namespace, console: Console | None = None) -> int:
    """Run ``akv generate``; return the exit code (0 all matched, 1 a mismatch, 2 bad input).

    Args:
        args: Parsed options of the sub-parser made by :func:`register`.
        console: Where to print (default: a new rich console on stdout).
    """
    import torch

    console = console or Console()
    if args.device == "cuda" and not torch.cuda.is_available():
        console.print("akv generate: error: --device cuda but no CUDA device is available")
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.check:
            results = run_async(_run_checks, args)
        else:
            rows = run_async(_run_paged, args)
    finally:
        torch.set_num_threads(threads)
    if args.check:
        print_comparison(results, args, console)
        return 0 if all(r.passed for r in results) else 1
    print_generations(rows, args, console)
    return 0


async def _run_checks(args: argparse.Namespace) -> list[CheckResult]:
    from akv.testing.equivalence import run_equivalence_checks

    return await run_equivalence_checks(
        device=args.device,
        seed=args.seed,
        steps=args.steps,
        beam_width=args.beam_width,
        samples=args.samples,
        block_size=args.block_size,
        prompt_len=args.prompt_len,
        tolerance=args.tolerance,
    )


async def _run_paged(args: argparse.Namespace) -> list[tuple[str, Sequence[int], float | None]]:
    from akv.manager import KVCacheManager
    from akv.testing.equivalence import make_prompt
    from akv.testing.generation import beam_search_paged, greedy_paged, sample_paged
    from akv.testing.model import TinyLM, TinyLMConfig

    cfg = TinyLMConfig(seed=args.seed)
    model = TinyLM(cfg, device=args.device)
    prompt = make_prompt(args.prompt_len, vocab_size=cfg.vocab_size, seed=args.seed + 1)
    width = max(args.beam_width, args.samples)
    num_blocks = 8 * width * -(-(args.prompt_len + args.steps + 16) // args.block_size)
    rows: list[tuple[str, Sequence[int], float | None]] = [("prompt", prompt, None)]
    kv_config = cfg.kv_cache_config(num_blocks=num_blocks, block_size=args.block_size, device=args.device)
    async with KVCacheManager(kv_config) as kv:
        greedy = await greedy_paged(kv, model, {"greedy": prompt}, max_new_tokens=args.steps)
        rows.append(("greedy", greedy["greedy"].tokens, None))
        beams = await beam_search_paged(kv, model, prompt, beam_width=args.beam_width, num_steps=args.steps)
        rows += [(f"beam {i}", b.tokens, b.score) for i, b in enumerate(beams.beams)]
        samples = await sample_paged(
            kv, model, prompt, num_samples=args.samples, max_new_tokens=args.steps, seed=args.seed
        )
        rows += [(f"sample {i}", s.tokens, None) for i, s in enumerate(samples)]
    return rows


def print_comparison(results: Sequence[CheckResult], args: argparse.Namespace, console: Console) -> None:
    """Print the paged-vs-dense comparison table and a one-line verdict."""
    table = Table(
        title=f"paged (akv) vs dense KV cache: {args.device}, seed {args.seed}, {args.steps} steps, block size "
        f"{args.block_size}"
    )
    table.add_column("check")
    table.add_column("seqs", justify="right")
    table.add_column("tokens")
    table.add_column("max |Δ|", justify="right")
    table.add_column("cache")
    table.add_column("leaks")
    table.add_column("result")
    leaks = {None: "-", True: "none", False: "[red]LEAK[/red]"}
    for r in results:
        table.add_row(
            r.name,
            str(r.sequences),
            "same" if r.tokens_equal else "[red]DIFFER[/red]",
            f"{r.max_abs_diff:.1e} {r.diff_of}",
            r.cache_note if r.cache_ok else f"[red]{r.cache_note}[/red]",
            leaks[r.leak_free],
            "[green]match[/green]" if r.passed else "[red]MISMATCH[/red]",
        )
    console.print(table)
    failed = [r.name for r in results if not r.passed]
    if failed:
        console.print(f"[red]{len(failed)} of {len(results)} checks failed:[/red] {', '.join(failed)}")
    else:
        console.print(f"[green]all {len(results)} checks match[/green] (tolerance {results[0].tolerance:g})")


def print_generations(
    rows: Sequence[tuple[str, Sequence[int], float | None]], args: argparse.Namespace, console: Console
) -> None:
    """Print the token ids the paged runs generated."""
    table = Table(title=f"akv generate: tiny seeded transformer through the paged cache (device {args.device})")
    table.add_column("sequence")
    table.add_column("score", justify="right")
    table.add_column("token ids")
    for name, tokens, score in rows:
        table.add_row(name, "" if score is None else f"{score:.3f}", " ".join(map(str, tokens)))
    console.print(table)
