"""Every field of KVCacheConfig and ModelShape: exact types, ranges, typed InvalidInput (fresh-eyes review 1).

A hostile value at any field is either accepted or refused with InvalidInput
when the config is built, never anything else; an accepted config enters and
serves an admission (no ActorCrashed). Also: numpy bools and masked arrays at
the step API, and leaving two managers out of order in one task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fractions
import math

import anyio
import numpy as np
import pytest
import torch
import trio
from hostile_inputs import BadEq, BadHash, BadRepr, BadStr, Color, RaisingInt, RaisingIter, RaisingLen
from hypothesis import given, note, settings
from hypothesis import strategies as st

from akv import Admit, KVCacheConfig, KVCacheManager
from akv.config import (
    MAX_BLOCK_SIZE,
    MAX_MODEL_DIM,
    MAX_NUM_BLOCKS,
    MAX_NUM_SHARDS,
    MAX_VOCAB_SIZE,
    MODEL_SHAPES,
    ModelShape,
)
from akv.core.ids import safe_repr
from akv.errors import InvalidInput, InvalidTokens, ManagerClosed, WrongExitOrder

SMALL = {"num_blocks": 16, "block_size": 4, "vocab_size": 1000}
INT_LIMITS = {
    "num_blocks": MAX_NUM_BLOCKS,
    "block_size": MAX_BLOCK_SIZE,
    "vocab_size": MAX_VOCAB_SIZE,
    "num_shards": MAX_NUM_SHARDS,
    "eviction_batch_blocks": MAX_NUM_BLOCKS,
    "inbox_capacity": MAX_NUM_BLOCKS,
    "max_headroom_blocks": MAX_NUM_BLOCKS,
}
BOOL_FIELDS = ("enable_prefix_cache", "debug_invariants")
SHAPE = MODEL_SHAPES["tiny"]


class LyingLen(list):
    """A list whose ``__len__`` claims a million items (it crashed the process inside ``torch.device``)."""

    def __len__(self) -> int:
        return 1_000_000


def nested(depth: int) -> object:
    """``1`` wrapped in ``depth`` tuples (its repr recursed past Python's limit)."""
    value: object = 1
    for _ in range(depth):
        value = (value,)
    return value


HOSTILE = [  # factories: a hostile value must not be hashed or compared by the test itself
    lambda: None,
    lambda: True,
    lambda: np.True_,
    lambda: 0,
    lambda: -1,
    lambda: 2**63,
    lambda: 1.5,
    lambda: math.nan,
    lambda: "no",
    lambda: "cpu",
    lambda: BadStr("tensors"),
    lambda: BadStr("cpu"),
    lambda: BadEq("cpu"),
    BadHash,
    BadRepr,
    lambda: RaisingInt(2),
    RaisingIter,
    lambda: RaisingLen([1]),
    lambda: LyingLen([1]),
    lambda: Color.RED,
    lambda: np.int64(2),
    lambda: np.float32(0.5),
    lambda: fractions.Fraction(1, 2),
    lambda: np.array([1, 2]),
    lambda: np.array(True),
    lambda: torch.tensor([1, 2]),
    lambda: torch.tensor(True),
    lambda: torch.device("cpu"),
    lambda: nested(1000),
    lambda: [1],
    lambda: object(),
    lambda: SHAPE,
    lambda: dataclasses.replace(SHAPE, num_layers=np.int32(3)),
]
FIELDS = [f.name for f in dataclasses.fields(KVCacheConfig)]
SHAPE_FIELDS = [f.name for f in dataclasses.fields(ModelShape)]


def build(**overrides: object) -> KVCacheConfig:
    return KVCacheConfig(**{**SMALL, **overrides})


# --------------------------------------------------------------------------- F1: bool fields


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize(
    "bad", [np.array([1, 2]), torch.tensor([1, 0]), RaisingLen([1]), "no", None, 1, 0.0], ids=safe_repr
)
def test_a_bool_field_that_is_not_a_bool_is_invalid_input(field: str, bad: object) -> None:
    """Reproducer: an array reached the shard and crashed it at the first add_sequence; "no" was truthy."""
    with pytest.raises(InvalidInput, match=f"{field} must be a bool"):
        build(**{field: bad})


@pytest.mark.parametrize("field", BOOL_FIELDS)
def test_numpy_bools_are_made_bool(field: str) -> None:
    for flag in (np.True_, np.False_):
        value = getattr(build(**{field: flag}), field)
        assert type(value) is bool and value == bool(flag)


# --------------------------------------------------------------------------- F2: every other field


@pytest.mark.parametrize("bad", [np.array([1, 2]), BadStr("tensors"), BadEq("tensors"), b"none", None])
def test_storage_is_compared_only_once_it_is_an_exact_str(bad: object) -> None:
    """Reproducer: an array raised ValueError and a raising __eq__ RuntimeError."""
    with pytest.raises(InvalidInput, match="storage must be one of"):
        build(storage=bad)


@pytest.mark.parametrize("field", sorted(INT_LIMITS))
def test_int_fields_are_exact_ints_within_their_limits(field: str) -> None:
    """Reproducer: 2**63 blocks passed (torch's TypeError at enter); a 1,000-deep tuple was a RecursionError."""
    hi = INT_LIMITS[field]
    extra = {"num_shards": 1} if field == "num_blocks" else {"num_blocks": MAX_NUM_BLOCKS}
    assert getattr(build(**{**extra, field: hi}), field) == hi  # built, never entered
    for bad in (hi + 1, 2**63, 0, -1, True, 2.0, "4", nested(1000), RaisingInt(4), Color.RED, np.array([4])):
        with pytest.raises(InvalidInput, match=f"{field} must be a positive int"):
            build(**{**extra, field: bad})
    value = getattr(build(**{field: np.int64(2)}), field)
    assert type(value) is int and value == 2


@pytest.mark.parametrize(
    "good", ["cpu", "cuda", "cuda:1", "mps", "cpu:0", torch.device("cpu"), torch.device("cuda", 1)]
)
def test_device_is_a_device_string_or_a_torch_device_stored_as_a_string(good: object) -> None:
    cfg = build(device=good, storage="none")
    assert type(cfg.device) is str and cfg.device == str(good)


@pytest.mark.parametrize(
    "bad",
    [2**63, LyingLen([1]), [1], "gpu", "cuda:", "cuda:1:2", "cuda:x", " cpu", "", BadStr("cpu"), np.str_("cpu"), None],
    ids=safe_repr,
)
def test_a_bad_device_is_invalid_input_when_the_config_is_built(bad: object) -> None:
    """Reproducer: device=2**63 gave a ValueError at enter; a list whose __len__ lies segfaulted in torch."""
    for storage in ("tensors", "none"):
        with pytest.raises(InvalidInput, match="device must be a str"):
            build(device=bad, storage=storage)


def test_watermarks_model_and_policy_have_exact_types() -> None:
    cfg = build(low_watermark=np.float32(0.25), high_watermark=fractions.Fraction(1, 2))
    assert (type(cfg.low_watermark), type(cfg.high_watermark)) == (float, float)
    for bad in (True, np.True_, "0.1", None, math.nan, math.inf, np.array([0.1]), BadRepr(), 1 + 0j):
        with pytest.raises(InvalidInput, match="watermark"):
            build(low_watermark=bad)

    class Shape(ModelShape):
        __slots__ = ()

    for bad in (Shape(name="s", num_layers=1, num_kv_heads=1, head_dim=1), "tiny", None):
        with pytest.raises(InvalidInput, match="model must be a ModelShape"):
            build(model=bad)
    for bad in (BadStr("lru"), np.str_("lru"), None, "fifo"):
        with pytest.raises(InvalidInput, match="unknown eviction_policy"):
            build(eviction_policy=bad)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim"])
def test_model_shape_sizes_are_exact_ints_within_the_limit(field: str) -> None:
    assert getattr(dataclasses.replace(SHAPE, **{field: MAX_MODEL_DIM}), field) == MAX_MODEL_DIM
    assert type(getattr(dataclasses.replace(SHAPE, **{field: np.int16(3)}), field)) is int
    for bad in (MAX_MODEL_DIM + 1, 2**63, 0, True, 1.0, nested(1000), RaisingInt(2)):
        with pytest.raises(InvalidInput, match=f"{field} must be a positive int"):
            dataclasses.replace(SHAPE, **{field: bad})


def test_model_shape_name_and_dtype_are_exact_strs() -> None:
    for bad in (BadStr("float16"), np.str_("float16"), None, "float64", np.array(["float16"])):
        with pytest.raises(InvalidInput, match="dtype must be one of"):
            dataclasses.replace(SHAPE, dtype=bad)
    for bad in (None, BadRepr(), BadStr("x"), nested(1000)):
        with pytest.raises(InvalidInput, match="name must be a str"):
            dataclasses.replace(SHAPE, name=bad)


def accepted_or_invalid(make: object) -> KVCacheConfig | None:
    """The config ``make()`` builds, or None when it raised InvalidInput; any other error fails the test."""
    try:
        return make()
    except InvalidInput:
        return None


def serve(cfg: KVCacheConfig) -> None:
    """Enter a manager with ``cfg`` and admit one sequence (token 0 is in every vocabulary).

    A configuration is portable, so it cannot know this machine's memory: a
    pool too large for it is refused on entry, as InvalidInput naming it.
    """

    async def run() -> None:
        with anyio.fail_after(60):  # a hang guard only
            try:
                kv = await KVCacheManager(cfg).__aenter__()
            except InvalidInput as exc:
                assert "cannot allocate" in str(exc), exc
                return
            try:
                await kv.add_sequence("x", [0, 0, 0])
                await kv.check()
            finally:
                await kv.__aexit__(None, None, None)

    anyio.run(run)


VALUES = st.one_of(
    st.integers(0, len(HOSTILE) - 1).map(lambda i: HOSTILE[i]()),
    st.integers(-2, 40),
    st.integers(-2, 40).map(np.int32),
    st.floats(-0.5, 1.5),
    st.booleans(),
    st.sampled_from(["tensors", "none", "cpu", "cpu:0", "lru", "lfu", "slru", "float16", "bfloat16", "float8_e4m3fn"]),
)


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from([*FIELDS, *(f"model.{f}" for f in SHAPE_FIELDS)]),
    value=VALUES,
    storage=st.sampled_from(["tensors", "none"]),
)
def test_a_hostile_value_at_any_field_is_accepted_and_served_or_invalid_input(field: str, value: object, storage: str):
    note(f"{field}={safe_repr(value)} storage={storage}")
    if field.startswith("model."):
        shape = accepted_or_invalid(lambda: dataclasses.replace(SHAPE, **{field[6:]: value}))
        cfg = shape and accepted_or_invalid(lambda: build(storage=storage, model=shape))
    else:
        cfg = accepted_or_invalid(lambda: build(**{"storage": storage, field: value}))
    if cfg is not None and cfg.storage == "tensors" and cfg.num_host_blocks * cfg.bytes_per_block > 2**30:
        note(f"accepted; not served: a {cfg.host_gib} GiB host pool")  # host_gib=40 zero-filled 40 GiB: OOM-killed
        return
    if cfg is not None:
        serve(cfg)


