"""A quantized paged KV cache (`kv_cache_dtype` int8 or fp8): its layout, the write that
quantizes each token's K/V rows, and the dequantization every reader applies.

Layout, per layer, beside the K and V caches of `reference.py`:

    key_cache, value_cache   [num_blocks, block_size, num_kv_heads, head_dim]  int8 / fp8 e4m3
    key_scale, value_scale   [num_blocks, block_size, num_kv_heads]            float32

addressed by the same slot (block_id * block_size + offset). Each (token, KV head) row of
head_dim values x is stored as q = x / s with one scale s = max|x| / QMAX (int8: rounded to
the nearest integer, QMAX 127, symmetric; fp8 e4m3: cast, QMAX 448, its largest finite), and
read back as q * s: a score is s_k * (q . k_q), a value row's weight w * s_v. One scale per
token and head, not per block, so a write never rescales what an earlier step stored (and a
prefix-cached block means the same for every reader). An all-zero row stores scale 0 and
reads back zeros.

Bytes per (token, KV head): head_dim + 4 against 4 * head_dim for float32 (SmolLM2's 64: 68
against 256, 3.76x the tokens per GiB) and 2 * head_dim for bf16/fp16 (1.88x).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
"""`kv_cache_dtype` values: auto (the compute dtype, unquantized), int8, fp8 (e4m3)."""

QUANTIZED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
"""The storage dtype of each quantized `kv_cache_dtype`."""

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""The largest magnitude a row's max|x| maps to, per storage dtype."""

SCALE_DTYPE = torch.float32
"""The scales' dtype: one float per (token, KV head)."""

KVScales = tuple[torch.Tensor, torch.Tensor]
"""(key_scale, value_scale) of one layer, each [num_blocks, block_size, num_kv_heads]."""


def storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The quantized cache's storage dtype, None for `auto` (the compute dtype).
    ValueError naming `kv_cache_dtype` for anything else."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                         f"got {kv_cache_dtype!r}")
    return QUANTIZED.get(kv_cache_dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (q [..., head_dim] of `dtype`, scale [...] float32): one scale
    per row, max|x| / QMAX (see the module docstring)."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / QMAX[dtype]
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale)).unsqueeze(-1)
    scaled = xf * inverse
    if dtype == torch.int8:
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scale
    return scaled.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., head_dim] with scale [...] -> values of `dtype`."""
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def write_kv_quantized(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, scales: KVScales,
                       slot_mapping: torch.Tensor) -> None:
    """Quantize each token's K and V rows and scatter them, with their scales, into the
    token's slot (in place; slot < 0: not written). Caches may be stored in any order."""
    keep = slot_mapping >= 0
    slots = slot_mapping.long()
    if key.shape[0] and not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    for x, cache, scale in ((key, key_cache, scales[0]), (value, value_cache, scales[1])):
        q, s = quantize(x, cache.dtype)
        # as bytes: torch's CPU index_copy_ has no fp8 kernel (and one byte is one byte)
        q, target = q.view(torch.uint8), cache.view(torch.uint8)
        if target.is_contiguous():
            target.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, q)
        else:  # a head-major store: index it through the shape every backend sees
            blocks, offsets = slots // cache.shape[1], slots % cache.shape[1]
            target[blocks, offsets] = q
        scale.view(-1, num_kv_heads).index_copy_(0, slots, s)


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, kv_scales: KVScales | None,
              blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `blocks` [n], each [n, block_size, num_kv_heads, head_dim]: dequantized
    into `dtype` for a quantized cache (`kv_scales` given), else as stored."""
    k, v = key_cache[blocks], value_cache[blocks]
    if kv_scales is None:
        return k, v
    return dequantize(k, kv_scales[0][blocks], dtype), dequantize(v, kv_scales[1][blocks], dtype)
