"""Triton paged attention and KV-cache write: the GPU path, equal to `kernels/attention/reference.py`.

Public entry points (same signatures and semantics as the references):

    write_kv_triton(key, value, key_cache, value_cache, slot_mapping) -> None
    paged_attention_triton(query, key_cache, value_cache, block_tables, query_start_loc,
                           seq_lens, scale, out=None) -> Tensor

wrapped as `TritonBackend` (the `AttentionBackend` the engine uses, `attention_backend=triton`),
and, for tests and benchmarks that want a particular launch, `choose_launch` / `AttentionLaunch`
and `run_paged_attention(..., launch)`.

One attention kernel family serves every step (decode, prefill chunk, mixed batch):

    grid = (num_q_blocks, num_kv_heads, num_splits)

    program (b, kvh, s) owns a tile of BLOCK_M rows = BLOCK_Q query tokens × GROUP_PAD heads:

        row r  ->  token  q_block_start + r // GROUP_PAD      (of one request)
                   head   kvh * GROUP + r % GROUP_PAD          (rows with r % GROUP_PAD >= GROUP
                                                                are padding, GROUP = H / H_kv)

    so every query head that shares KV head `kvh` reads each K/V tile once (GQA folded into M).
    The program walks the request's block table TILE_N cached positions at a time (a tile may
    span several cache blocks: each position looks up its own block id), with an online softmax
    in float32 (float64 for float64 inputs), scores in base 2.

Query blocks are numbered without a host sync: request i's blocks start at
`query_start_loc[i] // BLOCK_Q + i`, so `num_tokens // BLOCK_Q + num_seqs` programs cover any
batch, and a program finds its request by binary search over `query_start_loc`. Programs past
the end of their request return at once.

Split-K (flash-decoding): with num_splits S > 1 the cached positions of each request are cut
into S slices of whole tiles (see `split_len_for` in the reference); each program writes its
slice's un-normalised partials (acc, max, sum) and a reduce kernel merges them. The heuristic
in `choose_launch` takes it for decode-only batches too small to fill the GPU.

Dtypes: query and caches float16, bfloat16, float32 or float64 (all the same dtype; anything
else is a ValueError). float32 uses IEEE (not TF32) products. float64 accumulates in float64
and multiplies with an FMA reduction instead of `tl.dot`, which has no float64 path in Triton
(triton-lang/triton#5483): correct everywhere, slow, meant for tests. Under the interpreter
bfloat16 operands are widened to float32 before `tl.dot` (the interpreter multiplies raw
bfloat16 bits, triton-lang/triton#11584); on a GPU they go to the tensor cores as is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from . import FunctionBackend

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_SPLITS = 32
"""Upper bound on split-K slices per request."""
MIN_TOKENS_PER_SPLIT = 512
"""A split-K slice is worth its partial write and merge only above this many cached tokens."""
_LOG2E = 1.4426950408889634
_TORCH_TO_TL = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# =============================================================================================
# KV-cache write
# =============================================================================================


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_k_dim,
    stride_v_tok, stride_v_head, stride_v_dim,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (token, head block): copy BLOCK_H heads of one token's K and V to its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]
    k = tl.load(key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head
                + dims[None, :] * stride_k_dim, mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head
                + dims[None, :] * stride_v_dim, mask=mask)
    kc = (key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
          + heads[:, None] * stride_kc_head + dims[None, :] * stride_kc_dim)
    vc = (value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
          + heads[:, None] * stride_vc_head + dims[None, :] * stride_vc_dim)
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # same shape as key_cache
    slot_mapping: torch.Tensor,  # [num_tokens] int; slot < 0 means "do not write"
) -> None:
    """Scatter each token's K and V into its cache slot (in place); see `write_kv_ref`."""
    _check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        num_kv_heads, head_dim, key_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def _check_write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    if tuple(key_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"key_cache heads/head_dim {tuple(key_cache.shape[2:])} differ from "
                         f"key's {tuple(key.shape[1:])}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.is_floating_point():
        raise ValueError(f"slot_mapping must be an integer tensor of shape ({key.shape[0]},), "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


# =============================================================================================
# Paged attention
# =============================================================================================


@dataclass(frozen=True)
class AttentionLaunch:
    """Tile shape and grid depth of one paged-attention launch (see `choose_launch`)."""

    block_m: int
    """Rows of a query tile: (block_m // group_pad) query tokens × group_pad query heads."""
    tile_n: int
    """Cached positions per step of the inner loop (may span several cache blocks)."""
    num_splits: int = 1
    """Slices of each request's cache; > 1 takes the split-K path (partials + reduce)."""
    num_warps: int = 4
    """Warps per program (GPU only)."""
    num_stages: int = 2
    """Software-pipelining depth of the K/V loads (GPU only)."""


def choose_launch(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_kv_len: int,
    num_sms: int,
    dtype: torch.dtype = torch.float16,
) -> AttentionLaunch:
    """Pick the tile shape and split-K depth from host-known sizes only (no device sync).

    `max_kv_len` is an upper bound on any request's cached length (block table width × block
    size). Decode-only batches (num_tokens <= num_seqs) get a 16-row tile and may split-K;
    batches with prefill rows get 128-row tiles (64 for head_dim 256) so each K/V tile feeds
    many queries. NOTE: a decode batch padded to more tokens than requests (CUDA graphs) is
    taken for a prefill: still correct, with a wider tile than it needs.
    """
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    decode_only = num_tokens <= num_seqs
    if dtype == torch.float64:  # FMA matmul: keep the [M, D, N] product small
        return AttentionLaunch(block_m=max(16, group_pad), tile_n=16, num_warps=4, num_stages=1)
    tile_n = 64 if head_pad <= 128 else 32
    if not decode_only:
        block_m = max(128 if head_pad <= 128 else 64, group_pad)
        return AttentionLaunch(block_m=block_m, tile_n=tile_n, num_warps=8, num_stages=2)
    num_splits = choose_num_splits(num_seqs, num_kv_heads, max_kv_len, num_sms)
    return AttentionLaunch(
        block_m=max(16, group_pad), tile_n=tile_n, num_splits=num_splits, num_warps=4,
        num_stages=3 if head_pad <= 128 else 2,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Split-K depth for a decode batch: enough programs for ~2 per SM, none below
    MIN_TOKENS_PER_SPLIT cached tokens per slice, at most MAX_SPLITS; 1 when the batch alone
    fills the GPU."""
    num_programs = num_seqs * num_kv_heads
    if num_programs == 0 or num_programs >= num_sms:
        return 1
    wanted = triton.cdiv(2 * num_sms, num_programs)
    by_len = max_kv_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(wanted, by_len, MAX_SPLITS))


@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; the interpreter pretends to be a 16-SM GPU."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 16


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with query_start_loc[i] // BLOCK_Q + i <= q_block (binary search); -1 if none."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mm(a, b, ACC_DTYPE: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a [M, K] @ b [K, N] accumulated in ACC_DTYPE; FMA reduction when USE_DOT is False."""
    if USE_DOT:
        return tl.dot(a, b, out_dtype=ACC_DTYPE, input_precision=PRECISION)
    else:
        return tl.sum(a.to(ACC_DTYPE)[:, :, None] * b.to(ACC_DTYPE)[None, :, :], axis=1)


@triton.jit
def _load_kv_tile(
    cache_ptr, block_table_row_ptr, pos, pos_valid, kv_head, dims, dim_valid,
    stride_block, stride_slot, stride_head, stride_dim, BLOCK_SIZE: tl.constexpr,
):
    """Gather cached positions `pos` [TILE_N] of one KV head through the block table:
    returns [TILE_N, HEAD_PAD] (zeros where masked)."""
    block_ids = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=pos_valid, other=0)
    row_off = (block_ids.to(tl.int64) * stride_block + (pos % BLOCK_SIZE) * stride_slot
               + kv_head * stride_head)
    ptrs = cache_ptr + row_off[:, None] + dims[None, :] * stride_dim
    return tl.load(ptrs, mask=pos_valid[:, None] & dim_valid[None, :], other=0.0)


@triton.jit
def _soft_cap_log2(s, SOFT_CAP: tl.constexpr):
    """Scores in base 2 (score * log2 e) soft-capped in natural units:
    SOFT_CAP * tanh(score / SOFT_CAP) * log2 e, tanh from exp2 (the interpreter has no
    tanh): tanh |x| = (1 - e^-2|x|) / (1 + e^-2|x|)."""
    x = s * (1.0 / (1.4426950408889634 * SOFT_CAP))  # score / cap
    t = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2 |x|)
    tanh = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -tanh, tanh) * (SOFT_CAP * 1.4426950408889634)


