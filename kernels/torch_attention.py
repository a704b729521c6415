"""Vectorised torch paged attention and KV-cache write: the fast CPU path.

Same signatures, layouts and results as `kernels/reference.py` (the specification), but
without a Python loop over decode requests:

  * decode requests (one new token each) are attended in one batched matmul. Each request's
    cached K/V are gathered into a padded, head-major copy

        keys[num_decode, num_kv_heads, max_ctx, head_dim]

    by flat row index into `cache.view(num_slots * num_kv_heads, head_dim)`. Positions past a
    request's `seq_len` gather the request's position 0 instead (always written, so finite;
    the cache may hold anything, NaN included, in slots nobody wrote) and their scores are
    masked to -inf, so they weigh exactly 0. Requests go in chunks of about
    `DECODE_CHUNK_BYTES` of gathered K/V, so each copy is read back from the L2 cache.
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

from dataclasses import dataclass

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
    scratch: dict | None = None,  # per-step scratch shared by the layers (see below)
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged K/V (GQA aware);
    equals `paged_attention_ref`. With a `scratch` dict (one per step, shared by every
    layer), the batch's index tensors are built by the first layer and reused by the rest."""
    if out is None:
        out = torch.empty_like(query)
    plan_key = ("torch_attention_plan", key_cache.shape[1], key_cache.shape[2])
    plan = scratch.get(plan_key) if scratch is not None else None
    if plan is None:
        plan = _batch_plan(block_tables, query_start_loc, seq_lens, key_cache.shape[1],
                           key_cache.shape[2])
        if scratch is not None:
            scratch[plan_key] = plan
    if plan.decode is not None:
        _decode(query, key_cache, value_cache, plan.decode, scale, out)
    for i, q_start, q_end, seq_len in plan.prefills:
        _prefill(query, key_cache, value_cache, block_tables[i], q_start, q_end, seq_len,
                 scale, out)
    return out


@dataclass
class _DecodeIndex:
    """Where the decode requests' queries, K/V rows and padding are, for one batch."""

    token_rows: slice | torch.Tensor  # query rows of the decode requests, in order
    cache_rows: torch.Tensor  # [N * kv_heads * L] rows of cache.view(-1, head_dim)
    padding: torch.Tensor  # [N, 1, 1, L] True past a request's seq_len
    num_seqs: int
    max_len: int


@dataclass
class _BatchPlan:
    decode: _DecodeIndex | None
    prefills: list[tuple[int, int, int, int]]  # (request, q_start, q_end, seq_len)


def _batch_plan(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, block_size: int, num_kv_heads: int) -> _BatchPlan:
    """The batch's index tensors: which rows are decodes (one batched gather) and which are
    prefill chunks (one SDPA call each)."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    prefills = [(i, qsl[i], qsl[i + 1], lens[i]) for i in range(len(lens))
                if qsl[i + 1] - qsl[i] > 1]
    index = (_decode_index(block_tables, qsl, lens, decode, block_size, num_kv_heads)
             if decode else None)
    return _BatchPlan(index, prefills)


def _as_slice_or_tensor(values: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice when `values` are consecutive (a view instead of a gather), else a tensor."""
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return torch.tensor(values, device=device)


def _decode_index(block_tables, qsl, lens, decode, block_size, num_kv_heads) -> _DecodeIndex:
    device = block_tables.device
    num = len(decode)
    requests = _as_slice_or_tensor(decode, device)
    max_len = max(lens[i] for i in decode)
    num_blocks = (max_len + block_size - 1) // block_size
    tables = (block_tables[requests] if isinstance(requests, slice)
              else block_tables.index_select(0, requests))[:, :num_blocks].long()
    seq_lens = torch.tensor([lens[i] for i in decode], device=device).unsqueeze(1)
    pos = torch.arange(max_len, device=device).unsqueeze(0)  # [1, L]
    valid = pos < seq_lens  # [N, L]
    read = torch.where(valid, pos, 0)  # padding reads position 0: written, finite
    slots = tables.gather(1, read // block_size) * block_size + read % block_size
    heads = torch.arange(num_kv_heads, device=device)
    # row of (slot s, kv head h) in cache.view(-1, head_dim) is s * num_kv_heads + h
    cache_rows = (slots.unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1)).reshape(-1)
    return _DecodeIndex(token_rows=_as_slice_or_tensor([qsl[i] for i in decode], device),
                        cache_rows=cache_rows, padding=~valid.view(num, 1, 1, max_len),
                        num_seqs=num, max_len=max_len)


def _acc_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


DECODE_CHUNK_BYTES = 1 << 21
"""Gathered K+V bytes per decode chunk: requests are attended a few at a time so that their
gathered copy is still in the L2 cache when the matmuls read it (one pass over all of them
at once, hundreds of MB at a few hundred requests, measured 2-3x slower on this CPU)."""


def _decode(query, key_cache, value_cache, index: _DecodeIndex, scale, out):
    """One new token per request for the decode requests: batched matmuls over chunks of
    requests (`DECODE_CHUNK_BYTES` of gathered K/V each)."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    acc = _acc_dtype(query)
    elem = torch.empty(0, dtype=acc).element_size()
    per_request = 2 * num_kv_heads * index.max_len * head_dim * elem
    chunk = max(1, DECODE_CHUNK_BYTES // per_request)
    rows = index.token_rows
    cache_rows = index.cache_rows.view(index.num_seqs, -1)
    for first in range(0, index.num_seqs, chunk):
        last = min(first + chunk, index.num_seqs)
        if isinstance(rows, slice):
            token_rows = slice(rows.start + first, rows.start + last)
            q = query[token_rows]
        else:
            token_rows = rows[first:last]
            q = query.index_select(0, token_rows)
        result = _decode_chunk(q, key_cache, value_cache, cache_rows[first:last].reshape(-1),
                               index.padding[first:last], scale, acc)
        if isinstance(token_rows, slice):
            out[token_rows] = result.to(out.dtype)
        else:
            out.index_copy_(0, token_rows, result.to(out.dtype))


def _decode_chunk(q, key_cache, value_cache, cache_rows, padding, scale, acc):
    """q [n, heads, d] of n decode requests -> [n, heads, d] in `acc` dtype."""
    num, num_heads, head_dim = q.shape
    num_kv_heads, max_len = key_cache.shape[2], padding.shape[-1]
    shape = (num, num_kv_heads, max_len, head_dim)
    keys = key_cache.view(-1, head_dim).index_select(0, cache_rows).view(shape).to(acc)
    values = value_cache.view(-1, head_dim).index_select(0, cache_rows).view(shape).to(acc)
    q = q.to(acc).view(num, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [n, kv_heads, group, L]
    scores.masked_fill_(padding, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).view(num, num_heads, head_dim)


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
    # 4-D [1, heads, tokens, d]: on the CPU only batched inputs take the fused (flash)
    # kernel, ~5x faster at 512 tokens than the unfused fallback that 3-D inputs get
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)
    out[q_start:q_end] = o[0].transpose(0, 1).to(out.dtype)
