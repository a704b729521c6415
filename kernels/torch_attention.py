"""Vectorised torch paged attention and KV-cache write: the fast CPU path.

Same signatures, layouts and results as `kernels/reference.py` (the specification), but
without a Python loop over decode requests:

  * decode requests (one new token each) are attended in one batched matmul. Each request's
    cached K/V are gathered into a padded, head-major copy

        keys[num_decode, num_kv_heads, max_ctx, head_dim]

    by flat row index into `cache.view(num_slots * num_kv_heads, head_dim)`. Positions past a
    request's `seq_len` gather the request's position 0 instead (always written, so finite;
    the cache may hold anything, NaN included, in slots nobody wrote) and their scores are
    masked to -inf, so they weigh exactly 0.
  * query heads are grouped per KV head ([kv_heads, group, ...]) so grouped-query attention
    needs no `repeat_interleave` of K/V.
  * a prefill chunk (more than one new token) runs through `scaled_dot_product_attention`
    over its own gathered K/V with a bottom-right-aligned causal mask (token j of a chunk of
    q_len sits at position seq_len - q_len + j and sees positions 0..that one). Chunks go one
    request at a time: a step holds few of them and each is large.

Softmax runs in float32 (float64 for float64 queries) as in the reference; the output has
the query's dtype. Rows of `out` that no request owns are left untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # same shape as key_cache
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot < 0 means "do not write"
) -> None:
    """Scatter each token's K and V into its cache slot (in place), as `write_kv_ref`."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    slots = slot_mapping.long()
    if key.shape[0] and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slots, value.to(value_cache.dtype))


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged K/V (GQA aware);
    equals `paged_attention_ref`."""
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    if decode:
        _decode(query, key_cache, value_cache, block_tables, qsl, lens, decode, scale, out)
    for i, seq_len in enumerate(lens):
        if qsl[i + 1] - qsl[i] > 1:
            _prefill(query, key_cache, value_cache, block_tables[i], qsl[i], qsl[i + 1],
                     seq_len, scale, out)
    return out


def _acc_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, L] cache slots -> [N, kv_heads, L, head_dim] copies of those K (or V) rows."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    heads = torch.arange(num_kv_heads, device=slots.device)
    # row of (slot s, kv head h) in cache.view(-1, head_dim) is s * num_kv_heads + h
    rows = slots.unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1)  # [N, kv_heads, L]
    gathered = cache.view(-1, head_dim).index_select(0, rows.reshape(-1))
    return gathered.view(*rows.shape, head_dim).to(dtype)


def _decode(query, key_cache, value_cache, block_tables, qsl, lens, decode, scale, out):
    """One new token per request for the requests in `decode`, in one batched matmul."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    acc = _acc_dtype(query)
    device = query.device
    num = len(decode)
    contiguous = decode == list(range(decode[0], decode[0] + num))
    rows = None if contiguous else torch.tensor(decode, device=device)
    max_len = max(lens[i] for i in decode)
    num_blocks = (max_len + block_size - 1) // block_size
    tables = (block_tables[decode[0]:decode[0] + num] if contiguous
              else block_tables.index_select(0, rows))[:, :num_blocks].long()
    seq_lens = torch.tensor([lens[i] for i in decode], device=device).unsqueeze(1)
    pos = torch.arange(max_len, device=device).unsqueeze(0)  # [1, L]
    valid = pos < seq_lens  # [N, L]
    read = torch.where(valid, pos, 0)  # padding reads position 0: written, finite
    slots = tables.gather(1, read // block_size) * block_size + read % block_size
    keys = _gather_rows(key_cache, slots, acc)  # [N, kv_heads, L, d]
    values = _gather_rows(value_cache, slots, acc)
    token_rows = [qsl[i] for i in decode]
    first = token_rows[0]
    q = (query[first:first + num] if token_rows == list(range(first, first + num))
         else query.index_select(0, torch.tensor(token_rows, device=device)))
    q = q.to(acc).view(num, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [N, kv_heads, group, L]
    scores.masked_fill_(~valid.view(num, 1, 1, max_len), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = torch.matmul(probs, values).view(num, num_heads, head_dim).to(out.dtype)
    if token_rows == list(range(first, first + num)):
        out[first:first + num] = result
    else:
        out.index_copy_(0, torch.tensor(token_rows, device=device), result)


def _prefill(query, key_cache, value_cache, table, q_start, q_end, seq_len, scale, out):
    """A chunk of q_len > 1 new tokens of one request: SDPA with a bottom-right causal mask."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    acc = _acc_dtype(query)
    q_len = q_end - q_start
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = table[:num_blocks].long()
    # [blocks, block_size, kv_heads, d] -> [kv_heads, seq_len, d]
    k = key_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1).to(acc)
    v = value_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1).to(acc)
    q = query[q_start:q_end].transpose(0, 1).to(acc)  # [heads, q_len, d]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
    mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= q_pos  # True: attend
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)
    out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
