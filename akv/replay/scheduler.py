"""A continuous-batching scheduler that replays a request trace through the manager.

The simulated engine works like vLLM's scheduler (FCFS, recompute preemption):

- Simulated time advances by ``step_ms`` per step and jumps to the next
  arrival when nothing runs. A request is admitted once it has arrived, in
  arrival order, while the batch has room and the pool can hold its prompt;
  a request the pool can never hold is dropped and counted, and so is a
  running sequence whose next token would need more blocks than a shard holds
  (it is freed instead of retried forever).
- A request's prefill runs in its admission step: it is admitted with
  ``prefill_done`` so its full prompt blocks are published to the prefix cache
  before the next request is admitted. The last prompt token is always
  computed, so a prompt is never served wholly from cache.
- Every step appends one generated token to every running sequence and
  commits the token appended in the previous step; a sequence finishes after
  ``output_length`` tokens and is freed in the next step.
- When the pool cannot hold a decode step, the newest running sequence is
  preempted: its blocks are freed and it is re-admitted later with its prompt
  plus the tokens generated so far (recomputation). The victim is freed with
  ``step(preempted=...)`` and re-admitted with ``Admit(resumed=True)``, so the
  manager's counters match this report: hit counting covers first admissions
  only; re-admissions are counted apart.

Exactly one ``KVCacheManager.step`` call per scheduler step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import structlog

from akv.core.ids import describe
from akv.core.step import Admit
from akv.errors import ActorCrashed, InvalidInput, ManagerClosed, PoolExhausted, RequestTooLarge
from akv.manager import KVCacheManager
from akv.trace import TraceRequest, synthesize_output, synthesize_prompt


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayOptions:
    """Scheduler knobs.

    Args:
        max_batch: Running sequences at most.
        step_ms: Simulated milliseconds per step (decode iteration).
        max_prefill_tokens: Prompt tokens admitted per step at most (the first
            admission of a step is always allowed).
        max_output_tokens: Cap on each request's output length (None: as traced).
        trace_block_tokens: Tokens per trace hash id (Mooncake: 512).
        seed: Seed of the synthesized tokens.
        want_metadata: Build block tables and slot mappings every step, as a
            model runner would need (``akv replay`` turns it off in metadata
            mode, where no runner reads them).
        timeline_every_steps: Sample ``kv.stats()`` into ``report.timeline``
            every this many steps, and at the first and the last step (0: no
            timeline; ``akv replay --plot``).
        wait_copies: Await each step's copies (``StepResult.copies``: with a
            host tier its demotions and promotions) before the next step, as a
            model runner must before its forward pass reads or writes the
            step's blocks. False lets the scheduler run ahead of the copy
            worker, which no runner can (its sequences would read promoted
            blocks before they arrived). No effect in metadata mode (no copies).

    Raises:
        InvalidInput: A count is not an ``int`` in range (``max_batch``,
            ``max_prefill_tokens`` and ``trace_block_tokens`` >= 1, the others
            >= 0), ``step_ms`` is not a finite number > 0, or a flag is not a ``bool``.
    """

    max_batch: int = 256
    step_ms: float = 20.0
    max_prefill_tokens: int = 65_536
    max_output_tokens: int | None = None
    trace_block_tokens: int = 512
    seed: int = 0
    want_metadata: bool = True
    timeline_every_steps: int = 0
    wait_copies: bool = True

    def __post_init__(self) -> None:
        lows = {"max_batch": 1, "max_prefill_tokens": 1, "trace_block_tokens": 1, "timeline_every_steps": 0}
        lows.update(seed=0, max_output_tokens=0)
        for name, low in lows.items():
            value = getattr(self, name)
            if value is None and name == "max_output_tokens":
                continue
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
                raise InvalidInput(f"ReplayOptions.{name} must be an int >= {low}, got {describe(value)}")
        step = self.step_ms
        if (
            isinstance(step, (bool, np.bool_))
            or not isinstance(step, (int, float, np.number))
            or not 0 < step < math.inf
        ):
            raise InvalidInput(f"ReplayOptions.step_ms must be a finite number > 0, got {describe(step)}")
        for name in ("want_metadata", "wait_copies"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise InvalidInput(f"ReplayOptions.{name} must be a bool, got {describe(getattr(self, name))}")


#: Fields of :class:`ReplayReport` copied from the final :class:`~akv.results.CacheStats` (the host tier's).
_HOST_FIELDS = (
    "host_blocks",
    "host_in_use",
    "host_free",
    "device_hit_tokens",
    "host_hit_tokens",
    "demoted_blocks",
    "promoted_blocks",
    "swapped_out",
    "swapped_in",
)

#: Fields of :class:`ReplayReport` left out of its JSON (per request or per sample).
_PER_REQUEST = ("cached_tokens_per_request", "admitted_unix_s_per_request", "timeline")


@dataclass(kw_only=True, slots=True)
class ReplayReport:
    """Numbers of one replay (units in the names; tokens unless named)."""

    requests: int = 0
    requests_finished: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_rate: float = 0.0
    readmissions: int = 0
    readmit_prompt_tokens: int = 0
    readmit_cached_tokens: int = 0
    output_tokens: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    evictions: int = 0
    cow_copies: int = 0
    num_blocks: int = 0
    block_size: int = 0
    peak_blocks_in_use: int = 0  # referenced by running sequences (cached blocks excluded)
    peak_running: int = 0
    simulated_s: float = 0.0
    wall_s: float = 0.0
    #: Wall seconds spent awaiting step copies (``ReplayOptions.wait_copies``), part of
    #: ``wall_s``: the copy worker's time that nothing overlapped (the replay has no forward pass).
    copy_wait_s: float = 0.0
    step_latency_us: dict = field(default_factory=dict)
    cached_tokens_per_request: list = field(default_factory=list)
    #: ``time.time()`` of each request's first admission (0.0: never admitted), by position.
    admitted_unix_s_per_request: list = field(default_factory=list)
    #: Blocks a ``--warm-start`` snapshot loaded before the first request, and the seconds it took.
    warm_start_blocks: int = 0
    warm_start_s: float = 0.0
    #: Samples of (simulated_s, blocks per state, hit rate, evictions, preemptions),
    #: when ``ReplayOptions.timeline_every_steps`` is set.
    timeline: list = field(default_factory=list)
    #: Blocks in the prefix cache per medium at the end (``--events-out`` only, else None).
    final_cached_blocks: dict | None = None
    #: The host tier (docs/host_tier.md): its size, blocks in use and free at the end,
    #: ``cached_tokens`` split by the tier that served them, and the blocks moved.
    host_blocks: int = 0
    host_in_use: int = 0
    host_free: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    swapped_out: int = 0
    swapped_in: int = 0

    def as_json(self) -> dict:
        """The report as JSON-ready data (without the per-request list and the timeline)."""
        out = {f: getattr(self, f) for f in self.__slots__ if f not in _PER_REQUEST}
        if self.final_cached_blocks is None:
            del out["final_cached_blocks"]
        return out


class _Running:
    __slots__ = ("admitted_at", "generated", "index", "output_len", "outputs", "prompt_len", "seq_id")

    def __init__(self, index: int, seq_id: str, prompt_len: int, output_len: int, outputs: list[int]) -> None:
        self.index = index
        self.seq_id = seq_id
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.generated = 0
        self.outputs = outputs
        self.admitted_at = 0


def _sample(now_ms: float, stats) -> dict:
    return {
        "simulated_s": now_ms / 1000.0,
        "free": stats.free,
        "active": stats.active,
        "cached": stats.cached,
        "in_flight": stats.in_flight,
        "hit_rate": stats.hit_rate,
        "evictions": stats.blocks_evicted,
        "preemptions": stats.preemptions,
    }


async def replay(
    kv: KVCacheManager,
    requests: Sequence[TraceRequest],
    options: ReplayOptions = ReplayOptions(),
    *,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayReport:
    """Replay ``requests`` through a running manager and report what happened.

    Args:
        kv: An entered :class:`~akv.manager.KVCacheManager`.
        requests: Trace records in arrival order.
        options: Scheduler knobs.
        progress: Called as ``progress(finished_or_dropped, total)`` about every
            second of wall time.

    A request refused room twice while none of the replay's other sequences
    runs (at admission, or as the only running sequence when its append is
    refused: the pool is held by sequences the replay does not own) is
    dropped and counted in ``requests_rejected``, as one larger than a shard is. If
    the replay is cancelled or fails, its sequences are freed (shielded)
    before the exception propagates.

    Returns:
        The report; ``cached_tokens_per_request`` lists first-admission hits
        by request index.
    """
    cfg = kv.config
    vocab = cfg.vocab_size
    report = ReplayReport(requests=len(requests), num_blocks=cfg.num_blocks, block_size=cfg.block_size)
    report.cached_tokens_per_request = [0] * len(requests)
    report.admitted_unix_s_per_request = [0.0] * len(requests)
    waiting: deque[tuple[int, np.ndarray | None]] = deque()  # (request index, resume tokens)
    arrivals = deque(range(len(requests)))
    running: dict[str, _Running] = {}
    order: list[str] = []  # admission order, newest last (preemption victims)
    admitted_once = [False] * len(requests)
    synthesized: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # tokens of waiting requests
    frees: list[str] = []
    preempted: list[str] = []
    tried: set[int] = set()  # requests ever sent to the manager: freed if the replay ends early
    stalled: set[int] = set()  # requests refused admission once while none of the replay's sequences ran
    lone_preempted: set[int] = set()  # requests preempted once as the only running sequence
    commits: dict[str, int] = {}
    appends: dict[str, int] = {}  # the next step's decode tokens, in the order of ``running``
    latencies: list[float] = []
    now_ms = 0.0
    sampled_step = 0
    done = 0
    next_progress = time.perf_counter() + 1.0
    t_start = time.perf_counter()

    def out_len(req: TraceRequest) -> int:
        n = req.output_length
        return n if options.max_output_tokens is None else min(n, options.max_output_tokens)

    try:
        while arrivals or waiting or running or frees or preempted:
            while arrivals and requests[arrivals[0]].timestamp_ms <= now_ms:
                waiting.append((arrivals.popleft(), None))
            if not running and not waiting and not frees and not preempted and arrivals:
                now_ms = float(requests[arrivals[0]].timestamp_ms)
                continue

            admits: list[Admit] = []
            pending: list[tuple[int, np.ndarray | None, _Running]] = []
            budget = options.max_prefill_tokens
            slots = options.max_batch - len(running)
            # Free plus evictable blocks (a gauge): a head request that cannot fit is
            # not even tried, rather than matched and rejected every step.
            available = kv.blocks_available
            while waiting and slots > 0:
                index, resume = waiting[0]
                req = requests[index]
                if index not in synthesized:
                    synthesized[index] = (
                        synthesize_prompt(
                            req.hash_ids,
                            req.input_length,
                            vocab_size=vocab,
                            trace_block_tokens=options.trace_block_tokens,
                            seed=options.seed,
                        ),
                        synthesize_output(req.index, out_len(req), vocab_size=vocab, seed=options.seed).tolist(),
                    )
                prompt, outputs = synthesized[index]
                tokens = prompt if resume is None else np.concatenate([prompt, resume])
                if admits and len(tokens) > budget:
                    break
                blocks = -(-len(tokens) // cfg.block_size)
                alone = not running and not admits  # none of the replay's sequences holds blocks
                if blocks > available and blocks <= cfg.num_blocks // cfg.num_shards and not alone:
                    break  # wait for room (FCFS); a request larger than a shard is rejected by the manager
                available -= blocks
                waiting.popleft()
                seq_id = f"r{index}"
                r = _Running(index, seq_id, len(prompt), out_len(req), outputs)
                if resume is not None:
                    r.generated = len(resume)
                admits.append(Admit(seq_id=seq_id, prompt=tokens, prefill_done=True, resumed=resume is not None))
                tried.add(index)
                pending.append((index, resume, r))
                budget -= len(tokens)
                slots -= 1

            t0 = time.perf_counter()
            result = await kv.step(
                frees=frees,
                preempted=preempted,
                commits=commits,
                appends=appends,
                admits=admits,
                want_metadata=options.want_metadata,
            )
            t1 = time.perf_counter()
            latencies.append(t1 - t0)
            if options.wait_copies and result.copies.tickets:
                await result.copies.wait()
                report.copy_wait_s += time.perf_counter() - t1
            report.decode_steps += 1
            frees = []
            preempted = []
            commits = {}

            # One pass over the decoded sequences: commit, then the next token or done.
            # Rejected appends retry the same token. Everything stays in the order of
            # ``running`` (admission order), which the frees below follow.
            rejected = result.rejected
            next_appends: dict[str, int] = {}
            finished: dict[str, None] = {}
            too_large: list[str] = []  # sequences that outgrew a shard: dropped, never retried
            for seq_id, token in appends.items():
                if rejected and seq_id in rejected:
                    if isinstance(rejected[seq_id], RequestTooLarge):
                        too_large.append(seq_id)
                    else:
                        next_appends[seq_id] = token
                    continue
                r = running[seq_id]
                r.generated += 1
                commits[seq_id] = 1
                if r.generated < r.output_len:
                    next_appends[seq_id] = r.outputs[r.generated]
                else:
                    finished[seq_id] = None
            report.output_tokens += len(commits)
            requeue: list[tuple[int, np.ndarray | None]] = []
            for index, resume, r in pending:
                err = rejected.get(r.seq_id)
                if err is None:
                    synthesized.pop(index, None)
                    stalled.discard(index)
                    cached = result.cached_tokens[r.seq_id]
                    if admitted_once[index]:
                        report.readmissions += 1
                        report.readmit_prompt_tokens += r.prompt_len + r.generated
                        report.readmit_cached_tokens += cached
                    else:
                        admitted_once[index] = True
                        report.prompt_tokens += r.prompt_len
                        report.cached_tokens += cached
                        report.cached_tokens_per_request[index] = cached
                        report.admitted_unix_s_per_request[index] = time.time()
                    running[r.seq_id] = r
                    order.append(r.seq_id)
                    if r.generated < r.output_len:
                        next_appends[r.seq_id] = r.outputs[r.generated]
                    else:
                        finished[r.seq_id] = None
                elif isinstance(err, RequestTooLarge) or (not running and await _held_by_others(kv, index, stalled)):
                    synthesized.pop(index, None)
                    report.requests_rejected += 1
                    done += 1
                else:
                    requeue.append((index, resume))
            waiting.extendleft(reversed(requeue))
            appends = next_appends

            for seq_id in too_large:
                running.pop(seq_id)
                order.remove(seq_id)
                frees.append(seq_id)
                report.requests_rejected += 1
                done += 1
            lone = len(running) == 1  # preempting the only running sequence frees room for nobody else
            for victim in _preemption_victims(kv, rejected, appends, order):
                r = running.pop(victim)
                commits.pop(victim, None)
                appends.pop(victim, None)
                finished.pop(victim, None)
                if lone and r.index in lone_preempted:  # refused alone twice: the room is held by others
                    frees.append(victim)
                    report.requests_rejected += 1
                    done += 1
                    continue
                if lone:
                    lone_preempted.add(r.index)
                preempted.append(victim)
                report.preemptions += 1
                waiting.appendleft((r.index, np.array(r.outputs[: r.generated], dtype=np.int32)))

            for seq_id in finished:
                running.pop(seq_id)
                order.remove(seq_id)
                commits.pop(seq_id, None)
                frees.append(seq_id)
                report.requests_finished += 1
                done += 1

            report.peak_blocks_in_use = max(report.peak_blocks_in_use, kv.blocks_in_use)
            report.peak_running = max(report.peak_running, len(running))
            every = options.timeline_every_steps
            if every and (report.decode_steps == 1 or report.decode_steps % every == 0):
                report.timeline.append(_sample(now_ms, await kv.stats()))
                sampled_step = report.decode_steps
            now_ms += options.step_ms
            if progress is not None and time.perf_counter() >= next_progress:
                progress(done, len(requests))
                next_progress = time.perf_counter() + 1.0
    except BaseException:  # cancelled or failed: leave no sequence of the replay behind in the manager
        await _free_requests(kv, tried)
        raise

    if options.timeline_every_steps and report.decode_steps > sampled_step:  # the last step, so a short run has two
        report.timeline.append(_sample(now_ms - options.step_ms, await kv.stats()))
    if progress is not None:
        progress(done, len(requests))
    report.wall_s = time.perf_counter() - t_start
    report.simulated_s = now_ms / 1000.0
    report.hit_rate = report.cached_tokens / report.prompt_tokens if report.prompt_tokens else 0.0
    stats = await kv.stats()
    report.evictions = stats.blocks_evicted
    report.cow_copies = stats.cow_copies
    for name in _HOST_FIELDS:
        setattr(report, name, getattr(stats, name))
    if latencies:
        lat = np.array(latencies) * 1e6
        report.step_latency_us = {
            "p50": round(float(np.percentile(lat, 50)), 1),
            "p99": round(float(np.percentile(lat, 99)), 1),
            "max": round(float(lat.max()), 1),
            "mean": round(float(lat.mean()), 1),
        }
    # The canonical line of a replay (nothing per step or per token at info).
    structlog.get_logger("akv").info(
        "replay.finished",
        component="replay",
        **{k: v for k, v in report.as_json().items() if k != "step_latency_us"},
        step_latency_p50_us=report.step_latency_us.get("p50"),
        step_latency_p99_us=report.step_latency_us.get("p99"),
    )
    return report


def _preemption_victims(kv: Any, rejected: dict, appends: dict, order: list[str]) -> list[str]:
    """The sequences to preempt for the appends a step refused for want of blocks (taken out of ``order``).

    As vLLM's scheduler: one victim per refused append, newest first (``order``
    is admission order, newest last). With several shards the victims of a
    refusal are the newest sequences *on the refusing shard*: preempting one
    elsewhere frees nothing there, and a full shard beside empty ones would
    refuse the same appends every step (a livelock with ``--shards 4``).
    """
    short: dict[int, int] = {}
    for seq_id, err in rejected.items():
        if seq_id in appends and isinstance(err, PoolExhausted):
            shard = kv.shard_of(seq_id)
            short[shard] = short.get(shard, 0) + 1
    victims: list[str] = []
    for i in range(len(order) - 1, -1, -1):
        if not short:
            break
        shard = kv.shard_of(order[i])
        if short.get(shard):
            victims.append(order[i])
            short[shard] -= 1
            if not short[shard]:
                del short[shard]
    for v in victims:
        order.remove(v)
    return victims


async def _held_by_others(kv: KVCacheManager, index: int, stalled: set[int]) -> bool:
    """Whether request ``index``, refused for room while none of the replay's sequences ran, is to be dropped.

    The first such refusal waits for the pending copies (the blocks they pin
    are free once they ran) and lets the request try again; a second one in a
    row means the room is held by sequences the replay does not own (another
    user of the manager, or a replay cancelled before): waiting would never
    end, so the request is dropped as one larger than a shard is.
    """
    if index in stalled:
        return True
    stalled.add(index)
    await kv.wait_copies()
    return False


async def _free_requests(kv: KVCacheManager, indices: set[int]) -> None:
    """Free the sequences of ``indices`` (shielded; unknown ones are skipped; nothing if the manager is down)."""
    if not indices:
        return
    with anyio.CancelScope(shield=True), contextlib.suppress(ActorCrashed, ManagerClosed):
        await kv.step(frees=[f"r{i}" for i in sorted(indices)], want_metadata=False)
