"""Scheduler steps for :mod:`akv.testing.manager_machine`: prompts, tokens, whole steps, bad items, rejections."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from hypothesis import strategies as st

from akv.core.step import Admit
from akv.errors import DuplicateSequence, InvalidInput, InvalidTokens, PoolExhausted, RequestTooLarge, UnknownSequence
from akv.testing.prefix_model import PrefixModel

__all__ = [
    "INVALID",
    "PREFIXES",
    "WATERMARKS",
    "StepPlan",
    "check_append_room",
    "check_rejection",
    "draw_plan",
    "draw_prompt",
    "draw_tokens",
]

#: Prompt prefixes: 0 and 1 share their first two blocks (of 4 tokens), 2 shares nothing.
PREFIXES: tuple[tuple[int, ...], ...] = (
    tuple(range(100, 116)),
    tuple(range(100, 108)) + tuple(range(200, 208)),
    tuple(range(300, 316)),
)
#: ``(low_watermark, high_watermark)``: the eviction loop off, or on.
WATERMARKS: tuple[tuple[float, float], ...] = ((0.0, 0.0), (0.1, 0.25), (0.3, 0.6))

#: Bad step items: name -> (the typed error, ``items(seq_id, model sequence, vocab_size)`` -> step arguments).
INVALID: dict[str, tuple[type[Exception], Callable[..., dict]]] = {
    "commit unknown": (UnknownSequence, lambda sid, seq, vocab: {"commits": {"ghost": 1}}),
    "fork unknown": (UnknownSequence, lambda sid, seq, vocab: {"forks": [("ghost", ["ghost-child"])]}),
    "empty prompt": (InvalidTokens, lambda sid, seq, vocab: {"admits": [Admit(seq_id="empty", prompt=[])]}),
    "negative token": (InvalidTokens, lambda sid, seq, vocab: {"admits": [Admit(seq_id="neg", prompt=[1, -1])]}),
    "commit too many": (InvalidInput, lambda sid, seq, vocab: {"commits": {sid: len(seq.tokens) - seq.committed + 1}}),
    "append empty": (InvalidInput, lambda sid, seq, vocab: {"appends": {sid: []}}),
    "token out of range": (InvalidTokens, lambda sid, seq, vocab: {"appends": {sid: [vocab]}}),
    "duplicate admission": (DuplicateSequence, lambda sid, seq, vocab: {"admits": [Admit(seq_id=sid, prompt=[1])]}),
    "fork onto a live id": (DuplicateSequence, lambda sid, seq, vocab: {"forks": [(sid, [sid])]}),
}


@dataclasses.dataclass
class StepPlan:
    """One scheduler step as the machine drew it (the arguments of :meth:`KVCacheManager.step`)."""

    frees: list = dataclasses.field(default_factory=list)
    preempted: list = dataclasses.field(default_factory=list)
    commits: dict = dataclasses.field(default_factory=dict)
    forks: list = dataclasses.field(default_factory=list)
    appends: dict = dataclasses.field(default_factory=dict)
    admits: list = dataclasses.field(default_factory=list)


def draw_prompt(data: st.DataObject, oversize: int) -> list[int]:
    """A prompt from :data:`PREFIXES`: cut, with a suffix of small tokens; 1 in 25 has ``oversize`` more tokens."""
    which = data.draw(st.integers(0, len(PREFIXES) - 1), label="prefix")
    cut = data.draw(st.sampled_from([0, 3, 4, 5, 8, 9, 12, 16, 16, 16]), label="cut")
    suffix = data.draw(st.lists(st.integers(0, 3), max_size=6), label="suffix")
    prompt = list(PREFIXES[which][:cut]) + suffix or [PREFIXES[which][0]]
    if data.draw(st.integers(0, 24), label="oversized") == 7:
        prompt += [5] * oversize  # more than a shard holds
    return prompt


def draw_tokens(data: st.DataObject, oversize: int) -> int | list[int]:
    """Tokens to append: 1-6 small ones (one may come as an ``int``), 1 in 25 times ``oversize`` of them."""
    tokens = data.draw(st.lists(st.sampled_from([0, 0, 1, 2]), min_size=1, max_size=6), label="tokens")
    if data.draw(st.integers(0, 24), label="oversized") == 7:
        return [1] * oversize
    if len(tokens) == 1 and data.draw(st.booleans(), label="as int"):
        return tokens[0]
    return tokens


def draw_plan(
    data: st.DataObject,
    model: PrefixModel,
    preempted: dict[Hashable, tuple[Hashable, list[int]]],
    *,
    live: list[Hashable],
    new_id: Callable[[], Hashable],
    max_sequences: int,
    namespaces: Sequence[Hashable],
    prompt: Callable[[st.DataObject], list[int]],
    tokens: Callable[[st.DataObject], Any],
) -> StepPlan:
    """A valid scheduler step over the live sequences of ``model``.

    Frees (sometimes), a preemption (sometimes), commits of written tokens,
    a fork (sometimes), appends (to live sequences and new children) and up to
    three admissions, new or resuming a sequence of ``preempted`` (taken out
    of it). At most ``max_sequences`` sequences are live afterwards.
    """
    plan = StepPlan()
    subset = functools.partial(st.lists, unique=True, max_size=2)
    if live and data.draw(st.integers(0, 2), label="free some") == 0:
        plan.frees = data.draw(subset(st.sampled_from(live), min_size=1), label="frees")
    rest = [s for s in live if s not in plan.frees]
    if rest and data.draw(st.integers(0, 4), label="preempt one") == 0:
        plan.preempted = [data.draw(st.sampled_from(rest), label="preempted")]
    rest = [s for s in live if s not in plan.frees and s not in plan.preempted]
    for sid in rest:
        seq = model.sequences[sid]
        open_ = len(seq.tokens) - seq.committed
        if open_ and data.draw(st.booleans(), label=f"commit {sid}"):
            plan.commits[sid] = data.draw(st.sampled_from(sorted({0, open_, open_, max(1, open_ - 2)})))
    room = max_sequences - len(rest)
    if rest and room > 0 and data.draw(st.integers(0, 3), label="fork") == 0:
        parent = data.draw(st.sampled_from(rest), label="parent")
        kids = [new_id() for _ in range(data.draw(st.integers(1, min(2, room)), label="children"))]
        plan.forks.append((parent, kids))
        rest += kids
        room -= len(kids)
    for sid in data.draw(subset(st.sampled_from(rest), max_size=3), label="appends") if rest else []:
        plan.appends[sid] = tokens(data)
    for _ in range(data.draw(st.sampled_from([0, 1, 1, 2, 3]), label="admits") if room > 0 else 0):
        if room <= 0:
            break
        room -= 1
        resumable = [s for s in preempted if s not in model.sequences or s in plan.frees]
        if resumable and data.draw(st.booleans(), label="resume"):
            sid = data.draw(st.sampled_from(sorted(resumable, key=str)), label="resumed")
            ns, history = preempted.pop(sid)
            plan.admits.append(Admit(seq_id=sid, prompt=history, namespace=ns, resumed=True))
            continue
        ns = data.draw(st.sampled_from(namespaces), label="namespace")
        prefill_done = data.draw(st.booleans(), label="prefill_done")
        plan.admits.append(Admit(seq_id=new_id(), prompt=prompt(data), namespace=ns, prefill_done=prefill_done))
    return plan


def check_append_room(
    model: PrefixModel, seq_id: Hashable, num_tokens: int, size: int, err: Exception | None, *, transient: bool = False
) -> bool:
    """An append is rejected exactly when its new blocks exceed its shard's free plus evictable ones.

    For a step without admissions (no prefix hits to protect): free plus
    evictable is the shard's ``size`` less the blocks live sequences on it
    hold, whatever the eviction loop did meanwhile. Call before the model
    applies the append.

    With ``transient`` (a host tier), one more refusal is allowed: the step's
    own demotions filled the host tier, so cached blocks above a host block
    still being copied could neither move nor be dropped. akv must then say
    so in its numbers (less free plus evictable than requested, and less than
    the model's room), and the caller must show the refusal was transient:
    retried once the copies ran, with progress at every refusal, the same
    append succeeds (:meth:`~akv.testing.manager_checks.ManagerMachineBase.retry_until_room`).

    Returns:
        Whether the append was refused transiently (the caller retries it).

    Raises:
        AssertionError: Rejected with room (and not transiently), accepted
            without, or the wrong error or numbers.
    """
    total, need = model.append_need(seq_id, num_tokens)
    room = size - model.held_on(model.sequences[seq_id].shard)
    if err is None:
        assert total <= size and need <= room, f"{seq_id}: appended needing {need} blocks with room for {room}"
    elif total > size:
        assert isinstance(err, RequestTooLarge), f"{seq_id}: {total} blocks of a {size}-block shard, got {err!r}"
    elif transient and isinstance(err, PoolExhausted) and need <= room:
        have = err.free_blocks + err.evictable_blocks
        assert err.requested_blocks == need > have and have < room, f"{seq_id}: {err!r} with room for {room}"
        return True
    else:
        assert isinstance(err, PoolExhausted) and need > room, f"{seq_id}: {err!r} with room for {room}"
        assert (err.requested_blocks, err.free_blocks + err.evictable_blocks) == (need, room), (
            f"{seq_id}: {err!r}, the model expected {need} requested and {room} free or evictable"
        )
    return False


def check_rejection(seq_id: Hashable, err: Exception, total: int, sizes: list[int], shard: int | None) -> None:
    """A rejected append or admission of ``total`` blocks has the right error type with consistent numbers.

    Args:
        seq_id: The rejected sequence.
        err: Its error from ``StepResult.rejected`` (or raised by a helper).
        total: Blocks the sequence would hold.
        sizes: Blocks per shard.
        shard: Its shard, or None for an admission (placed by akv).

    Raises:
        AssertionError: Another error type, or numbers that do not justify it.
    """
    if isinstance(err, RequestTooLarge):
        assert total > (sizes[shard] if shard is not None else min(sizes)), f"{seq_id}: {err!r} but {total} fit"
    else:
        assert isinstance(err, PoolExhausted), f"{seq_id}: unexpected rejection {err!r}"
        assert total <= (sizes[shard] if shard is not None else max(sizes)), f"{seq_id}: {err!r} for {total} blocks"
        assert err.requested_blocks > err.free_blocks + err.evictable_blocks, f"{seq_id}: {err!r} yet it fits"
