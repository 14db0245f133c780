"""Content keys of full blocks (akv.core.block_key), the config fingerprint and ``KVCacheManager.block_info``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import akv.core.block_key as bk
from akv import KVCacheConfig, KVCacheManager
from akv.core.block_key import KEY_BYTES, block_key, chain_keys, encode_plain
from akv.errors import InvalidInput, InvalidTokens

BS = 16
REPO = Path(__file__).resolve().parents[1]

plain_scalars = st.one_of(st.none(), st.integers(), st.text(max_size=8), st.binary(max_size=8))
plain_values = st.recursive(plain_scalars, lambda inner: st.tuples(inner) | st.tuples(inner, inner), max_leaves=6)
blocks = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=BS)


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, num_tokens).tolist()


# ---------------------------------------------------------------- the key function
_SUBPROCESS = """
import json, sys
from akv.core.block_key import chain_keys, encode_plain
cases = json.loads(sys.stdin.read())
out = [[k.hex() for k in chain_keys(t, bs, tuple(ns) if isinstance(ns, list) else ns)] for t, bs, ns in cases]
out.append([encode_plain(v).hex() for v in (None, 1, "1", "\\u00e9", -(2**70))])
print(json.dumps(out))
"""


def test_keys_are_the_same_bytes_in_another_process() -> None:
    cases = [(_prompt(0, 5 * BS + 3), BS, None), (_prompt(1, 64), 8, "tenant"), (_prompt(2, 32), BS, ["lora", 7])]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"}
    run = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS],
        input=json.dumps(cases),
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    theirs = json.loads(run.stdout.splitlines()[-1])
    ours = [[k.hex() for k in chain_keys(t, bs, tuple(ns) if isinstance(ns, list) else ns)] for t, bs, ns in cases]
    ours.append([encode_plain(v).hex() for v in (None, 1, "1", "\u00e9", -(2**70))])
    assert theirs == ours
    assert [len(k) for k in ours[:3]] == [5, 8, 2]


def test_chain_keys_chain_block_keys() -> None:
    tokens = _prompt(3, 4 * BS + 7)
    keys = chain_keys(tokens, BS, ("lora", 3), extra_keys=("salt",))
    parent = None
    for i, key in enumerate(keys):
        assert key == block_key(parent, tokens[i * BS : (i + 1) * BS], ("lora", 3), ("salt",))
        assert type(key) is bytes and len(key) == KEY_BYTES
        parent = key
    assert len(set(keys)) == 4
    assert chain_keys(np.array(tokens, dtype=np.int64), BS, ("lora", 3), ["salt"]) == keys


def test_a_changed_token_namespace_extra_key_or_parent_changes_the_key() -> None:
    tokens = _prompt(4, BS)
    base = block_key(None, tokens, "ns")
    other = [*tokens[:-1], tokens[-1] + 1]
    parent = block_key(None, other, "ns")
    variants = [
        block_key(None, other, "ns"),
        block_key(None, tokens, b"ns"),
        block_key(None, tokens, ("ns",)),
        block_key(None, tokens, None),
        block_key(None, tokens, "ns", ("lora", 1)),
        block_key(None, tokens, "ns", (None,)),
        block_key(parent, tokens, "ns"),
        block_key(None, tokens[:-1], "ns"),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    namespaces = [block_key(None, tokens, ns) for ns in (1, "1", b"1", (1,), None, ((1,),), (1, None))]
    assert len(set(namespaces)) == 7


def test_encode_plain_refuses_what_is_not_plain() -> None:
    assert encode_plain(np.int64(7)) == encode_plain(7)
    for bad in (True, 1.0, [1], {"a": 1}, (1, [2]), object()):
        with pytest.raises(InvalidInput):
            encode_plain(bad)
    with pytest.raises(InvalidInput):
        block_key(b"short", [1] * BS)
    with pytest.raises(InvalidInput):
        block_key(None, [1] * BS, extra_keys="lora")
    with pytest.raises(InvalidInput):
        chain_keys([1] * BS, True)
    with pytest.raises(InvalidTokens):
        block_key(None, [-1] * BS)
    with pytest.raises(InvalidTokens):
        chain_keys([2**31] * BS, BS)


@given(plain_values, plain_values)
def test_encode_plain_is_equal_exactly_for_equal_values(a, b) -> None:
    assert (encode_plain(a) == encode_plain(b)) == (a == b)


@given(st.lists(blocks, min_size=1, max_size=4), plain_values, plain_values)
def test_equal_inputs_give_equal_keys_and_another_parent_other_keys(chain, namespace, extra) -> None:
    parent = block_key(None, [7] * BS, namespace)
    keys = [None]
    for tokens in chain:
        keys.append(block_key(keys[-1], tokens, namespace, (extra,)))
        assert keys[-1] == block_key(keys[-2], list(tokens), namespace, (extra,))
    moved = [parent]
    for tokens in chain:
        moved.append(block_key(moved[-1], tokens, namespace, (extra,)))
    assert not set(keys[1:]) & set(moved[1:])


# ------------------------------------------------------------ the config fingerprint
def test_fingerprint_names_the_model_block_size_and_key_function() -> None:
    cfg = KVCacheConfig(num_blocks=8)
    fp = cfg.fingerprint()
    assert json.loads(json.dumps(fp)) == fp
    assert (fp["key_function"], fp["key_version"], fp["block_size"]) == ("xxh3_128", 1, 16)
    assert fp["model"]["dtype"] == "float32"
    same = KVCacheConfig(num_blocks=64, num_shards=2, storage="none", eviction_policy="lru")
    assert same.fingerprint_hex() == cfg.fingerprint_hex()
    assert len(cfg.fingerprint_hex()) == 64
    assert KVCacheConfig(num_blocks=8, block_size=8).fingerprint_hex() != cfg.fingerprint_hex()


# ------------------------------------------------------------ block_info in a manager
async def _cache(kv: KVCacheManager, seq_id, prompt, namespace=None) -> tuple[int, ...]:
    """Admit and commit ``prompt`` (its full blocks get published); return its block table."""
    await kv.add_sequence(seq_id, prompt, namespace=namespace)
    await kv.commit(seq_id, len(prompt))
    return (await kv.sequence(seq_id)).block_ids


@pytest.mark.anyio
async def test_block_info_key_is_the_prompt_chain_key_whatever_block_or_shard_holds_it() -> None:
    prompt = _prompt(5, 3 * BS + 5)
    want = chain_keys(prompt, BS, ("lora", 2))
    seen: dict[int, set[tuple[int, int]]] = {0: set(), 1: set(), 2: set()}
    async with KVCacheManager(KVCacheConfig(num_blocks=32, block_size=BS, storage="none")) as kv:
        await _cache(kv, "other", _prompt(6, 2 * BS))  # the prompt gets other block ids here
        table = await _cache(kv, "a", prompt, ("lora", 2))
        infos = [await kv.block_info(b) for b in table]
        for i, info in enumerate(infos[:3]):
            assert (info.key, info.depth, info.num_tokens_in_chain) == (want[i], i + 1, (i + 1) * BS)
            assert (info.state, info.refcount, info.namespace, info.shard) == ("active", 1, ("lora", 2), 0)
            seen[i].add((0, info.block_id))
        assert (infos[3].key, infos[3].depth, infos[3].state) == (None, 0, "active")  # the partial tail
        await kv.free("a")
        after = [await kv.block_info(b) for b in table]
        assert [(x.state, x.refcount, x.key) for x in after] == [*(("cached", 0, k) for k in want), ("free", 0, None)]
    async with KVCacheManager(KVCacheConfig(num_blocks=32, block_size=BS, num_shards=2, storage="none")) as kv:
        for i, b in enumerate((await _cache(kv, "b", prompt, ("lora", 2)))[:3]):  # placed by its first block
            info = await kv.block_info(b)
            assert info.key == want[i]
            seen[i].add((info.shard, b))
    assert all(len({b for _, b in pairs}) >= 2 for pairs in seen.values())  # equal keys at different block ids


@pytest.mark.anyio
async def test_block_info_refuses_bad_ids_before_any_message(monkeypatch) -> None:
    async with KVCacheManager(KVCacheConfig(num_blocks=8, block_size=BS, num_shards=2, storage="none")) as kv:
        asked = []
        ask = kv._ask

        async def recording_ask(actor, msg, *args):
            asked.append(msg)
            return await ask(actor, msg, *args)

        monkeypatch.setattr(kv, "_ask", recording_ask)
        for bad in (-1, 8, True, np.bool_(True), 1.0, "1", None, (1,), 2**70):
            with pytest.raises(InvalidInput):
                await kv.block_info(bad)
        assert asked == []
        info = await kv.block_info(np.int64(7))
        assert (info.block_id, info.shard, info.state, info.key) == (7, 1, "free", None)
        assert type(info.block_id) is int
        await kv.check()


# -------------------------------------------------------------- the collision hook
async def _matching_scenario() -> tuple:
    """Cache one prompt, then admit prompts sharing 0, 1 and 2 of its blocks; what matched, and the keys."""
    base = _prompt(7, 3 * BS + 1)
    one = [*base[:BS], *_prompt(8, 2 * BS + 1)]  # shares only the first block
    two = [*base[: 2 * BS], *_prompt(9, BS + 1)]  # shares the first two blocks
    none = _prompt(10, 3 * BS + 1)
    async with KVCacheManager(KVCacheConfig(num_blocks=32, block_size=BS, storage="none")) as kv:
        table = await _cache(kv, "base", base)
        await kv.free("base")
        other_ns = await kv.lookup(base, namespace="elsewhere")
        looked = [await kv.lookup(p) for p in (none, one, two, base)]
        cached, shared = [], []
        for seq_id, p in (("none", none), ("one", one), ("two", two), ("again", base)):
            cached.append(await kv.add_sequence(seq_id, p))
            shared.append(len(set(table[:3]) & set((await kv.sequence(seq_id)).block_ids)))
        keys = [(await kv.block_info(b)).key for b in table[:3]]
        await kv.check()
    return other_ns, looked, cached, shared, keys


@pytest.mark.anyio
async def test_matching_compares_tokens_so_equal_keys_never_serve_another_prefix(monkeypatch) -> None:
    expected = (0, [0, BS, 2 * BS, 3 * BS], [0, BS, 2 * BS, 3 * BS], [0, 1, 2, 3])
    real = await _matching_scenario()
    assert real[:4] == expected
    assert len(set(real[4])) == 3
    monkeypatch.setattr(bk, "_digest", lambda data: b"\x00" * KEY_BYTES)  # every key equal
    assert len(set(chain_keys(_prompt(11, 4 * BS), BS))) == 1
    forced = await _matching_scenario()
    assert forced[:4] == expected
    assert forced[4] == [b"\x00" * KEY_BYTES] * 3


@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=8, max_size=8),
    st.one_of(st.none(), st.text(max_size=4), st.integers()),
    st.booleans(),
)
def test_block_key_raw_equals_block_key(tokens, namespace, with_parent) -> None:
    parent = block_key(None, [1] * 8, namespace) if with_parent else None
    raw = np.asarray(tokens, dtype="<i4").tobytes()
    assert bk.block_key_raw(parent, raw, bk.chain_suffix(namespace)) == block_key(parent, tokens, namespace)
