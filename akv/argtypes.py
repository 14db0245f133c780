"""Range-checked ``argparse`` types and the usage error shared by the ``akv`` commands.

Each factory returns a callable for ``add_argument(type=...)``. A value out of
range raises :class:`argparse.ArgumentTypeError`, so argparse prints the usage
line and ``akv: error: argument --NAME: ...`` and exits 2 while parsing,
before anything runs::

    parser.add_argument("--num-blocks", type=int_range(1, 2**26))
    parser.add_argument("--metrics-port", type=int_range(0, 65535))
    parser.add_argument("--step-ms", type=float_range(0.0, None, min_open=True))
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "LOG_LEVELS",
    "UsageError",
    "float_range",
    "input_path",
    "int_range",
    "log_level",
    "output_path",
    "png_path",
    "write_output",
]


class UsageError(Exception):
    """Options that parse one by one but cannot work together, or a run that could do nothing (exit 2)."""


#: Level names accepted by ``--log-level`` and ``--log-json-level``.
LOG_LEVELS = ("debug", "info", "warning", "error")


def _bounds(lo: float | None, hi: float | None, *, min_open: bool = False) -> str:
    if hi is None:
        return f"{'>' if min_open else '>='} {lo}" if lo is not None else "a number"
    if lo is None:
        return f"<= {hi}"
    return f"in {'(' if min_open else '['}{lo}, {hi}]"


def int_range(lo: int | None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: a decimal integer in ``[lo, hi]`` (``None``: unbounded on that side).

    Args:
        lo: Smallest accepted value, or ``None``.
        hi: Largest accepted value, or ``None``.

    Returns:
        ``parse(text) -> int``, raising :class:`argparse.ArgumentTypeError`
        (exit 2 at parse time) on a non-integer or out-of-range value.
    """
    want = _bounds(lo, hi)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {want}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def float_range(lo: float | None, hi: float | None = None, *, min_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[lo, hi]`` (or ``(lo, hi]`` with ``min_open``).

    Args:
        lo: Smallest accepted value (excluded if ``min_open``), or ``None``.
        hi: Largest accepted value, or ``None``.
        min_open: Exclude ``lo`` itself (e.g. ``> 0``).

    Returns:
        ``parse(text) -> float``, raising :class:`argparse.ArgumentTypeError`
        on a non-number, NaN, infinity or an out-of-range value.
    """
    want = _bounds(lo, hi, min_open=min_open)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a finite number {want}, got {text!r}") from None
        low_bad = lo is not None and (value <= lo if min_open else value < lo)
        if not math.isfinite(value) or low_bad or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be a finite number {want}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


def log_level(text: str) -> str:
    """An argparse type: a log level name of :data:`LOG_LEVELS`, case-insensitive.

    Raises:
        argparse.ArgumentTypeError: Another name.
    """
    level = text.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def input_path(text: str) -> Path:
    """An argparse type: a path to read; only an empty one is refused here (reading says the rest).

    Raises:
        argparse.ArgumentTypeError: The path is empty (``Path("")`` would be ``.``).
    """
    if not text:
        raise argparse.ArgumentTypeError("empty path; give a file path")
    return Path(text)


def output_path(text: str) -> Path:
    """An argparse type: a regular file to write (created or truncated) in a writable directory.

    Checked while parsing, so a long run never ends on an output it cannot write.

    Raises:
        argparse.ArgumentTypeError: The path is empty, a directory, a device or
            another non-regular file, a file that cannot be written, or its
            parent directory is missing or not writable.
    """
    path = input_path(text)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot use {text!r}: {exc.strerror}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    if mode is not None and not stat.S_ISREG(mode):
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular file (a device, pipe or socket); give a file path")
    if mode is not None and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(path.parent)!r} does not exist")
    if mode is None and not os.access(path.parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"directory {str(path.parent)!r} is not writable")
    return path


def write_output(option: str, path: Path, data: str | bytes) -> None:
    """Write ``data`` to the file of output option ``option``; a failure names both.

    Args:
        option: The option's name, e.g. ``"--json"``.
        path: The file (truncated).
        data: Text (UTF-8) or bytes.

    Raises:
        UsageError: The write failed (disk full, the directory removed since
            parsing, ...): ``--json PATH: cannot write: REASON`` (exit 2).
    """
    try:
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{option} {str(path)!r}: cannot write: {exc.strerror or exc}") from None


def png_path(text: str) -> Path:
    """An argparse type: an :func:`output_path` ending in ``.png``, checking that matplotlib is installed.

    Raises:
        argparse.ArgumentTypeError: As :func:`output_path`, another extension
            (matplotlib picks the format from it), or matplotlib is missing
            (the message names ``pip install 'akv[plot]'``).
    """
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"a plot is a PNG file: the path must end in .png, got {text!r}")
    path = output_path(text)
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("plots need matplotlib: pip install 'akv[plot]'")
    return path
