"""The replay's knobs and its report (:func:`akv.replay.replay`; ``akv replay`` prints and writes the report)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from akv.core.ids import describe
from akv.errors import InvalidInput


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
HOST_FIELDS = (
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
