"""Plain-torch paged attention and KV-cache write: the kernels' specification, and
`ReferenceBackend` (`attention_backend=reference`) that runs it.

KV cache layout, per layer (one tensor for K, one for V):

    cache[num_blocks, block_size, num_kv_heads, head_dim]
    slot s  =  block_id * block_size + offset        (cache.view(-1, H_kv, D)[s])

Block 0 is the null block: never written by a real request, safe as padding in block tables.

Batch layout of one attention call (`num_seqs` requests, their new query tokens packed):

    query[num_tokens, num_heads, head_dim]
    query_start_loc[num_seqs + 1]   request i owns query rows [qsl[i], qsl[i+1])
    seq_lens[num_seqs]              tokens in the cache for request i *including* its new ones
    block_tables[num_seqs, max_blocks_per_seq]   block ids, padded with 0

The j-th new token of request i sits at position p = seq_lens[i] - q_len_i + j and attends
causally to cached positions 0..p (its own K/V are written before attention runs); with a
sliding window W to positions p - W < j <= p only (transformers' `sliding_window_overlay`:
kv_idx > q_idx - W), and cache blocks wholly before the request's first visible position
are never read: their table entries may name blocks the engine core has given to another
request, or the null block. With a soft cap c each score s = scale * q.k becomes
c * tanh(s / c) before the mask and the softmax (Gemma 2).
Softmax is computed in float32; the output has the query's dtype (float64 stays float64).

A quantized cache (`kv_cache_dtype` int8/fp8) adds kv_scales = (key_scale, value_scale),
[num_blocks, block_size, num_kv_heads] float32 at the same slots; a row reads back as
q * scale (`kv_quant.py`).
"""

from __future__ import annotations

import torch

