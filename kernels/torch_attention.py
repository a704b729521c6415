"""Vectorised torch paged attention and KV-cache write: the fast CPU path.

Same signatures, layouts and results as `kernels/reference.py` (the specification), but
without a Python loop over decode requests:

  * decode requests (one new token each) go to the numba kernel
    (`kernels/numba_attention.py`, which reads each request's K/V once straight from the
    cache) whenever it can take them: numba installed, float32 or float64, `USE_NUMBA`.
    Otherwise (bf16, fp16) they are sorted by context length and attended in
    chunks of about `DECODE_CHUNK_BYTES` of K/V, so each chunk's copy is read back from the
    L2 cache. A chunk's K/V are gathered whole block by whole block (one contiguous copy per
    block) into a padded copy `[n, padded_len, num_kv_heads, head_dim]`; sorting keeps the
    padding to about a block per request. Padded rows (past a request's `seq_len`; the
    cache may hold anything there, NaN included) are zeroed and masked out of the softmax.
    Each chunk is one `scaled_dot_product_attention` call (its fused CPU kernel, grouped
    query heads included).
  * a prefill chunk (more than one new token) runs through `scaled_dot_product_attention`
    over its own gathered K/V with a bottom-right-aligned causal mask (token j of a chunk of
    q_len sits at position seq_len - q_len + j and sees positions 0..that one). Chunks go one
    request at a time: a step holds few of them and each is large.

Softmax runs in float32 (float64 for float64 queries) as in the reference; the output has
the query's dtype. Rows of `out` that no request owns are left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tidal.kernels.numba_attention import numba_decode_available, paged_decode_numba


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
                           key_cache.shape[2], key_cache.shape[3], _acc_dtype(query),
                           USE_NUMBA and numba_decode_available(query, key_cache))
        if scratch is not None:
            scratch[plan_key] = plan
    if isinstance(plan.decode, _NumbaDecode):
        d = plan.decode
        paged_decode_numba(query, key_cache, value_cache, d.block_tables, d.seq_lens,
                           d.requests, d.token_rows, scale, out)
    elif plan.decode:
        _decode(query, key_cache, value_cache, plan, scale, out)
    for i, q_start, q_end, seq_len in plan.prefills:
        _prefill(query, key_cache, value_cache, block_tables[i], q_start, q_end, seq_len,
                 scale, out)
    return out


@dataclass
class _DecodeChunk:
    """Decode requests of similar length attended together, and where their data is.

    Their K/V are gathered block by block into a padded copy
    `[num_seqs, padded_len, num_kv_heads, head_dim]` (`padded_len` = the chunk's longest
    context rounded up to whole blocks). Rows past a request's `seq_len` (the tail of its last
    block, and whole blocks of table padding) may hold anything, NaN included: `pad_rows`
    names them so they are zeroed after the gather, and `mask` keeps them out of the softmax.
    """

    token_rows: torch.Tensor  # [num_seqs] int64: the requests' query rows
    blocks: torch.Tensor  # [num_seqs * padded_len / block_size] int64 block ids, row-major
    pad_rows: torch.Tensor  # int64 rows of the gathered copy (viewed [n * padded_len, -1])
    mask: torch.Tensor  # [num_seqs, 1, 1, padded_len] additive: 0 attended, -inf padding
    num_seqs: int
    padded_len: int


@dataclass
class _NumbaDecode:
    """The decode requests for the compiled kernel (`kernels/numba_attention.py`)."""

    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    requests: np.ndarray  # [num_decode] int64: rows of the two above
    token_rows: np.ndarray  # [num_decode] int64: their query rows


@dataclass
class _BatchPlan:
    decode: list[_DecodeChunk] | _NumbaDecode
    prefills: list[tuple[int, int, int, int]]  # (request, q_start, q_end, seq_len)
    # K and V gather buffers [blocks of the largest chunk, block elements], allocated by the
    # first layer and reused by every chunk of every layer (fresh large allocations page-fault)
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None


def _batch_plan(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int,
                acc: torch.dtype, use_numba: bool = False) -> _BatchPlan:
    """The batch's index tensors: the decode requests (for the compiled kernel, or sorted by
    length and cut into chunks of about `DECODE_CHUNK_BYTES` gathered K/V for the torch
    path), and the prefill chunks (one SDPA call each)."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    prefills = [(i, qsl[i], qsl[i + 1], lens[i]) for i in range(len(lens))
                if qsl[i + 1] - qsl[i] > 1]
    if use_numba:
        return _BatchPlan(_NumbaDecode(
            np.ascontiguousarray(block_tables.numpy()), np.ascontiguousarray(seq_lens.numpy()),
            np.array(decode, dtype=np.int64),
            np.array([qsl[i] for i in decode], dtype=np.int64)) if decode else [], prefills)
    decode.sort(key=lens.__getitem__)  # similar lengths share a chunk: little padding
    bytes_per_slot = 2 * num_kv_heads * head_dim * acc.itemsize  # K and V of one position
    chunks, first = [], 0
    while first < len(decode):
        last = first + 1  # sorted ascending: the chunk's last request is its longest
        while (last < len(decode) and (last + 1 - first) * bytes_per_slot
               * _round_up(lens[decode[last]], block_size) <= DECODE_CHUNK_BYTES):
            last += 1
        members = decode[first:last]
        chunks.append(_decode_chunk_index(block_tables, [qsl[i] for i in members],
                                          [lens[i] for i in members], members, block_size,
                                          acc))
        first = last
    return _BatchPlan(chunks, prefills)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _decode_chunk_index(block_tables, token_rows, lens, members, block_size,
                        acc) -> _DecodeChunk:
    device = block_tables.device
    num, padded_len = len(members), _round_up(max(lens), block_size)
    requests = torch.tensor(members, device=device)
    blocks = block_tables.index_select(0, requests)[:, :padded_len // block_size]
    valid = (torch.arange(padded_len, device=device).unsqueeze(0)
             < torch.tensor(lens, device=device).unsqueeze(1))  # [n, padded_len]
    return _DecodeChunk(
        token_rows=torch.tensor(token_rows, device=device),
        blocks=blocks.reshape(-1).long(),
        pad_rows=(~valid).view(-1).nonzero().squeeze(1),
        mask=torch.zeros(num, 1, 1, padded_len, dtype=acc, device=device).masked_fill_(
            ~valid.view(num, 1, 1, padded_len), float("-inf")),
        num_seqs=num, padded_len=padded_len)


def _acc_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


USE_NUMBA = True
"""Decode through the compiled kernel when it can take the tensors (numba installed, CPU,
float32/float64); False forces the torch path below (tests run both)."""

DECODE_CHUNK_BYTES = 1 << 21
"""Gathered K+V bytes per decode chunk: requests are attended a few at a time so that their
gathered copy is still in the L2 cache when attention reads it (one pass over all of them at
once, hundreds of MB at a few hundred requests, measured 2-3x slower on this CPU)."""


def _decode(query, key_cache, value_cache, plan: _BatchPlan, scale, out):
    """One new token per request for the decode requests, a chunk at a time."""
    if plan.workspace is None:
        rows = max(chunk.blocks.numel() for chunk in plan.decode)
        plan.workspace = tuple(torch.empty(rows, key_cache[0].numel(), dtype=key_cache.dtype,
                                           device=key_cache.device) for _ in range(2))
    for chunk in plan.decode:
        result = _decode_chunk(query.index_select(0, chunk.token_rows), key_cache,
                               value_cache, chunk, scale, _acc_dtype(query), plan.workspace)
        out.index_copy_(0, chunk.token_rows, result.to(out.dtype))


def _decode_chunk(q, key_cache, value_cache, chunk: _DecodeChunk, scale, acc, workspace):
    """q [n, heads, d] of one chunk's requests -> [n, heads, d] in `acc` dtype."""
    num, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    shape = (num, chunk.padded_len, num_kv_heads, head_dim)
    gathered = []
    for cache, buffer in zip((key_cache, value_cache), workspace):
        # whole blocks: one contiguous copy of block_size * kv_heads * head_dim per block
        kv = buffer[:chunk.blocks.numel()]
        torch.index_select(cache.view(cache.shape[0], -1), 0, chunk.blocks, out=kv)
        kv = kv.view(shape)
        if chunk.pad_rows.numel():
            kv.view(num * chunk.padded_len, -1).index_fill_(0, chunk.pad_rows, 0)
        gathered.append(kv.to(acc).transpose(1, 2))  # [n, kv_heads, padded_len, d] view
    o = F.scaled_dot_product_attention(
        q.to(acc).view(num, num_heads, 1, head_dim), gathered[0], gathered[1],
        attn_mask=chunk.mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
    return o.view(num, num_heads, head_dim)


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
