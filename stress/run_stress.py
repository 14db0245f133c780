"""Run the akv stress harness: ``python stress/run_stress.py --duration-s 20``.

A thin wrapper around :func:`akv.stress.main_stress` (the same as ``akv stress``);
see stress/README.md.
"""

from __future__ import annotations

import argparse
import sys

from akv.stress import add_arguments, main_stress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="run_stress.py", description="akv stress harness (same options as 'akv stress')"
    )
    add_arguments(parser)
    return main_stress(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