from . import FunctionBackend
from .kv_quant import KVScales, gather_kv, write_kv_quantized


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # same shape as key_cache
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot < 0 means "do not write"
    kv_scales: KVScales | None = None,  # a quantized cache's scales
) -> None:
    """Scatter each token's K and V into its cache slot (in place), quantized with their
    scales when `kv_scales` is given."""
    if kv_scales is not None:
        write_kv_quantized(key, value, key_cache, value_cache, kv_scales, slot_mapping)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(value_cache.dtype)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_scales: KVScales | None = None,  # a quantized cache's scales
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged K/V (GQA aware), within
    `sliding_window` and soft-capped by `soft_cap` when given (see the module docstring)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = qsl[i], qsl[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # blocks [first, num_blocks): the first holds the first position any query sees
        first = first_visible(seq_len - q_len, sliding_window) // block_size
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, first:num_blocks].long()
        base = first * block_size
        k, v = gather_kv(key_cache, value_cache, kv_scales, blocks, acc_dtype)
        k = k.reshape(-1, num_kv_heads, head_dim)[:seq_len - base]
        v = v.reshape(-1, num_kv_heads, head_dim)[:seq_len - base]
        # [kv_heads, seq, d] -> repeat each KV head for its `group` query heads
        k = k.transpose(0, 1).repeat_interleave(group, dim=0).to(acc_dtype)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0).to(acc_dtype)
        q = query[q_start:q_end].transpose(0, 1).to(acc_dtype)  # [heads, q_len, d]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [heads, q_len, seq - base]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(base, seq_len).unsqueeze(0)
        scores = scores.masked_fill(~visible(q_pos, k_pos, sliding_window), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out


def first_visible(q_pos: int, sliding_window: int | None) -> int:
    """The first cached position the query at `q_pos` sees (0 without a window)."""
    return 0 if sliding_window is None else max(0, q_pos - sliding_window + 1)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Whether the key at `k_pos` is visible to the query at `q_pos` (broadcast): causal, and
    k_pos > q_pos - sliding_window with a window, as transformers' masks."""
    seen = k_pos <= q_pos
    if sliding_window is not None:
        seen = seen & (k_pos > q_pos - sliding_window)
    return seen


# ---------------------------------------------------------------------------------------------
# Split-K (flash-decoding) reference: the same attention computed in independent slices of the
# cache, then merged. The Triton split-K path stores exactly these partials, so the reduce
# kernel can be checked on its own against `merge_splits_ref`.
#
#   request i, seq_len = L, tile = T, num_splits = S
#   tiles_per_split = cdiv(cdiv(L, T), S)            split_len = tiles_per_split * T
#   split s covers cached positions [s * split_len, (s + 1) * split_len) ∩ [0, L)
#
# Scores are kept in base 2 (score * scale * log2(e)), as the kernels do. For each
# (token, head, split):
#   max_log2 = max over the split's visible positions (-inf when the split sees none)
#   sums     = Σ exp2(score - max_log2)
#   acc      = Σ exp2(score - max_log2) · v                 (not normalised)
# and the merge is  out = Σ_s 2^(max_s - M) acc_s / Σ_s 2^(max_s - M) sums_s,  M = max_s max_s.
# ---------------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634


def split_len_for(seq_len: int, num_splits: int, tile_size: int) -> int:
    """Cached positions per split of one request (a whole number of `tile_size` tiles)."""
    num_tiles = (seq_len + tile_size - 1) // tile_size
    tiles_per_split = (num_tiles + num_splits - 1) // num_splits
    return tiles_per_split * tile_size


def splitk_partials_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    num_splits: int,
    tile_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split softmax state `(acc [T,H,S,D], max_log2 [T,H,S], sums [T,H,S])`.

    Accumulated in float32 (float64 for float64 queries). Rows of tokens that no request owns
    hold acc 0, max -inf, sums 0.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    acc = torch.zeros(num_tokens, num_heads, num_splits, head_dim, dtype=acc_dtype)
    max_log2 = torch.full((num_tokens, num_heads, num_splits), float("-inf"), dtype=acc_dtype)
    sums = torch.zeros(num_tokens, num_heads, num_splits, dtype=acc_dtype)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = qsl[i], qsl[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0).to(acc_dtype)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0).to(acc_dtype)
        q = query[q_start:q_end].transpose(0, 1).to(acc_dtype)  # [heads, q_len, d]
        scores = torch.matmul(q, k.transpose(1, 2)) * (scale * LOG2E)  # [heads, q_len, seq]
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        split_len = split_len_for(seq_len, num_splits, tile_size)
        for s in range(num_splits):
            lo, hi = s * split_len, min((s + 1) * split_len, seq_len)
            if lo >= hi:
                continue
            part = scores[:, :, lo:hi]
            m = part.amax(dim=-1)  # [heads, q_len]
            m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = torch.exp2(part - m_safe.unsqueeze(-1))
            max_log2[q_start:q_end, :, s] = m.transpose(0, 1)
            sums[q_start:q_end, :, s] = p.sum(dim=-1).transpose(0, 1)
            acc[q_start:q_end, :, s] = torch.matmul(p, v[:, lo:hi]).transpose(0, 1)
    return acc, max_log2, sums


def merge_splits_ref(
    acc: torch.Tensor,  # [num_tokens, num_heads, num_splits, head_dim]
    max_log2: torch.Tensor,  # [num_tokens, num_heads, num_splits]
    sums: torch.Tensor,  # [num_tokens, num_heads, num_splits]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Merge split partials into `out` for the tokens requests own (other rows untouched)."""
    qsl = query_start_loc.tolist()
    first, last = qsl[0], qsl[-1]
    m = max_log2[first:last]
    top = m.amax(dim=-1, keepdim=True)  # finite: split 0 always sees position 0
    weight = torch.exp2(m - top)  # [tokens, heads, splits]; 0 for empty splits
    num = (acc[first:last] * weight.unsqueeze(-1)).sum(dim=2)
    den = (sums[first:last] * weight).sum(dim=2)
    out[first:last] = (num / den.unsqueeze(-1)).to(out.dtype)
    return out


def paged_attention_splitk_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    tile_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_ref` computed split-K: per-split partials, then the merge."""
    if out is None:
        out = torch.empty_like(query)
    partials = splitk_partials_ref(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        num_splits, tile_size,
    )
    return merge_splits_ref(*partials, query_start_loc, out)


class ReferenceBackend(FunctionBackend):
    """`attention_backend=reference`: the functions above, one request at a time (slow; the
    specification the other backends are tested against). Needs no per-step plan."""

    name = "reference"
    kv_writer = staticmethod(write_kv_ref)
    attention = staticmethod(paged_attention_ref)
