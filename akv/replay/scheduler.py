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
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np
import structlog

from akv.core.step import Admit
from akv.errors import ActorCrashed, ManagerClosed, PoolExhausted, RequestTooLarge
from akv.manager import KVCacheManager
from akv.replay.options import HOST_FIELDS, ReplayOptions, ReplayReport
from akv.trace import TraceRequest, synthesize_output, synthesize_prompt

#: The knobs of ``akv replay`` without options.
DEFAULT_OPTIONS = ReplayOptions()


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
    options: ReplayOptions = DEFAULT_OPTIONS,
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
    scheduler = _Scheduler(kv, requests, options, progress)
    try:
        await scheduler.run()
    except BaseException:  # cancelled or failed: leave no sequence of the replay behind in the manager
        await _free_sequences(kv, scheduler.own_sequences())
        raise
    return await scheduler.finish()


class _Scheduler:
    """The state of one replay between steps (see the module docstring); :func:`replay` drives it."""

    def __init__(
        self,
        kv: KVCacheManager,
        requests: Sequence[TraceRequest],
        options: ReplayOptions,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.kv, self.requests, self.options, self.progress = kv, requests, options, progress
        cfg = kv.config
        self.report = ReplayReport(requests=len(requests), num_blocks=cfg.num_blocks, block_size=cfg.block_size)
        self.report.cached_tokens_per_request = [0] * len(requests)
        self.report.admitted_unix_s_per_request = [0.0] * len(requests)
        self.waiting: deque[tuple[int, np.ndarray | None]] = deque()  # (request index, resume tokens)
        self.arrivals = deque(range(len(requests)))
        self.running: dict[str, _Running] = {}
        self.order: list[str] = []  # admission order, newest last (preemption victims)
        self.admitted_once = [False] * len(requests)
        self.synthesized: dict[int, tuple[np.ndarray, list[int]]] = {}  # tokens of waiting requests
        self.frees: list[str] = []
        self.preempted: list[str] = []
        self.pending: list[tuple[int, np.ndarray | None, _Running]] = []  # admissions of the step in progress
        self.stalled: set[int] = set()  # requests refused admission once while none of the replay's sequences ran
        self.lone_preempted: set[int] = set()  # requests preempted once as the only running sequence
        self.commits: dict[str, int] = {}
        self.appends: dict[str, int] = {}  # the next step's decode tokens, in the order of ``running``
        self.latencies: list[float] = []
        self.now_ms = 0.0
        self.sampled_step = 0
        self.done = 0
        self.next_progress = time.perf_counter() + 1.0
        self.t_start = time.perf_counter()

    def own_sequences(self) -> list[str]:
        """Every sequence of the replay the manager may hold now (to free on cancellation)."""
        return [*self.running, *self.frees, *self.preempted, *(r.seq_id for _, _, r in self.pending)]

    async def run(self) -> None:
        """Step until every request finished or was dropped."""
        requests = self.requests
        while self.arrivals or self.waiting or self.running or self.frees or self.preempted:
            while self.arrivals and requests[self.arrivals[0]].timestamp_ms <= self.now_ms:
                self.waiting.append((self.arrivals.popleft(), None))
            if not self.running and not self.waiting and not self.frees and not self.preempted and self.arrivals:
                self.now_ms = float(requests[self.arrivals[0]].timestamp_ms)
                continue
            result = await self._step(self._admissions())
            finished, too_large = self._decoded(result)
            await self._admitted(result, finished)
            self._drop(too_large)
            self._preempt(result.rejected, finished)
            self._free_finished(finished)
            await self._observe()

    def _out_len(self, req: TraceRequest) -> int:
        n = req.output_length
        return n if self.options.max_output_tokens is None else min(n, self.options.max_output_tokens)

    def _admissions(self) -> list[Admit]:
        """The waiting requests this step admits (FCFS, within the batch, token budget and free room); sets ``pending``."""
        cfg, options = self.kv.config, self.options
        admits: list[Admit] = []
        self.pending = []
        budget = options.max_prefill_tokens
        slots = options.max_batch - len(self.running)
        # Free plus evictable blocks (a gauge): a head request that cannot fit is
        # not even tried, rather than matched and rejected every step.
        available = self.kv.blocks_available
        while self.waiting and slots > 0:
            index, resume = self.waiting[0]
            prompt, outputs = self._tokens(index)
            tokens = prompt if resume is None else np.concatenate([prompt, resume])
            if admits and len(tokens) > budget:
                break
            blocks = -(-len(tokens) // cfg.block_size)
            alone = not self.running and not admits  # none of the replay's sequences holds blocks
            if blocks > available and blocks <= cfg.num_blocks // cfg.num_shards and not alone:
                break  # wait for room (FCFS); a request larger than a shard is rejected by the manager
            available -= blocks
            self.waiting.popleft()
            r = _Running(index, f"r{index}", len(prompt), self._out_len(self.requests[index]), outputs)
            if resume is not None:
                r.generated = len(resume)
            admits.append(Admit(seq_id=r.seq_id, prompt=tokens, prefill_done=True, resumed=resume is not None))
            self.pending.append((index, resume, r))
            budget -= len(tokens)
            slots -= 1
        return admits

    def _tokens(self, index: int) -> tuple[np.ndarray, list[int]]:
        """Request ``index``'s prompt and output tokens, synthesized once while it waits."""
        if index not in self.synthesized:
            req, options, vocab = self.requests[index], self.options, self.kv.config.vocab_size
            self.synthesized[index] = (
                synthesize_prompt(
                    req.hash_ids,
                    req.input_length,
                    vocab_size=vocab,
                    trace_block_tokens=options.trace_block_tokens,
                    seed=options.seed,
                ),
                synthesize_output(req.index, self._out_len(req), vocab_size=vocab, seed=options.seed).tolist(),
            )
        return self.synthesized[index]

    async def _step(self, admits: list[Admit]) -> Any:
        """One ``KVCacheManager.step``, timed; then its copies awaited (``wait_copies``) as a runner would."""
        t0 = time.perf_counter()
        result = await self.kv.step(
            frees=self.frees,
            preempted=self.preempted,
            commits=self.commits,
            appends=self.appends,
            admits=admits,
            want_metadata=self.options.want_metadata,
        )
        t1 = time.perf_counter()
        self.latencies.append(t1 - t0)
        if self.options.wait_copies and result.copies.tickets:
            await result.copies.wait()
            self.report.copy_wait_s += time.perf_counter() - t1
        self.report.decode_steps += 1
        self.frees, self.preempted, self.commits = [], [], {}
        return result

    def _decoded(self, result: Any) -> tuple[dict[str, None], list[str]]:
        """Commit the step's decoded tokens and queue the next ones.

        Rejected appends retry the same token. Everything stays in the order
        of ``running`` (admission order), which the frees follow.

        Returns:
            The sequences that finished, and those that outgrew a shard
            (dropped by :meth:`_drop`, never retried).
        """
        rejected = result.rejected
        next_appends: dict[str, int] = {}
        finished: dict[str, None] = {}
        too_large: list[str] = []
        for seq_id, token in self.appends.items():
            if rejected and seq_id in rejected:
                if isinstance(rejected[seq_id], RequestTooLarge):
                    too_large.append(seq_id)
                else:
                    next_appends[seq_id] = token
                continue
            r = self.running[seq_id]
            r.generated += 1
            self.commits[seq_id] = 1
            if r.generated < r.output_len:
                next_appends[seq_id] = r.outputs[r.generated]
            else:
                finished[seq_id] = None
        self.report.output_tokens += len(self.commits)
        self.appends = next_appends
        return finished, too_large

    def _drop(self, seq_ids: list[str]) -> None:
        """Free running sequences that can never run on (counted as rejected)."""
        for seq_id in seq_ids:
            self.running.pop(seq_id)
            self.order.remove(seq_id)
            self.frees.append(seq_id)
            self.report.requests_rejected += 1
            self.done += 1

    async def _admitted(self, result: Any, finished: dict[str, None]) -> None:
        """Record the step's admissions; requeue the refused ones at the head, drop those that can never run."""
        report = self.report
        requeue: list[tuple[int, np.ndarray | None]] = []
        for index, resume, r in self.pending:
            err = result.rejected.get(r.seq_id)
            if err is None:
                self.synthesized.pop(index, None)
                self.stalled.discard(index)
                self._count_admission(index, r, result.cached_tokens[r.seq_id])
                self.running[r.seq_id] = r
                self.order.append(r.seq_id)
                if r.generated < r.output_len:
                    self.appends[r.seq_id] = r.outputs[r.generated]
                else:
                    finished[r.seq_id] = None
            elif isinstance(err, RequestTooLarge) or (
                not self.running and await _held_by_others(self.kv, index, self.stalled)
            ):
                self.synthesized.pop(index, None)
                report.requests_rejected += 1
                self.done += 1
            else:
                requeue.append((index, resume))
        self.pending = []
        self.waiting.extendleft(reversed(requeue))

    def _count_admission(self, index: int, r: _Running, cached: int) -> None:
        """Hit accounting of an admission: first admissions count, re-admissions apart."""
        report = self.report
        if self.admitted_once[index]:
            report.readmissions += 1
            report.readmit_prompt_tokens += r.prompt_len + r.generated
            report.readmit_cached_tokens += cached
        else:
            self.admitted_once[index] = True
            report.prompt_tokens += r.prompt_len
            report.cached_tokens += cached
            report.cached_tokens_per_request[index] = cached
            report.admitted_unix_s_per_request[index] = time.time()

    def _preempt(self, rejected: dict, finished: dict[str, None]) -> None:
        """Preempt the newest sequences for the appends refused for want of blocks; they wait at the head."""
        lone = len(self.running) == 1  # preempting the only running sequence frees room for nobody else
        for victim in _preemption_victims(self.kv, rejected, self.appends, self.order):
            r = self.running.pop(victim)
            self.commits.pop(victim, None)
            self.appends.pop(victim, None)
            finished.pop(victim, None)
            if lone and r.index in self.lone_preempted:  # refused alone twice: the room is held by others
                self.frees.append(victim)
                self.report.requests_rejected += 1
                self.done += 1
                continue
            if lone:
                self.lone_preempted.add(r.index)
            self.preempted.append(victim)
            self.report.preemptions += 1
            self.waiting.appendleft((r.index, np.array(r.outputs[: r.generated], dtype=np.int32)))

    def _free_finished(self, finished: dict[str, None]) -> None:
        """The finished sequences are freed in the next step."""
        for seq_id in finished:
            self.running.pop(seq_id)
            self.order.remove(seq_id)
            self.commits.pop(seq_id, None)
            self.frees.append(seq_id)
            self.report.requests_finished += 1
            self.done += 1

    async def _observe(self) -> None:
        """Peaks, the timeline sample, progress; then simulated time advances one step."""
        report, options = self.report, self.options
        report.peak_blocks_in_use = max(report.peak_blocks_in_use, self.kv.blocks_in_use)
        report.peak_running = max(report.peak_running, len(self.running))
        every = options.timeline_every_steps
        if every and (report.decode_steps == 1 or report.decode_steps % every == 0):
            report.timeline.append(_sample(self.now_ms, await self.kv.stats()))
            self.sampled_step = report.decode_steps
        self.now_ms += options.step_ms
        if self.progress is not None and time.perf_counter() >= self.next_progress:
            self.progress(self.done, len(self.requests))
            self.next_progress = time.perf_counter() + 1.0

    async def finish(self) -> ReplayReport:
        """Complete the report (the last timeline sample, the manager's counters, the latencies) and log it."""
        kv, report, options = self.kv, self.report, self.options
        if (
            options.timeline_every_steps and report.decode_steps > self.sampled_step
        ):  # the last step, so a short run has two
            report.timeline.append(_sample(self.now_ms - options.step_ms, await kv.stats()))
        if self.progress is not None:
            self.progress(self.done, len(self.requests))
        report.wall_s = time.perf_counter() - self.t_start
        report.simulated_s = self.now_ms / 1000.0
        report.hit_rate = report.cached_tokens / report.prompt_tokens if report.prompt_tokens else 0.0
        stats = await kv.stats()
        report.evictions = stats.blocks_evicted
        report.cow_copies = stats.cow_copies
        for name in HOST_FIELDS:
            setattr(report, name, getattr(stats, name))
        if self.latencies:
            lat = np.array(self.latencies) * 1e6
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


async def _free_sequences(kv: KVCacheManager, seq_ids: list[str]) -> None:
    """Free the replay's ``seq_ids`` (shielded; unknown ones are skipped; nothing if the manager is down)."""
    if not seq_ids:
        return
    with anyio.CancelScope(shield=True), contextlib.suppress(ActorCrashed, ManagerClosed):
        await kv.step(frees=list(dict.fromkeys(seq_ids)), want_metadata=False)
