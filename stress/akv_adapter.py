"""akv's adapter for the peer harness (../shared/peers/peer_bench.py).

Drives the public :class:`akv.KVCacheManager` API through its per-step batch
call, with all actors running, exactly as a serving stack would::

    .peers-venv/bin/python ../shared/peers/peer_bench.py --peers vllm,sglang \\
        --adapter stress/akv_adapter.py:make --size large

(The peers' venv needs akv importable: ``.peers-venv/bin/pip install --no-deps -e .``
plus anyio, structlog and rich; see docs/benchmarks.md.)

Mapping of the harness's calls onto akv (each is one ``kv.step`` message):

- ``admit(seqs)``: one step admitting every new sequence (prefix match and
  allocation of the whole prompt; the runner computes the prefill in this
  step, so the prompt is committed and published at once, ``prefill_done``).
  The first sampled token is kept by the adapter: in akv a token's KV slot is
  allocated when it is appended, which the harness does at the next decode.
- ``decode(seqs, tokens)``: one step that commits each sequence's previous
  token and appends its newest one (allocating its slot, a new block at a
  block boundary, copy-on-write if shared).
- ``finish(seqs)``: one step freeing the sequences (idempotent).

Block tables: the adapter asks for ``block_tables="updates"``, the entries that
changed (a decode step: one per row; an admission: its whole table), as a
runner that keeps its own block tables does: vLLM's model runner keeps a
``BlockTable`` per request and applies each step's ``new_block_ids``, and
SGLang's ``alloc_for_decode`` writes one slot per sequence into the
``req_to_token`` pool the runner reads. (Before this adapter took the option,
akv built the batch's whole padded tables every step, 30 rows of up to 7,600
blocks on the conversation trace; ``block_tables="full"``, the manager's
default, still does.) Slot mappings, context lengths and query start
locations are built every step either way.
"""

from __future__ import annotations

from typing import Any

from akv import Admit, KVCacheConfig, KVCacheManager, ModelShape
from akv.obs import configure_logging


class AkvAdapter:
    """Peer-harness adapter over :class:`akv.KVCacheManager` (metadata mode)."""

    name = "akv"
    level = "akv.KVCacheManager.step (actors running, one message per call)"

    def __init__(self, workload: Any, eviction_policy: str | None = None) -> None:
        self.w = workload
        #: ``KVCacheConfig.eviction_policy`` name; ``None`` keeps the config's default.
        self.eviction_policy = eviction_policy
        self.kv: KVCacheManager | None = None
        self._cm: KVCacheManager | None = None

    async def start(self) -> None:
        """Enter the manager (not timed by the harness)."""
        configure_logging(level="warning")  # an application's choice: structlog's default prints debug events
        w = self.w
        extra = {} if self.eviction_policy is None else {"eviction_policy": self.eviction_policy}
        config = KVCacheConfig(
            num_blocks=w.num_blocks - 1,  # the same usable count as vLLM (block 0 is its null block)
            block_size=w.block_size,
            model=ModelShape(name="peer-bench", num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16"),
            storage="none",
            vocab_size=w.vocab,
            **extra,
        )
        self._cm = KVCacheManager(config)
        self.kv = await self._cm.__aenter__()

    async def admit(self, seqs: list) -> list[int]:
        """Admit new sequences in one step; return their cached prompt tokens."""
        result = await self.kv.step(
            admits=[Admit(seq_id=s.rid, prompt=s.prompt, prefill_done=True) for s in seqs],
            block_tables="updates",
        )
        hits = []
        for s in seqs:
            if s.rid in result.rejected:
                raise result.rejected[s.rid]
            s.handle = s.out_tokens[0]  # the token whose slot the next decode allocates
            hits.append(result.cached_tokens[s.rid])
        return hits

    async def decode(self, seqs: list, tokens: list[int]) -> None:
        """One decode step for every running sequence."""
        appends = {s.rid: s.handle for s in seqs}
        commits = {s.rid: 1 for s in seqs if s.decoded}
        result = await self.kv.step(commits=commits, appends=appends, block_tables="updates")
        if result.rejected:
            raise next(iter(result.rejected.values()))
        for s, tok in zip(seqs, tokens):
            s.handle = tok

    async def finish(self, seqs: list) -> None:
        """Free finished sequences (their full blocks stay in the prefix cache)."""
        await self.kv.step(frees=[s.rid for s in seqs], want_metadata=False)

    def active_blocks(self) -> int:
        """Blocks referenced by live sequences (a gauge the shards publish)."""
        return self.kv.blocks_in_use

    async def idle_check(self) -> str:
        """After the run: every block free or cached, full consistency check."""
        await self.kv.check()
        stats = await self.kv.stats()
        if stats.active or stats.in_flight or stats.num_sequences:
            return f"leak: active={stats.active} in_flight={stats.in_flight} sequences={stats.num_sequences}"
        return "ok"

    def step_begin(self) -> None:
        """No per-step hook needed."""

    def breakdown(self) -> dict[str, float]:
        """No sub-phase timers."""
        return {}

    async def close(self) -> None:
        """Leave the manager (not timed)."""
        await self._cm.__aexit__(None, None, None)


def make(workload: Any, eviction_policy: str | None = None) -> AkvAdapter:
    """Factory the harness calls once per run (``eviction_policy``: a
    ``KVCacheConfig.eviction_policy`` name; ``None``, the default, keeps the config's)."""
    return AkvAdapter(workload, eviction_policy)
