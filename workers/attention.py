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

from ..kernels.attention import AttentionBackend, check_window_and_cap
from ..kernels.attention.metadata import AttentionMetadata

__all__ = ["AttentionInputs", "AttentionMetadata", "KVCache", "PagedAttention",
           "uniform_sliding_window"]


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


KVCache = tuple[torch.Tensor, ...]
"""(key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]; a
quantized cache (`kv_cache_dtype` int8/fp8) adds (key_scale, value_scale), each
[num_blocks, block_size, num_kv_heads] float32 (`kernels/attention/kv_quant.py`)."""


class PagedAttention(nn.Module):
    """Write this step's K/V into the cache, then causal attention of the new queries over
    every cached token of their request (the K/V just written included).

    Per layer, as the model's config says:
      sliding_window  W: a query at position p sees keys at positions j with
                      p - W < j <= p (transformers' `sliding_window_overlay`), and the
                      backends skip the cache blocks wholly before that; None: every
                      position up to p.
      logits_soft_cap c: scores become c * tanh(score / c) before the mask and the softmax
                      (Gemma 2's `attn_logit_softcapping`); None: no cap.
    ValueError naming the field for a window below 1 or a cap that is not positive."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None):
        super().__init__()
        check_window_and_cap(sliding_window, logits_soft_cap)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                attn_inputs: AttentionInputs) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads * d]."""
        key_cache, value_cache, *scales = kv_cache
        kv_scales = tuple(scales) if scales else None
        meta = attn_inputs.meta
        self.backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping, kv_scales)
        out = self.backend.attend(q, key_cache, value_cache, meta, attn_inputs.plan,
                                  self.scale, sliding_window=self.sliding_window,
                                  soft_cap=self.logits_soft_cap, kv_scales=kv_scales)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


def uniform_sliding_window(model: nn.Module) -> int | None:
    """The window every attention layer of `model` shares, or None when any layer attends
    globally (or the model has no `PagedAttention`). Only then can the engine core free a
    request's out-of-window blocks: with one block table per request, a single global layer
    (Gemma 2/3 interleave them) still reads every block."""
    windows = {m.sliding_window for m in model.modules() if isinstance(m, PagedAttention)}
    if len(windows) != 1:
        return None
    return windows.pop()


def kv_block_bytes(backend: AttentionBackend, num_layers: int, block_size: int,
                   num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one KV block of a model takes on this rank: K and V over its `num_layers`
    layers (a quantized cache's scales included: `AttentionBackend.kv_bytes_per_token_head`).
    The target's (`ModelRunner.kv_block_bytes`) and a draft model's (`Drafter`) alike."""
    row = backend.kv_bytes_per_token_head(head_dim, dtype)
    return 2 * num_layers * block_size * num_kv_heads * row
