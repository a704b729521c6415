"""Paged decode attention compiled with numba: the CPU decode kernel.

Decode attention on the CPU is memory-bound: every step reads each running request's whole
K/V. The torch path (`torch_attention._decode`) must first gather a request's blocks into a
contiguous copy before a batched op can read them, so each byte crosses the memory bus about
three times (read, write the copy, read the copy). This kernel reads K and V once, straight
from the paged cache, one request per loop iteration (`prange`: spread over threads when the
worker has several):

    for request r (its query row t, seq_len L, block table row):
        scores[h, p] = scale * q[t, h] . K[slot(p), h // group]      p < L, every head h
        probs[h]     = softmax(scores[h])                             (max-subtracted)
        out[t, h]    = sum_p probs[h, p] * V[slot(p), h // group]

with slot(p) = (table[p // block_size], p % block_size). Positions at or past `seq_len` are
never read, so the cache may hold anything there. Arithmetic is in the query's dtype
(float32 or float64; other dtypes take the torch path). `fastmath` lets the compiler reorder
the 64-term dot products into SIMD sums, so float32 results differ from the reference by
rounding only (tested at the reference tolerances).

Compiled on first use for each dtype (about 4 s) and cached on disk next to this file
(`cache=True`), so later processes load it in well under a second.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

try:
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - numba is a dependency; tolerate its absence
    numba = None

SUPPORTED_DTYPES = (torch.float32, torch.float64)


def numba_decode_available(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether this kernel can attend these tensors: numba installed, CPU, float32/64."""
    return (numba is not None and query.device.type == "cpu"
            and query.dtype in SUPPORTED_DTYPES and key_cache.dtype == query.dtype)


def warm_up(dtype: torch.dtype) -> float:
    """Compile (or load from the disk cache) the kernel for `dtype` now, on a one-token
    batch, so the first real step does not pay for it. Returns the seconds it took (0 when
    the kernel does not apply)."""
    if numba is None or dtype not in SUPPORTED_DTYPES:
        return 0.0
    start = time.perf_counter()
    query = torch.zeros(1, 2, 4, dtype=dtype)
    cache = torch.zeros(2, 4, 1, 4, dtype=dtype)
    one = np.ones(1, dtype=np.int32)
    paged_decode_numba(query, cache, cache, np.ones((1, 1), dtype=np.int32), one,
                       np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), 1.0,
                       torch.empty_like(query))
    return time.perf_counter() - start


def paged_decode_numba(query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, block_tables: np.ndarray,
                       seq_lens: np.ndarray, requests: np.ndarray, token_rows: np.ndarray,
                       scale: float, out: torch.Tensor) -> None:
    """Attend the query rows `token_rows` (one new token each) of the requests `requests`
    (row indices of `block_tables` / `seq_lens`) and write them into `out` in place."""
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    q = query.detach().contiguous()
    result = out if out.is_contiguous() and out.dtype == q.dtype else torch.empty_like(q)
    _decode_kernel(q.numpy(), key_cache.detach().numpy(), value_cache.detach().numpy(),
                   block_tables, seq_lens, requests, token_rows, float(scale),
                   result.numpy())
    if result is not out:
        out.index_copy_(0, torch.from_numpy(token_rows),
                        result.index_select(0, torch.from_numpy(token_rows)).to(out.dtype))


if numba is not None:

    @njit(fastmath=True, cache=True, nogil=True, parallel=True)
    def _decode_kernel(q, key_cache, value_cache, block_tables, seq_lens, requests,
                       token_rows, scale, out):  # pragma: no cover - compiled, not traced
        num_heads, head_dim = q.shape[1], q.shape[2]
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        group = num_heads // num_kv_heads
        for i in prange(requests.shape[0]):
            r, t = requests[i], token_rows[i]
            seq_len = seq_lens[r]
            scores = np.empty((num_heads, seq_len), dtype=q.dtype)
            acc = np.zeros((num_heads, head_dim), dtype=q.dtype)
            qs = np.empty((num_heads, head_dim), dtype=q.dtype)
            for h in range(num_heads):
                for d in range(head_dim):
                    qs[h, d] = q[t, h, d] * scale
            for p in range(seq_len):  # scores: one pass over K
                block, offset = block_tables[r, p // block_size], p % block_size
                for kh in range(num_kv_heads):
                    for g in range(group):
                        h = kh * group + g
                        s = qs[h, 0] * 0
                        for d in range(head_dim):
                            s += qs[h, d] * key_cache[block, offset, kh, d]
                        scores[h, p] = s
            for h in range(num_heads):  # softmax over positions, per head
                top = scores[h, 0]
                for p in range(1, seq_len):
                    top = max(top, scores[h, p])
                total = top * 0
                for p in range(seq_len):
                    e = math.exp(scores[h, p] - top)
                    scores[h, p] = e
                    total += e
                inv = 1 / total
                for p in range(seq_len):
                    scores[h, p] *= inv
            for p in range(seq_len):  # weighted sum: one pass over V
                block, offset = block_tables[r, p // block_size], p % block_size
                for kh in range(num_kv_heads):
                    for g in range(group):
                        h = kh * group + g
                        w = scores[h, p]
                        for d in range(head_dim):
                            acc[h, d] += w * value_cache[block, offset, kh, d]
            for h in range(num_heads):
                for d in range(head_dim):
                    out[t, h, d] = acc[h, d]
