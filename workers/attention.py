"""Attention front: what one forward passes down to every attention layer, and the layer that
writes K/V into the paged cache and attends through the selected backend
(`tidal.kernels.attention.select_attention_backend`).

`AttentionInputs` (the step's `AttentionMetadata` and the backend's plan for it) is built by
the model runner for each step and passed explicitly down through the model's forward;
nothing about the batch is kept in module state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.attention import AttentionBackend
from ..kernels.attention.metadata import AttentionMetadata

__all__ = ["AttentionInputs", "AttentionMetadata", "KVCache", "PagedAttention"]


@dataclass(frozen=True)
class AttentionInputs:
    """Everything the attention layers of one forward read about the batch."""

    meta: AttentionMetadata
    """The batch layout (a pure description of the batch)."""
    plan: object | None
    """What `backend.prepare(meta, ...)` returned: derived from `meta` once per step, before
    the forward, and shared by every layer. Valid only with that `meta`'s values: None for
    a captured CUDA graph's metadata, whose tensors are rewritten before every replay (only
    backends that need no plan can be captured)."""


KVCache = tuple[torch.Tensor, torch.Tensor]
"""(key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""


class PagedAttention(nn.Module):
    """Write this step's K/V into the cache, then causal attention of the new queries over
    every cached token of their request (the K/V just written included)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                attn_inputs: AttentionInputs) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads * d]."""
        key_cache, value_cache = kv_cache
        meta = attn_inputs.meta
        self.backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = self.backend.attend(q, key_cache, value_cache, meta, attn_inputs.plan,
                                  self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
