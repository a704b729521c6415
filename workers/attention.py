"""Attention front: batch metadata for one forward, and the layer that writes K/V into the
paged cache and attends through the selected kernels (`tidal.kernels.select_attention_ops`).

`AttentionMetadata` is built by the model runner for each step and passed explicitly down
through the model's forward; nothing about the batch is kept in module state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tidal.kernels import AttentionOps


@dataclass
class AttentionMetadata:
    """One step's batch layout (see `kernels/reference.py` for the exact conventions).

    Requests are packed in plan order; request i owns query rows
    [query_start_loc[i], query_start_loc[i+1]).
    """

    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot (block_id * block_size + offset) of each new token;
    -1 for a padding row (nothing written)."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks_per_seq] int32: each request's block ids, padded with 0."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: prefix sums of the new-token counts."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: tokens in the cache per request, including this step's."""
    scratch: dict | None = field(default_factory=dict)
    """Per-step scratch for the attention backend: index tensors it derives from the fields
    above are built by the first layer and reused by every other layer of this step. It
    lives exactly as long as this metadata (one step); nothing else may write it. None for
    metadata whose tensors change in place between uses (a captured CUDA graph's)."""


KVCache = tuple[torch.Tensor, torch.Tensor]
"""(key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""


class PagedAttention(nn.Module):
    """Write this step's K/V into the cache, then causal attention of the new queries over
    every cached token of their request (the K/V just written included)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 ops: AttentionOps):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ops = ops

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads * d]."""
        key_cache, value_cache = kv_cache
        self.ops.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = self.ops.paged_attention(q, key_cache, value_cache, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens, self.scale,
                                       scratch=meta.scratch)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
