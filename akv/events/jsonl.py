"""The JSON form of event batches, and JSON-lines files of them (``akv replay --events-out``).

One JSON object per batch, one batch per line::

    {"seq": 7, "ts": 1764547200.25, "events": [
      {"type": "BlockStored", "block_hashes": ["9f...", "04..."], "parent_block_hash": null,
       "token_ids": [1, 2, ...], "block_size": 16, "medium": "device", "namespace": {"str": "lora-7"}},
      {"type": "BlockRemoved", "block_hashes": ["5a..."], "medium": "device"},
      {"type": "AllBlocksCleared"},
      {"type": "EventsDropped", "from_seq": 3, "to_seq": 6}]}

Keys are lowercase hex strings (32 characters). A namespace is tagged so it
round-trips exactly: ``null`` for ``None``, ``{"str": s}``, ``{"int": "123"}``
(a decimal string: any size, any JSON reader), ``{"bytes": "hex"}``,
``{"tuple": [...]}`` of tagged values.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from akv.core.ids import describe
from akv.errors import InvalidInput

from .types import EVENT_TYPES, BlockRemoved, BlockStored, EventBatch, EventsDropped

__all__ = ["from_json", "read_jsonl", "to_json", "write_jsonl"]

_MAX_DEPTH = 16  # as akv.core.ids.MAX_ID_DEPTH


def encode_namespace(value: Hashable) -> Any:
    """The tagged JSON value of a plain value (see the module docstring).

    Args:
        value: ``None`` or a plain value already normalized (:func:`akv.core.ids.plain_id`).

    Returns:
        ``None`` or a one-key dict (``str``, ``int``, ``bytes`` or ``tuple``).
    """
    if value is None:
        return None
    kind = type(value)
    if kind is str:
        return {"str": value}
    if kind is int:
        return {"int": str(value)}
    if kind is bytes:
        return {"bytes": value.hex()}
    return {"tuple": [encode_namespace(item) for item in value]}


def decode_namespace(value: Any, depth: int = 0) -> Hashable:
    """The plain value of a tagged JSON value; inverse of :func:`encode_namespace`.

    Args:
        value: A decoded JSON value.
        depth: Tuples enclosing ``value`` (deeper than 16 is refused, as in :mod:`akv.core.ids`).

    Returns:
        ``None``, a ``str``, ``int``, ``bytes`` or tuple of these.

    Raises:
        InvalidInput: Not a tagged plain value.
    """
    if value is None:
        return None
    if type(value) is not dict or len(value) != 1 or depth > _MAX_DEPTH:
        raise InvalidInput(f"a namespace must be null or one tag of str, int, bytes, tuple; got {describe(value)}")
    ((tag, payload),) = value.items()
    kind = type(payload)
    if tag == "str" and kind is str:
        return payload
    if tag == "int" and kind is str and payload.lstrip("-").isdigit() and payload.isascii():
        return int(payload)
    if tag == "bytes" and kind is str:
        return _from_hex(payload, "a bytes namespace")
    if tag == "tuple" and kind is list:
        return tuple(decode_namespace(item, depth + 1) for item in payload)
    raise InvalidInput(
        f"a namespace tag must be str, int, bytes or tuple with a matching payload; got {describe(value)}"
    )


def _from_hex(text: Any, what: str) -> bytes:
    if type(text) is not str:
        raise InvalidInput(f"{what} must be a hex string, got {describe(text)}")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise InvalidInput(f"{what} must be a hex string, got {describe(text)}") from None


def _keys(values: Any, what: str) -> list[bytes]:
    if type(values) is not list:
        raise InvalidInput(f"{what} must be a list of hex keys, got {describe(values)}")
    return [_from_hex(value, f"a key of {what}") for value in values]


def _event_to_json(event: Any) -> dict:
    kind = type(event)
    out: dict[str, Any] = {"type": kind.__name__}
    if kind is BlockStored:
        parent = event.parent_block_hash
        out.update(
            block_hashes=[key.hex() for key in event.block_hashes],
            parent_block_hash=None if parent is None else parent.hex(),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            medium=event.medium,
            namespace=encode_namespace(event.namespace),
        )
    elif kind is BlockRemoved:
        out.update(block_hashes=[key.hex() for key in event.block_hashes], medium=event.medium)
    elif kind is EventsDropped:
        out.update(from_seq=event.from_seq, to_seq=event.to_seq)
    return out


def to_json(batch: EventBatch) -> dict:
    """The JSON object of one batch (plain dicts, lists, strings and numbers; ``json.dumps`` it).

    Args:
        batch: A batch.

    Returns:
        ``{"seq", "ts", "events"}`` as in the module docstring.
    """
    return {"seq": batch.seq, "ts": batch.ts, "events": [_event_to_json(event) for event in batch.events]}


_FIELDS = {
    "BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "namespace"},
    "BlockRemoved": {"block_hashes", "medium"},
    "AllBlocksCleared": set(),
    "EventsDropped": {"from_seq", "to_seq"},
}


def _event_from_json(obj: Any) -> Any:
    if type(obj) is not dict or obj.get("type") not in EVENT_TYPES:
        raise InvalidInput(f"an event must be an object with a type in {sorted(EVENT_TYPES)}; got {describe(obj)}")
    kind = obj["type"]
    fields = set(obj) - {"type"}
    if fields != _FIELDS[kind]:
        raise InvalidInput(f"a {kind} event has the fields {sorted(_FIELDS[kind])}; got {sorted(fields)}")
    args = {name: obj[name] for name in fields}
    if kind in ("BlockStored", "BlockRemoved"):
        args["block_hashes"] = _keys(args["block_hashes"], f"block_hashes of {kind}")
    if kind == "BlockStored":
        parent = args["parent_block_hash"]
        args["parent_block_hash"] = None if parent is None else _from_hex(parent, "parent_block_hash of BlockStored")
        args["namespace"] = decode_namespace(args["namespace"])
    return EVENT_TYPES[kind](**args)


def from_json(obj: Any) -> EventBatch:
    """The batch of a JSON object written by :func:`to_json` (after ``json.loads``).

    Args:
        obj: A decoded JSON object.

    Returns:
        The batch, validated as on construction.

    Raises:
        InvalidInput: Not a well-formed batch (missing or extra fields, bad
            keys, types or namespaces).
    """
    if type(obj) is not dict or set(obj) != {"seq", "ts", "events"}:
        raise InvalidInput(f"a batch is an object with exactly seq, ts and events; got {describe(obj)}")
    if type(obj["events"]) is not list:
        raise InvalidInput(f"events of a batch must be a list, got {describe(obj['events'])}")
    events = tuple(_event_from_json(event) for event in obj["events"])
    return EventBatch(seq=obj["seq"], ts=obj["ts"], events=events)


def write_jsonl(out: IO[str], batches: Iterable[EventBatch]) -> int:
    """Write each batch as one JSON line to a text file.

    Args:
        out: A text file open for writing (the caller opens and closes it).
        batches: Batches, in sequence order.

    Returns:
        The number of lines written.
    """
    count = 0
    for batch in batches:
        out.write(json.dumps(to_json(batch), separators=(",", ":")) + "\n")
        count += 1
    return count


def read_jsonl(path: str | Path) -> Iterator[EventBatch]:
    """The batches of a JSON-lines file written by :func:`write_jsonl`, one per non-empty line.

    Args:
        path: The file.

    Yields:
        Each line's batch, in file order.

    Raises:
        InvalidInput: The file cannot be opened or read (missing, a
            directory, not UTF-8), or a line is not JSON or not a well-formed
            batch (the message names ``path:line``).
    """
    try:
        file = open(path, encoding="utf-8")  # noqa: SIM115 - closed below; opening is what may fail
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read the events file: {exc.strerror or exc}") from None
    with file:
        for number, line in _lines(file, path):
            if not line.strip():
                continue
            try:
                batch = from_json(json.loads(line))
            except (ValueError, RecursionError) as exc:  # json's errors, and InvalidInput (a ValueError)
                raise InvalidInput(f"{path}:{number}: {exc}") from None
            yield batch


def _lines(file, path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of an open text file; a read error is :class:`~akv.errors.InvalidInput`."""
    number = 0
    try:
        for number, line in enumerate(file, 1):
            yield number, line
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path}:{number + 1}: cannot read the events file: {exc}") from None
