"""structlog set-up for applications that embed akv, and for akv's own commands.

Library code only calls ``structlog.get_logger("akv")`` and binds context;
this helper is what an application calls once at start-up (akv never calls
it on import).
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

import structlog

__all__ = ["configure_logging", "log_file_error"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _level(name: str) -> int:
    try:
        return _LEVELS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown log level {name!r}; use one of {', '.join(_LEVELS)}") from None


class _JsonFileHandler(logging.FileHandler):
    """The ``json_path`` file: a failed write is kept (for :func:`log_file_error`), never a traceback on stderr."""

    error: OSError | None = None

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            self.error = self.error or exc

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:  # the buffered lines of a full disk: already reported by flush
            self.error = self.error or exc

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if self.error is None:
            self.error = exc if isinstance(exc, OSError) else OSError(str(exc))


def log_file_error() -> tuple[str, OSError] | None:
    """The first failed write to the ``json_path`` file of :func:`configure_logging`, after a flush.

    Returns:
        ``(path, error)`` if a write to the JSON-lines file failed (e.g. the
        disk is full: later events are lost), else ``None`` (also without a
        file).
    """
    for handler in logging.getLogger("akv").handlers:
        if isinstance(handler, _JsonFileHandler):
            handler.flush()
            if handler.error is not None:
                return handler.baseFilename, handler.error
    return None


def _exception_line(sio: TextIO, exc_info: Any) -> None:
    """Console exception formatter without the traceback: ``Type: message`` on the line after the event."""
    sio.write("\n" + "".join(traceback.format_exception_only(exc_info[0], exc_info[1])).rstrip())


def configure_logging(
    *,
    level: str = "info",
    json: bool = False,
    json_path: Path | str | None = None,
    json_level: str = "info",
    tracebacks: bool = True,
) -> None:
    """Route structlog events through stdlib logging to stderr and optionally a JSON-lines file.

    The two outputs have their own levels: a quiet console (``level="warning"``)
    beside a debug file (``json_level="debug"``, what ``akv replay --log-json``
    writes) is what ``akv inspect --seq`` needs. Events below both levels are
    dropped at the call site by structlog's filtering logger, so they cost
    nothing.

    Args:
        level: Console level name: ``debug``, ``info``, ``warning`` or ``error``.
        json: Render console lines as JSON instead of the human format.
        json_path: Also write every event at ``json_level`` or above as one
            JSON object per line to this file (truncated).
        json_level: Level name of the ``json_path`` file (default ``info``:
            one line per batch of work; ``debug`` adds the per-sequence
            events); ignored without ``json_path``. A write to it that fails
            prints nothing: :func:`log_file_error` reports it.
        tracebacks: Print an event's exception on the console with its
            traceback (without the frames' local variables: they hold whole
            block arrays); ``False``: its last line only (``akv`` without
            ``--debug``). The JSON file always gets the whole traceback.

    Raises:
        ValueError: Unknown level name.
    """
    console_level = _level(level)
    file_level = _level(json_level)
    min_level = min(console_level, file_level) if json_path is not None else console_level
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger("akv")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(min_level)
    root.propagate = False
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(console_level)
    if not tracebacks:
        formatter = _exception_line
    elif sys.stderr.isatty():
        formatter = structlog.dev.RichTracebackFormatter(show_locals=False)
    else:
        formatter = structlog.dev.plain_traceback
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=formatter)
    )
    console.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]
        )
    )
    root.addHandler(console)
    if json_path is not None:
        handler = _JsonFileHandler(json_path, mode="w", encoding="utf-8")
        handler.setLevel(file_level)
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.dict_tracebacks,
                    structlog.processors.JSONRenderer(),
                ]
            )
        )
        root.addHandler(handler)
