"""Torch storage for akv: the paged K/V tensors, the host tier, ordered block copies, reference paged attention.

Layout of every layer's tensor (vLLM PagedAttention, FlashAttention paged KV)::

    # (2, num_blocks, block_size, num_kv_heads, head_dim), K then V

The device pool adds a null block after its ``num_blocks``; the host pool
(:class:`HostKVStorage`, ``KVStorage.host``) has the same layout without it.
"""

from akv.storage.copy_ticket import CopyTicket
from akv.storage.host_pool import HostKVStorage
from akv.storage.kv_pool import KVStorage, torch_dtype
from akv.storage.paged_attention import paged_decode_attention, paged_prefill_attention
from akv.storage.stream_worker import CopyExecutor
from akv.storage.tier_copy import TierBatch, check_tier_batch

__all__ = [
    "CopyExecutor",
    "CopyTicket",
    "HostKVStorage",
    "KVStorage",
    "TierBatch",
    "check_tier_batch",
    "paged_decode_attention",
    "paged_prefill_attention",
    "torch_dtype",
]
