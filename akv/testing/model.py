"""A tiny decoder-only transformer that reads its K/V either from a dense cache or through akv.

The point of this model is a correctness oracle for the paged cache, not
quality: seeded random weights (no downloads), float32, a Llama-style block
(Touvron et al., 2023; Hugging Face ``LlamaForCausalLM``):

- RMSNorm before attention and before the MLP (Zhang & Sennrich, 2019),
- rotary position embeddings on queries and keys (RoFormer, Su et al., 2021;
  the ``rotate_half`` convention of Hugging Face Llama),
- grouped-query attention (Ainslie et al., 2023): query head ``h`` reads KV
  head ``h // (num_heads // num_kv_heads)``,
- a SwiGLU MLP (Shazeer, 2020), and tied or untied embeddings.

Everything except attention is one code path (:meth:`TinyLM.forward`); the
K/V cache is plugged in as an attention function, so the two paths differ
exactly where a KV cache manager can be wrong:

- :meth:`TinyLM.forward_dense`: a :class:`DenseKVCache` per sequence, K/V
  appended as contiguous tensors, attention by
  :func:`torch.nn.functional.scaled_dot_product_attention` (the reference).
- :meth:`TinyLM.forward_paged`: the new tokens' K/V are scattered into
  ``kv.storage`` at the step's ``slot_mapping``
  (:meth:`~akv.storage.KVStorage.write`, vLLM ``reshape_and_cache``) and
  attention reads every K/V through the block tables
  (:func:`~akv.storage.paged_prefill_attention`,
  :func:`~akv.storage.paged_decode_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from akv.config import KVCacheConfig, ModelShape
from akv.results import StepResult
from akv.storage import KVStorage, paged_decode_attention, paged_prefill_attention

__all__ = ["DenseKVCache", "PagedBatch", "TinyLM", "TinyLMConfig"]

#: ``attend(layer, query, key, value) -> out``: query ``(n, num_heads, head_dim)``,
#: key/value ``(n, num_kv_heads, head_dim)`` of the n new tokens; out like query.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyLMConfig:
    """Shape and seed of a :class:`TinyLM`.

    Args:
        vocab_size: Token ids lie in ``[0, vocab_size)``.
        hidden_size: Width of the residual stream.
        num_layers: Decoder blocks (one K/V tensor each in the cache).
        num_heads: Query heads per layer.
        num_kv_heads: Key/value heads per layer; ``num_heads`` must be a multiple.
        head_dim: Elements per head (even, for RoPE).
        intermediate_size: Width of the SwiGLU MLP.
        rope_theta: RoPE base; frequencies ``theta ** (-2i / head_dim)``.
        rms_norm_eps: RMSNorm epsilon.
        tie_embeddings: The LM head reuses the token embedding matrix.
        logit_scale: Multiplies the logits; keeps the next-token distribution
            neither flat (near-ties in greedy) nor one-hot (identical samples).
        seed: Seed of the weights (a CPU ``torch.Generator``, so equal on every device).

    Raises:
        ValueError: A size is not a positive int, ``num_heads`` is not a
            multiple of ``num_kv_heads``, or ``head_dim`` is odd.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    logit_scale: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def model_shape(self) -> ModelShape:
        """The attention shape that sizes the manager's blocks (float32 K/V)."""
        return ModelShape(
            name="tiny-lm",
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype="float32",
        )

    def kv_cache_config(
        self, *, num_blocks: int = 256, block_size: int = 4, device: str = "cpu", **overrides
    ) -> KVCacheConfig:
        """A :class:`~akv.config.KVCacheConfig` whose tensors this model can write and read.

        Defaults suit tests: real tensors, small blocks (so short prompts span
        several blocks and partial tails), invariants checked after every
        message, the background eviction loop off (``low_watermark=0``).

        Args:
            num_blocks: Blocks in the pool.
            block_size: Tokens per block.
            device: Device of the K/V tensors (``"cpu"``, ``"cuda"``).
            **overrides: Any other :class:`~akv.config.KVCacheConfig` field.
        """
        fields = {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "model": self.model_shape(),
            "storage": "tensors",
            "device": device,
            "vocab_size": self.vocab_size,
            "debug_invariants": True,
            "low_watermark": 0.0,
            "high_watermark": 0.0,
        }
        fields.update(overrides)
        return KVCacheConfig(**fields)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dim (RMSNorm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over halves of the last dim (Hugging Face Llama RoPE)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DenseKVCache:
    """The reference cache of one sequence: contiguous K and V per layer.

    Appending builds new tensors (``torch.cat``) and never writes into old
    ones, so :meth:`clone` (for a beam that branches) can share them safely.

    Attributes:
        keys: Per layer, ``(num_tokens, num_kv_heads, head_dim)``.
        values: Per layer, same shape as ``keys``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, device: str | torch.device) -> None:
        empty = torch.zeros(0, num_kv_heads, head_dim, device=device)
        self.keys: list[torch.Tensor] = [empty] * num_layers
        self.values: list[torch.Tensor] = [empty] * num_layers

    @property
    def num_tokens(self) -> int:
        """Tokens cached (their positions are ``0..num_tokens-1``)."""
        return self.keys[0].shape[0]

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens' K/V ``(n, num_kv_heads, head_dim)`` to ``layer``; return the whole K and V."""
        self.keys[layer] = torch.cat((self.keys[layer], key))
        self.values[layer] = torch.cat((self.values[layer], value))
        return self.keys[layer], self.values[layer]

    def clone(self) -> DenseKVCache:
        """An independent cache with the same contents (O(num_layers))."""
        other = DenseKVCache.__new__(DenseKVCache)
        other.keys, other.values = list(self.keys), list(self.values)
        return other


@dataclass(frozen=True, kw_only=True, slots=True)
class PagedBatch:
    """One step's attention metadata, from a :class:`~akv.results.StepResult`.

    Attributes:
        slot_mapping: int64 ``(num_tokens,)`` slots of the new tokens.
        block_tables: int32 ``(batch, max_blocks)``.
        context_lens: int32 ``(batch,)`` tokens per row including the new ones.
        query_start_loc: int32 ``(batch + 1,)`` row offsets into the new tokens.
        positions: int64 ``(num_tokens,)`` position of each new token, on the
            model's device: row ``i``'s are ``context_lens[i] - q_len_i + arange(q_len_i)``.
        is_decode: Every row has exactly one new token.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    positions: torch.Tensor
    is_decode: bool

    @classmethod
    def from_step(cls, result: StepResult, device: str | torch.device) -> PagedBatch:
        """Build the metadata of ``result``'s rows (the model's inputs follow the same row order).

        Raises:
            ValueError: The step was made with ``want_metadata=False``.
        """
        if result.slot_mapping is None or result.block_tables is None:
            raise ValueError("the step has no metadata (want_metadata=False)")
        qsl = result.query_start_loc.to(torch.int64)
        q_lens = qsl.diff()
        row_of = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
        offset = torch.arange(int(qsl[-1])) - qsl[row_of]
        positions = (result.context_lens.to(torch.int64) - q_lens)[row_of] + offset
        return cls(
            slot_mapping=result.slot_mapping,
            block_tables=result.block_tables,
            context_lens=result.context_lens,
            query_start_loc=result.query_start_loc,
            positions=positions.to(device),
            is_decode=bool((q_lens == 1).all()),
        )


class TinyLM(nn.Module):
    """Seeded random decoder-only transformer with dense and paged KV-cache forward passes.

    Args:
        config: Sizes and seed.
        device: Device of the weights (generated on CPU from the seed, then moved,
            so CPU and CUDA models are the same function).
    """

    def __init__(self, config: TinyLMConfig = TinyLMConfig(), *, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = c = config
        gen = torch.Generator().manual_seed(c.seed)

        def param(*shape: int, std: float | None = None, ones: bool = False) -> nn.Parameter:
            if ones:
                data = torch.ones(shape)
            else:
                scale = std if std is not None else shape[-1] ** -0.5  # fan-in scaling for (out, in) matrices
                data = torch.randn(shape, generator=gen) * scale
            return nn.Parameter(data.to(device), requires_grad=False)

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = param(c.vocab_size, c.hidden_size, std=1.0)  # (vocab, hidden)
        self.layers = nn.ModuleList()
        for _ in range(c.num_layers):
            layer = nn.Module()
            layer.attn_norm = param(c.hidden_size, ones=True)
            layer.wq = param(q_dim, c.hidden_size)  # (out, in), as nn.Linear
            layer.wk = param(kv_dim, c.hidden_size)
            layer.wv = param(kv_dim, c.hidden_size)
            layer.wo = param(c.hidden_size, q_dim)
            layer.mlp_norm = param(c.hidden_size, ones=True)
            layer.w_gate = param(c.intermediate_size, c.hidden_size)
            layer.w_up = param(c.intermediate_size, c.hidden_size)
            layer.w_down = param(c.hidden_size, c.intermediate_size)
            self.layers.append(layer)
        self.final_norm = param(c.hidden_size, ones=True)
        self.lm_head = self.embed if c.tie_embeddings else param(c.vocab_size, c.hidden_size, std=1.0)
        inv_freq = c.rope_theta ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        self.register_buffer("inv_freq", inv_freq.float().to(device), persistent=False)

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.embed.device

    def new_dense_cache(self) -> DenseKVCache:
        """An empty reference cache for one sequence on the model's device."""
        c = self.config
        return DenseKVCache(c.num_layers, c.num_kv_heads, c.head_dim, device=self.device)

    # ----------------------------------------------------------------- core
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``(n, heads, head_dim)`` by the angles of ``positions`` ``(n,)`` int64."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (n, head_dim / 2)
        emb = torch.cat((angles, angles), dim=-1)[:, None, :]  # (n, 1, head_dim)
        return x * emb.cos() + rotate_half(x) * emb.sin()

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """Run the decoder over new tokens, attention delegated to ``attend``.

        Args:
            token_ids: int64 ``(n,)`` new tokens (any number of sequences,
                packed), on the model's device.
            positions: int64 ``(n,)`` their positions in their sequences.
            attend: Stores the new K/V and returns attention over each token's
                context; see :data:`AttendFn`.

        Returns:
            float32 logits ``(n, vocab_size)``.
        """
        c = self.config
        n = token_ids.shape[0]
        h = self.embed[token_ids]  # (n, hidden)
        for index, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, c.rms_norm_eps)
            q = (x @ layer.wq.T).view(n, c.num_heads, c.head_dim)
            k = (x @ layer.wk.T).view(n, c.num_kv_heads, c.head_dim)
            v = (x @ layer.wv.T).view(n, c.num_kv_heads, c.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            attn = attend(index, q, k.contiguous(), v.contiguous())  # (n, num_heads, head_dim)
            h = h + attn.reshape(n, c.num_heads * c.head_dim) @ layer.wo.T
            x = rms_norm(h, layer.mlp_norm, c.rms_norm_eps)
            h = h + (F.silu(x @ layer.w_gate.T) * (x @ layer.w_up.T)) @ layer.w_down.T
        h = rms_norm(h, self.final_norm, c.rms_norm_eps)
        return (h @ self.lm_head.T) * c.logit_scale

    # ---------------------------------------------------------- dense path
    def forward_dense(self, token_ids: torch.Tensor, cache: DenseKVCache) -> torch.Tensor:
        """Reference forward of one sequence's next tokens with a dense cache.

        The new tokens take positions ``cache.num_tokens ..``; their K/V are
        appended to ``cache``; each attends causally to the whole history
        (SDPA with a bottom-right aligned causal mask, GQA via ``enable_gqa``).

        Args:
            token_ids: int64 ``(n,)`` new tokens of one sequence, ``n >= 1``.
            cache: The sequence's cache; grows by ``n`` tokens.

        Returns:
            float32 logits ``(n, vocab_size)``.
        """
        start = cache.num_tokens
        n = token_ids.shape[0]
        positions = torch.arange(start, start + n, device=self.device)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.append(layer, k, v)  # (start + n, H_kv, D)
            total = keys.shape[0]
            allowed = torch.arange(total, device=q.device)[None, :] <= positions[:, None]  # (n, total)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],  # (1, H, n, D)
                keys.transpose(0, 1)[None],  # (1, H_kv, total, D)
                values.transpose(0, 1)[None],
                attn_mask=allowed,
                enable_gqa=True,
            )
            return out[0].transpose(0, 1)  # (n, H, D)

        return self.forward(token_ids.to(self.device), positions, attend)

    # ---------------------------------------------------------- paged path
    def forward_paged(self, token_ids: torch.Tensor, batch: PagedBatch, storage: KVStorage) -> torch.Tensor:
        """Forward a packed batch through the paged cache, as a model runner does for one step.

        For every layer: write the new tokens' K/V at ``batch.slot_mapping``
        (:meth:`~akv.storage.KVStorage.write`), then attend through the block
        tables: :func:`~akv.storage.paged_decode_attention` when every row has
        one new token, else :func:`~akv.storage.paged_prefill_attention`
        (causal over cached prefix plus new tokens). The caller has already
        waited for the step's copies (``await result.copies.wait()``, or on
        CUDA ``current_stream().wait_event`` on ``result.copies.fences``).

        Args:
            token_ids: int64 ``(num_tokens,)`` the new tokens of every row, in
                row order (``query_start_loc`` splits them).
            batch: The step's metadata (:meth:`PagedBatch.from_step`).
            storage: ``kv.storage`` of the manager (float32 tensors on the model's device).

        Returns:
            float32 logits ``(num_tokens, vocab_size)``.
        """

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            storage.write(layer, batch.slot_mapping, k, v)
            cache = storage.kv_caches[layer]  # (2, num_blocks, block_size, num_kv_heads, head_dim), K then V
            if batch.is_decode:
                return paged_decode_attention(q, cache, batch.block_tables, batch.context_lens)
            return paged_prefill_attention(q, cache, batch.block_tables, batch.query_start_loc, batch.context_lens)

        return self.forward(token_ids.to(self.device), batch.positions, attend)