# --------------------------------------------------------------------------- F3: step API


@pytest.mark.anyio
async def test_numpy_bools_at_the_step_api_are_made_bool_and_masked_prompts_are_refused(tiny_config) -> None:
    adm = Admit(seq_id="b", prompt=[1], prefill_done=np.True_, resumed=np.False_)
    assert (type(adm.prefill_done), type(adm.resumed)) == (bool, bool) and (adm.prefill_done, adm.resumed) == (
        True,
        False,
    )
    async with KVCacheManager(tiny_config()) as kv:
        await kv.add_sequence("a", [1, 2, 3])
        assert await kv.free("a", preempted=np.True_)
        assert (await kv.stats()).preemptions == 1
        result = await kv.step(admits=[adm], want_metadata=np.False_)
        assert result.block_tables is None
        masked = np.ma.masked_array([1, 2, 3], mask=[0, 1, 0])
        with pytest.raises(InvalidTokens, match="masked array"):
            await kv.add_sequence("m", masked)
        with pytest.raises(InvalidTokens, match="masked array"):
            await kv.step(admits=[Admit(seq_id="m", prompt=masked)])
        assert (await kv.stats()).num_sequences == 1
        await kv.check()


# --------------------------------------------------------------------------- F4: exit order


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_leaving_managers_out_of_order_is_wrong_exit_order_and_leaks_nothing(tiny_config, anyio_backend):
    """Reproducer: anyio's RuntimeError on asyncio, trio's internal error (an AssertionError) on trio."""

    def tasks() -> object:
        if anyio_backend == "asyncio":
            return asyncio.all_tasks()
        return {n for n in trio.lowlevel.current_task().child_nurseries}

    baseline = tasks()
    first, second = KVCacheManager(tiny_config()), KVCacheManager(tiny_config())
    with anyio.fail_after(30):  # a hang guard only
        await first.__aenter__()
        await second.__aenter__()
        with pytest.raises(WrongExitOrder, match="reverse order of entering"):
            await first.__aexit__(None, None, None)
        with pytest.raises(ManagerClosed):
            await first.stats()  # its actors are stopped
        await second.add_sequence("a", [1, 2, 3])  # the later one keeps serving
        with pytest.raises(WrongExitOrder):
            await first.__aexit__(None, None, None)  # still out of order
        await second.__aexit__(None, None, None)
        await first.__aexit__(None, None, None)  # now in order: ends its task group
    assert tasks() == baseline
    async with KVCacheManager(tiny_config()) as kv:  # nested async with stays fine
        async with KVCacheManager(tiny_config()) as inner:
            await inner.add_sequence("a", [1])
        await kv.add_sequence("a", [1])