@triton.jit
def _attend(
    q, q_pos, key_cache_ptr, value_cache_ptr, block_table_row_ptr, kv_head, dims, dim_valid,
    tile_lo, tile_hi, kv_lo, kv_end, scale_log2,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
    BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """Online softmax of the query tile `q` [BLOCK_M, HEAD_PAD] over KV tiles
    [tile_lo, tile_hi) (positions in [kv_lo, kv_end), causal against `q_pos`, and within
    SLIDING_WINDOW of it when above 0; nothing before kv_lo is loaded, block table entry
    included; scores soft-capped at SOFT_CAP when above 0).

    Returns (acc [BLOCK_M, HEAD_PAD] un-normalised, m [BLOCK_M] running max in base 2,
    l [BLOCK_M] running sum); m stays -inf for rows that saw no position."""
    m = tl.full([BLOCK_M], float("-inf"), ACC_DTYPE)
    l = tl.zeros([BLOCK_M], ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], ACC_DTYPE)
    q = q.to(DOT_DTYPE)
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + tl.arange(0, TILE_N)
        pos_valid = (pos >= kv_lo) & (pos < kv_end)
        k = _load_kv_tile(key_cache_ptr, block_table_row_ptr, pos, pos_valid, kv_head, dims,
                          dim_valid, stride_kc_block, stride_kc_slot, stride_kc_head,
                          stride_kc_dim, BLOCK_SIZE)
        s = _mm(q, tl.trans(k.to(DOT_DTYPE)), ACC_DTYPE, USE_DOT, PRECISION) * scale_log2
        if SOFT_CAP > 0:
            s = _soft_cap_log2(s, SOFT_CAP)
        visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows: no NaN
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(value_cache_ptr, block_table_row_ptr, pos, pos_valid, kv_head, dims,
                          dim_valid, stride_vc_block, stride_vc_slot, stride_vc_head,
                          stride_vc_dim, BLOCK_SIZE)
        # p is rounded to the cache dtype for the tensor-core product, as flash attention does
        p = p.to(value_cache_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + _mm(p, v.to(DOT_DTYPE), ACC_DTYPE, USE_DOT, PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def _paged_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr,
    query_start_loc_ptr, seq_lens_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, num_seqs, num_heads,
    stride_q_tok, stride_q_head, stride_q_dim,
    stride_o_tok, stride_o_head, stride_o_dim,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
    stride_bt_seq,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, ACC_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    """Program (q block, kv head, split): see the module docstring for the tile layout."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    if seq < 0:
        return
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:  # this request has fewer query blocks
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # cached positions before the first new token

    rows = tl.arange(0, BLOCK_M)
    tok_local = q_block_local * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (tok_local < q_len) & (rows % GROUP_PAD < GROUP)
    token = (q_start + tok_local).to(tl.int64)
    q_pos = ctx_len + tok_local
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM
    tile_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head
                + dims[None, :] * stride_q_dim, mask=tile_mask, other=0.0)

    # causal reach of this tile: the last valid row's position + 1
    kv_end = tl.minimum(seq_len, ctx_len + (q_block_local + 1) * BLOCK_Q)
    tile_hi = tl.cdiv(kv_end, TILE_N)
    # sliding window: the tile's first row sees nothing before kv_lo, so whole tiles before
    # it are skipped and nothing before it is loaded (its blocks may be freed)
    kv_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(ctx_len + q_block_local * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    tile_lo = kv_lo // TILE_N
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SPLITS)
        tile_lo = tl.maximum(tile_lo, split * tiles_per_split)
        tile_hi = tl.minimum(tile_hi, split * tiles_per_split + tiles_per_split)
    acc, m, l = _attend(
        q, q_pos, key_cache_ptr, value_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt_seq,
        kv_head, dims, dim_valid, tile_lo, tile_hi, kv_lo, kv_end, scale_log2,
        stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_dim,
        stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_dim,
        BLOCK_M, HEAD_PAD, TILE_N, BLOCK_SIZE, ACC_DTYPE, DOT_DTYPE, USE_DOT, PRECISION,
        SLIDING_WINDOW, SOFT_CAP,
    )
    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head
                 + dims[None, :] * stride_o_dim, out.to(out_ptr.dtype.element_ty),
                 mask=tile_mask)
    else:
        # partials are contiguous [num_tokens, num_heads, NUM_SPLITS(, HEAD_DIM)]
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m, mask=row_valid)
        tl.store(part_sum_ptr + part, l, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=tile_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr,
    num_seqs, num_heads, stride_o_tok, stride_o_head, stride_o_dim,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """Program (token, head): out = Σ 2^(m_s - M) acc_s / Σ 2^(m_s - M) l_s over the splits.
    Tokens no request owns are left untouched (their partials were never written)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first = tl.load(query_start_loc_ptr)
    last = tl.load(query_start_loc_ptr + num_seqs)
    if (token < first) | (token >= last):
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM
    part = (token * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + part, mask=split_valid, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_valid, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_valid[:, None] & dim_valid[None, :], other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # empty splits (m = -inf) weigh 0
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims * stride_o_dim,
             out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def merge_num_warps(splits_pad: int, head_pad: int) -> int:
    """Warps for one merge program: about 16 partial elements per thread, 1 to 4 warps."""
    return max(1, min(4, splits_pad * head_pad // 512))


def merge_splits_triton(
    acc: torch.Tensor,  # [num_tokens, num_heads, num_splits, head_dim] contiguous
    max_log2: torch.Tensor,  # [num_tokens, num_heads, num_splits] contiguous
    sums: torch.Tensor,  # [num_tokens, num_heads, num_splits] contiguous
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """The split-K reduce kernel; same contract as `merge_splits_ref`."""
    num_tokens, num_heads, num_splits, head_dim = acc.shape
    if not (acc.is_contiguous() and max_log2.is_contiguous() and sums.is_contiguous()):
        raise ValueError("split partials (acc, max_log2, sums) must be contiguous")
    if num_tokens == 0:
        return out
    splits_pad, head_pad = triton.next_power_of_2(num_splits), triton.next_power_of_2(head_dim)
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, acc, max_log2, sums, query_start_loc, query_start_loc.shape[0] - 1, num_heads,
        *out.stride(), NUM_SPLITS=num_splits, SPLITS_PAD=splits_pad, HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, num_warps=merge_num_warps(splits_pad, head_pad),
    )
    return out


def paged_attention_triton(
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
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged K/V (GQA aware), within
    `sliding_window` and soft-capped at `soft_cap` when given; see `paged_attention_ref`.
    The launch (tiles, split-K) comes from `choose_launch`, derived from shapes alone,
    without a host sync."""
    _check_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out)
    launch = choose_launch(
        num_tokens=query.shape[0], num_seqs=seq_lens.shape[0], num_heads=query.shape[1],
        num_kv_heads=key_cache.shape[2], head_dim=query.shape[2],
        max_kv_len=block_tables.shape[1] * key_cache.shape[1],
        num_sms=_device_sms(query.device), dtype=query.dtype,
    )
    return _launch(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                   out, launch, sliding_window, soft_cap)


def run_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    launch: AttentionLaunch,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """`paged_attention_triton` with an explicit launch (tests and benchmarks)."""
    _check_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out)
    return _launch(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                   out, launch, sliding_window, soft_cap)


def _launch(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out,
            launch: AttentionLaunch, sliding_window: int | None = None,
            soft_cap: float | None = None) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if launch.block_m % group_pad or launch.num_splits < 1:
        raise ValueError(f"launch.block_m={launch.block_m} must be a multiple of the padded "
                         f"GQA group {group_pad}, num_splits={launch.num_splits} must be >= 1")
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q = launch.block_m // group_pad
    splits = launch.num_splits
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    part_acc = part_max = part_sum = out  # unused placeholders when not splitting
    if splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=acc_dtype,
                               device=query.device)
        part_max = torch.empty(num_tokens, num_heads, splits, dtype=acc_dtype, device=query.device)
        part_sum = torch.empty_like(part_max)
    scale_log2 = scale * _LOG2E
    if query.dtype == torch.float64:
        # NOTE: a Python float reaches the kernel as float32; scale in float64 on the host
        query, scale_log2 = query * scale_log2, 1.0
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        part_acc, part_max, part_sum, scale_log2, num_seqs, num_heads,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_tables.stride(0),
        **_kernel_constants(query.dtype, group, group_pad, block_q, head_dim,
                            key_cache.shape[1], launch),
        # per layer: a kernel compiled for each (window, cap) a model has (Gemma: two)
        SLIDING_WINDOW=sliding_window or 0, SOFT_CAP=float(soft_cap or 0.0),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    if splits > 1:
        merge_splits_triton(part_acc, part_max, part_sum, query_start_loc, out)
    return out


def _kernel_constants(dtype, group, group_pad, block_q, head_dim, block_size, launch) -> dict:
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    dot = _TORCH_TO_TL[dtype]
    if dtype == torch.bfloat16 and _interpreting():
        dot = tl.float32  # triton-lang/triton#11584: the interpreter cannot multiply bf16
    return dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=launch.block_m,
        HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        TILE_N=launch.tile_n, BLOCK_SIZE=block_size, NUM_SPLITS=launch.num_splits,
        ACC_DTYPE=acc, DOT_DTYPE=dot, USE_DOT=dtype != torch.float64,
        PRECISION="ieee" if dtype in (torch.float32, torch.float64) else "tf32",
    )


def _check_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                     out) -> None:
    if query.dim() != 3 or key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim] and key_cache/"
                         f"value_cache [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(query.shape)}, {tuple(key_cache.shape)}, "
                         f"{tuple(value_cache.shape)}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not supported; use one of "
                         f"{SUPPORTED_DTYPES}")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"key_cache/value_cache dtype ({key_cache.dtype}, {value_cache.dtype}) "
                         f"must equal the query dtype {query.dtype}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads} and head_dim must match ({head_dim} vs "
                         f"{key_cache.shape[3]})")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc must be [num_seqs + 1] and block_tables "
                         f"[num_seqs, max_blocks] for num_seqs={num_seqs}, got "
                         f"{tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    if out is not None and out.shape != query.shape:
        raise ValueError(f"out must have the query's shape {tuple(query.shape)}, "
                         f"got {tuple(out.shape)}")


__all__ = [
    "AttentionLaunch",
    "choose_launch",
    "choose_num_splits",
    "merge_num_warps",
    "merge_splits_triton",
    "paged_attention_triton",
    "run_paged_attention",
    "write_kv_triton",
]


class TritonBackend(FunctionBackend):
    """`attention_backend=triton`: the kernels of this module. Every launch is derived from
    tensor shapes alone (no host sync, no per-step plan), so a forward through it can be
    captured in a CUDA graph and replayed with new metadata values."""

    name = "triton"
    can_capture_cuda_graphs = True
    kv_writer = staticmethod(write_kv_triton)
    attention = staticmethod(paged_attention_triton)
