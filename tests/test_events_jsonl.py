"""The JSON form of event batches: exact round trip through a JSON-lines file; malformed input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv.errors import InvalidInput
from akv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedKey,
    EventBatch,
    EventsDropped,
    from_json,
    read_jsonl,
    to_json,
    write_jsonl,
)

keys = st.binary(min_size=16, max_size=16)
scalars = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=4),
    st.integers(-(2**80), 2**80),
    st.binary(max_size=8),
)
namespaces = st.one_of(
    st.none(),
    scalars,
    st.recursive(st.tuples(scalars), lambda inner: st.tuples(st.one_of(scalars, st.none(), inner)), max_leaves=6),
)


@st.composite
def stored(draw) -> BlockStored:
    block_size = draw(st.integers(1, 4))
    hashes = draw(st.lists(keys, min_size=1, max_size=3))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | keys),
        token_ids=draw(
            st.lists(st.integers(0, 2**31 - 1), min_size=block_size * len(hashes), max_size=block_size * len(hashes))
        ),
        block_size=block_size,
        medium=draw(st.sampled_from(["device", "host", "remote"])),
        namespace=draw(namespaces),
    )


removed = st.builds(
    BlockRemoved, block_hashes=st.lists(keys, min_size=1, max_size=3), medium=st.sampled_from(["device", "host"])
)
cache_events = st.lists(st.one_of(stored(), removed, st.just(AllBlocksCleared())), min_size=1, max_size=4)


@st.composite
def batches(draw) -> list[EventBatch]:
    out, seq = [], 0
    for _ in range(draw(st.integers(1, 5))):
        ts = draw(st.floats(0, 2e9, allow_nan=False))
        if draw(st.booleans()):
            to = seq + draw(st.integers(1, 3))
            out.append(EventBatch(seq=to, ts=ts, events=(EventsDropped(from_seq=seq + 1, to_seq=to),)))
            seq = to
        else:
            seq += 1
            out.append(EventBatch(seq=seq, ts=ts, events=tuple(draw(cache_events))))
    return out


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(written=batches())
def test_batches_round_trip_through_a_jsonl_file(tmp_path: Path, written: list[EventBatch]) -> None:
    path = tmp_path / "events.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        assert write_jsonl(out, written) == len(written)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(written)
    assert all(json.loads(line)["seq"] == b.seq for line, b in zip(lines, written))
    assert list(read_jsonl(path)) == written


def test_json_form_uses_vllm_field_names_hex_keys_and_tagged_namespaces() -> None:
    key, parent = bytes(range(16)), bytes(16)
    batch = EventBatch(
        seq=3,
        ts=1.5,
        events=(
            BlockStored(
                block_hashes=[key],
                parent_block_hash=parent,
                token_ids=[7, 8],
                block_size=2,
                medium="host",
                namespace=("lora", 7, b"\x01"),
            ),
            BlockRemoved(block_hashes=[key], medium="device"),
            AllBlocksCleared(),
        ),
    )
    assert to_json(batch) == {
        "seq": 3,
        "ts": 1.5,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [key.hex()],
                "parent_block_hash": "00" * 16,
                "token_ids": [7, 8],
                "block_size": 2,
                "medium": "host",
                "namespace": {"tuple": [{"str": "lora"}, {"int": "7"}, {"bytes": "01"}]},
            },
            {"type": "BlockRemoved", "block_hashes": [key.hex()], "medium": "device"},
            {"type": "AllBlocksCleared"},
        ],
    }


GOOD = {"seq": 1, "ts": 0.0, "events": [{"type": "BlockRemoved", "block_hashes": ["00" * 16], "medium": "device"}]}


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"seq": 1, "ts": 0.0},
        {**GOOD, "extra": 1},
        {**GOOD, "seq": 0},
        {**GOOD, "seq": True},
        {**GOOD, "ts": float("nan")},
        {**GOOD, "events": []},
        {**GOOD, "events": {}},
        {**GOOD, "events": [{"type": "Nope"}]},
        {**GOOD, "events": [{"type": "BlockRemoved", "block_hashes": ["00" * 15], "medium": "device"}]},
        {**GOOD, "events": [{"type": "BlockRemoved", "block_hashes": ["zz" * 16], "medium": "device"}]},
        {**GOOD, "events": [{"type": "BlockRemoved", "block_hashes": ["00" * 16]}]},
        {**GOOD, "events": [{"type": "BlockRemoved", "block_hashes": [], "medium": "device"}]},
        {**GOOD, "events": [{"type": "EventsDropped", "from_seq": 1, "to_seq": 1}, {"type": "AllBlocksCleared"}]},
        {**GOOD, "seq": 2, "events": [{"type": "EventsDropped", "from_seq": 1, "to_seq": 1}]},
        {
            **GOOD,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": ["00" * 16],
                    "parent_block_hash": None,
                    "token_ids": [1],
                    "block_size": 2,
                    "medium": "device",
                    "namespace": None,
                }
            ],
        },
        *(
            {
                **GOOD,
                "events": [
                    {
                        "type": "BlockStored",
                        "block_hashes": ["00" * 16],
                        "parent_block_hash": None,
                        "token_ids": [1],
                        "block_size": 1,
                        "medium": "device",
                        "namespace": namespace,
                    }
                ],
            }
            for namespace in (
                "x",
                {"float": 1.0},
                {"int": "1.5"},
                {"int": 3},
                {"str": "a", "int": "1"},
                {"tuple": "ab"},
            )
        ),
    ],
)
def test_malformed_batches_are_refused(bad, tmp_path: Path) -> None:
    from_json(GOOD)
    with pytest.raises(InvalidInput):
        from_json(bad)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n")
    reader = read_jsonl(path)
    assert next(reader) == from_json(GOOD)
    with pytest.raises(InvalidInput, match=r"bad\.jsonl:3"):
        next(reader)


def test_a_line_that_is_not_json_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD)[:-5] + "\n")
    with pytest.raises(InvalidInput, match=r"cut\.jsonl:2"):
        list(read_jsonl(path))


@pytest.mark.parametrize(
    "make",
    [
        lambda: BlockStored(block_hashes=[b"x"], parent_block_hash=None, token_ids=[1], block_size=1, medium="device"),
        lambda: BlockStored(
            block_hashes=[bytes(16)], parent_block_hash=None, token_ids=[-1], block_size=1, medium="device"
        ),
        lambda: BlockStored(
            block_hashes=[bytes(16)], parent_block_hash=None, token_ids=[True], block_size=1, medium="device"
        ),
        lambda: BlockStored(block_hashes=[bytes(16)], parent_block_hash=None, token_ids=[1], block_size=1, medium=""),
        lambda: BlockStored(
            block_hashes=[bytes(16)], parent_block_hash=None, token_ids=[1], block_size=1, medium="d", namespace=[1]
        ),
        lambda: BlockRemoved(block_hashes=(bytes(16),), medium="device"),
        lambda: EventsDropped(from_seq=3, to_seq=2),
        lambda: EventsDropped(from_seq=0, to_seq=2),
        lambda: EventBatch(seq=1, ts=0.0, events=[AllBlocksCleared()]),
        lambda: EventBatch(seq=1, ts=0.0, events=(AllBlocksCleared(), "x")),
        lambda: CachedKey(block_hash=bytes(16), parent_block_hash=b"", namespace=None, medium="device"),
    ],
)
def test_events_validate_their_fields(make) -> None:
    with pytest.raises(InvalidInput):
        make()


def test_an_unreadable_events_file_is_invalid_input(tmp_path) -> None:
    # Found by a review: a missing file raised a plain FileNotFoundError from the router.
    from akv.routing import CacheAwareRouter

    router = CacheAwareRouter(block_size=16)
    router.add_instance("a")
    for path in (tmp_path / "missing.jsonl", tmp_path):
        with pytest.raises(InvalidInput, match="cannot read the events file"):
            router.apply_jsonl("a", path)
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b"\xff\xfe not utf-8\n")
    with pytest.raises(InvalidInput, match=r"latin1\.jsonl:1"):
        list(read_jsonl(bad))