# --------------------------------------------------------------------------- host tier fields


def test_host_tier_size_is_host_blocks_or_host_gib_and_split_over_shards() -> None:
    assert build().num_host_blocks == 0
    cfg = build(num_blocks=100, num_shards=3, host_blocks=np.int64(10))
    assert cfg.host_blocks == 10 and type(cfg.host_blocks) is int
    assert cfg.host_block_base == 101  # right after the null block
    assert cfg.host_shard_ranges() == [range(101, 105), range(105, 108), range(108, 111)]
    gib = build(num_blocks=100, host_gib=1)
    assert gib.num_host_blocks == 2**30 // gib.bytes_per_block and gib.host_gib == 1.0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(host_blocks=-1), "host_blocks must be"),
        (dict(host_blocks=1.0), "host_blocks must be"),
        (dict(host_blocks=True), "host_blocks must be"),
        (dict(host_gib=0), "host_gib must be"),
        (dict(host_gib=float("nan")), "host_gib must be"),
        (dict(host_gib="1"), "host_gib must be"),
        (dict(host_gib=1, host_blocks=3), "not both"),
        (dict(host_blocks=2, num_shards=3, num_blocks=30), "cannot be split"),
    ],
)
def test_bad_host_tier_sizes_are_invalid_input(overrides: dict, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        build(**overrides)
