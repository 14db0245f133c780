"""Reference paged attention in plain torch (CPU and CUDA), for checking the cache.

Reads K/V through block tables from one layer's cache in the layout of vLLM's
PagedAttention (Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023) and FlashAttention's paged KV
cache (``flash_attn_with_kvcache(..., block_table=...)``)::

    # (2, num_blocks, block_size, num_kv_heads, head_dim), K then V

It gathers each sequence's blocks into a padded dense tensor, masks positions
beyond the context, and computes ``softmax(q k^T * scale) v`` in float32, so it
is exact enough to test against :func:`torch.nn.functional.scaled_dot_product_attention`.
It is a correctness oracle, not a fast kernel: memory is
``O(batch * max_context * num_kv_heads * head_dim)``.

Grouped-query attention (Ainslie et al., 2023): query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``, as in vLLM and Hugging Face ``repeat_kv``.
"""

from __future__ import annotations

import math

import torch

from akv.errors import InvalidInput


def _int_tensor(t: torch.Tensor, name: str, dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != dim:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise InvalidInput(f"{name} must be a {dim}-D int32 tensor, got {got}")
    return t.to(torch.int64)


def _check_query(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int]:
    """Validate query against the cache; return ``(num_kv_heads, group_size)``."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        got = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
        raise InvalidInput(f"kv_cache must be (2, num_blocks, block_size, num_kv_heads, head_dim), got {got}")
    if not isinstance(query, torch.Tensor) or query.dim() != 3 or not query.is_floating_point():
        raise InvalidInput("query must be a 3-D floating-point tensor (tokens, num_heads, head_dim)")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if head_dim != kv_cache.shape[4]:
        raise InvalidInput(f"query head_dim {head_dim} != kv_cache head_dim {kv_cache.shape[4]}")
    if num_heads % num_kv_heads != 0:
        raise InvalidInput(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.device != kv_cache.device:
        raise InvalidInput(f"query is on {query.device} but kv_cache is on {kv_cache.device}")
    return num_kv_heads, num_heads // num_kv_heads


def _dense_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather K and V by block table into padded dense float32 tensors.

    Returns:
        ``(key, value, context_lens)``: key and value ``(batch, T, num_kv_heads,
        head_dim)`` float32 with ``T = ceil(max(context_lens) / block_size) *
        block_size``, and context lens as int64 on the cache device.
    """
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    tables = _int_tensor(block_tables, "block_tables", 2).cpu()
    lens = _int_tensor(context_lens, "context_lens", 1).cpu()
    batch, max_blocks = tables.shape
    if lens.numel() != batch:
        raise InvalidInput(f"context_lens has {lens.numel()} entries but block_tables has {batch} rows")
    if batch and (int(lens.min()) < 0 or int(lens.max()) > max_blocks * block_size):
        raise InvalidInput(f"context_lens must lie in [0, {max_blocks * block_size}], got {lens.tolist()}")
    used_blocks = -(-int(lens.max()) // block_size) if batch else 0
    tables = tables[:, :used_blocks]
    # Only entries covering a context position must be valid; padding is replaced by block 0.
    needed = torch.arange(used_blocks) * block_size < lens[:, None]  # (batch, used_blocks)
    ids = tables[needed]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise InvalidInput(f"block_tables holds ids outside [0, {num_blocks}) within the context")
    tables = torch.where(needed, tables, 0).to(kv_cache.device)
    # (batch, used_blocks, block_size, H, D) -> (batch, T, H, D)
    key = kv_cache[0][tables].flatten(1, 2).float()
    value = kv_cache[1][tables].flatten(1, 2).float()
    return key, value, lens.to(kv_cache.device)


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked softmax attention in float32.

    Args:
        query: ``(batch, H_kv, G, Q, D)`` float32.
        key: ``(batch, T, H_kv, D)`` float32.
        value: ``(batch, T, H_kv, D)`` float32.
        allowed: ``(batch, Q, T)`` bool, True where the query may attend.
        scale: Softmax scale.

    Returns:
        ``(batch, H_kv, G, Q, D)`` float32. Rows with nothing allowed get a
        uniform average (never NaN); callers only read rows with something allowed.
    """
    scores = torch.einsum("bhgqd,bthd->bhgqt", query, key) * scale
    scores = scores.masked_fill(~allowed[:, None, None], torch.finfo(torch.float32).min)
    return torch.einsum("bhgqt,bthd->bhgqd", torch.softmax(scores, dim=-1), value)


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step: each sequence's single query attends to its whole context.

    Semantics of vLLM's ``paged_attention_v1`` (PagedAttention, SOSP 2023):
    sequence ``i`` attends to the ``context_lens[i]`` tokens at logical
    positions ``0..context_lens[i]-1``, position ``p`` living in block
    ``block_tables[i, p // block_size]`` at offset ``p % block_size``.
    Vectorized over the batch; softmax in float32.

    Args:
        query: ``(batch, num_heads, head_dim)`` floating point, on the cache device.
        kv_cache: One layer's cache ``(2, num_blocks, block_size, num_kv_heads,
            head_dim)``, K then V (vLLM / FlashAttention paged KV layout).
        block_tables: ``(batch, max_blocks)`` int32 (int64 accepted); entries
            past a sequence's last block are ignored (padding).
        context_lens: ``(batch,)`` int32 tokens of context per sequence, each in
            ``[1, max_blocks * block_size]``.
        scale: Softmax scale; default ``1 / sqrt(head_dim)``.

    Returns:
        ``(batch, num_heads, head_dim)`` in the query's dtype.

    Raises:
        InvalidInput: Shapes disagree, ``num_heads`` not a multiple of
            ``num_kv_heads``, a context length out of range, or a block id out
            of range within a context.
    """
    num_kv_heads, group = _check_query(query, kv_cache)
    batch, num_heads, head_dim = query.shape
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise InvalidInput(f"block_tables must be (batch={batch}, max_blocks), got {tuple(block_tables.shape)}")
    key, value, lens = _dense_kv(kv_cache, block_tables, context_lens)
    if batch and int(lens.min()) < 1:
        raise InvalidInput("decode needs context_lens >= 1 for every sequence")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q = query.float().view(batch, num_kv_heads, group, 1, head_dim)
    allowed = (torch.arange(key.shape[1], device=lens.device) < lens[:, None])[:, None, :]  # (batch, 1, T)
    out = _attend(q, key, value, allowed, scale)  # (batch, H_kv, G, 1, D)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention for a packed batch of prefill (or chunked-prefill) tokens.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``
    (``q_len_i`` rows, vLLM's ``query_start_loc``); they are the last
    ``q_len_i`` positions of its ``context_lens[i]`` tokens (the context
    includes any cached prefix and the new tokens, whose K/V must already be
    written). The query at position ``p`` attends to positions ``<= p``
    (bottom-right aligned causal mask, as FlashAttention's ``flash_attn_varlen``
    with ``seqlen_q <= seqlen_k``). Vectorized: queries are padded to
    ``(batch, max_q_len)``; softmax in float32.

    Args:
        query: ``(num_tokens, num_heads, head_dim)`` floating point, packed.
        kv_cache: One layer's cache ``(2, num_blocks, block_size, num_kv_heads,
            head_dim)``, K then V.
        block_tables: ``(batch, max_blocks)`` int32 (int64 accepted).
        query_start_loc: ``(batch + 1,)`` int32 cumulative query offsets,
            ``0`` first and ``num_tokens`` last, non-decreasing.
        context_lens: ``(batch,)`` int32 with ``q_len_i <= context_lens[i] <=
            max_blocks * block_size``.
        scale: Softmax scale; default ``1 / sqrt(head_dim)``.

    Returns:
        ``(num_tokens, num_heads, head_dim)`` in the query's dtype.

    Raises:
        InvalidInput: Shapes disagree, GQA ratio not integral, offsets not
            cumulative, a query longer than its context, or a block id out of
            range within a context.
    """
    num_kv_heads, group = _check_query(query, kv_cache)
    num_tokens, num_heads, head_dim = query.shape
    starts = _int_tensor(query_start_loc, "query_start_loc", 1).cpu()
    lens_cpu = _int_tensor(context_lens, "context_lens", 1).cpu()
    batch = lens_cpu.numel()
    if starts.numel() != batch + 1 or int(starts[0]) != 0 or int(starts[-1]) != num_tokens:
        raise InvalidInput(
            f"query_start_loc must have batch + 1 = {batch + 1} entries from 0 to num_tokens = {num_tokens}, "
            f"got {starts.tolist()}"
        )
    q_lens = starts.diff()
    if bool((q_lens < 0).any()) or bool((q_lens > lens_cpu).any()):
        raise InvalidInput(f"query lengths {q_lens.tolist()} must be >= 0 and <= context_lens {lens_cpu.tolist()}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise InvalidInput(f"block_tables must be (batch={batch}, max_blocks), got {tuple(block_tables.shape)}")
    key, value, lens = _dense_kv(kv_cache, block_tables, context_lens)
    if num_tokens == 0:
        return query.new_zeros(query.shape)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    device = query.device
    max_q = int(q_lens.max())
    seq_idx = torch.repeat_interleave(torch.arange(batch), q_lens)  # (num_tokens,)
    row_idx = torch.arange(num_tokens) - starts[seq_idx]  # row within its sequence
    seq_idx, row_idx = seq_idx.to(device), row_idx.to(device)
    q = query.new_zeros((batch, max_q, num_heads, head_dim), dtype=torch.float32)
    q[seq_idx, row_idx] = query.float()
    q = q.view(batch, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # (B, H_kv, G, Q, D)
    # Absolute position of each padded query row; rows past q_len_i are padding.
    pos = (lens - q_lens.to(device))[:, None] + torch.arange(max_q, device=device)  # (B, Q)
    t = torch.arange(key.shape[1], device=device)
    allowed = (t <= pos[:, :, None]) & (t < lens[:, None, None])  # (B, Q, T)
    out = _attend(q, key, value, allowed, scale)  # (B, H_kv, G, Q, D)
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, max_q, num_heads, head_dim)
    return out[seq_idx, row_idx].to(query.dtype)
