"""Plain-torch paged attention and KV-cache write: the CPU path and the kernels' specification.

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
causally to cached positions 0..p (its own K/V are written before attention runs).
Softmax is computed in float32; the output has the query's dtype (float64 stays float64).
"""

from __future__ import annotations

import torch


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # same shape as key_cache
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot < 0 means "do not write"
) -> None:
    """Scatter each token's K and V into its cache slot (in place)."""
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
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged K/V (GQA aware)."""
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
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        # [kv_heads, seq, d] -> repeat each KV head for its `group` query heads
        k = k.transpose(0, 1).repeat_interleave(group, dim=0).to(acc_dtype)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0).to(acc_dtype)
        q = query[q_start:q_end].transpose(0, 1).to(acc_dtype)  # [heads, q_len, d]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [heads, q_len, seq]
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out
