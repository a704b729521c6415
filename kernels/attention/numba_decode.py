"""The compiled kernel of `numba_attention.py` (its docstring says what it computes), in its
own module so that numba is imported only by a process that runs it: `import numba` and the
load of a cached kernel cost a worker about a second at start-up (measured on this project's
2-vCPU VM: 0.4 s import, 0.2-0.4 s a cached kernel), and a worker whose attention is the C
kernels' never calls it. `numba_attention.kernels()` imports this module on first use."""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange
from numba.extending import overload


def exp_shifted(row, top, exponents):  # pragma: no cover - replaced by the overload below
    """`row[p] = exp(row[p] - top)` in place, for `row <= top`; `exponents` is int32 scratch
    of the row's length. Called from compiled code only (see `_exp_shifted_impl`)."""
    raise NotImplementedError("exp_shifted is compiled into the numba kernel")


# exp(x) for x <= 0 as 2^n * P(r): n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts,
# Cody and Waite, so r keeps its low bits), P the degree-7 Taylor polynomial of exp on
# |r| <= ln 2 / 2 (truncation error 2e-9, below float32's 6e-8 rounding), and 2^n added to
# the result's exponent field through an int32 view. x is clamped at -87 (exp(-87) is
# 1.6e-38, float32's smallest normal is 1.2e-38), so the exponent never underflows; weights
# that small vanish beside the row's maximum, whose weight is 1. Measured against float64
# exp over [-87, 0]: relative error 6e-8. math.exp is a library call per element that LLVM
# cannot vectorise without Intel's SVML (PyPI's llvmlite has none): this loop compiles to
# AVX-512, 4x faster on 300 scores, and softmax was a quarter of the kernel's time.
# No `reassoc` flag: fastmath would be free to fold the two-part ln 2 back into one.
_EXP_FLAGS = {"nsz", "contract", "arcp", "nnan", "ninf"}


@njit(fastmath=_EXP_FLAGS, cache=True, nogil=True, inline="always")
def _exp_shifted_f32(row, top, exponents):  # pragma: no cover - compiled
    for p in range(row.shape[0]):
        x = max(row[p] - top, np.float32(-87.0))
        n = math.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
        r = x - n * np.float32(0.693359375)
        r = r - n * np.float32(-2.12194440e-4)
        e = np.float32(1 / 5040)
        e = e * r + np.float32(1 / 720)
        e = e * r + np.float32(1 / 120)
        e = e * r + np.float32(1 / 24)
        e = e * r + np.float32(1 / 6)
        e = e * r + np.float32(0.5)
        e = e * r + np.float32(1.0)
        row[p] = e * r + np.float32(1.0)
        exponents[p] = np.int32(n)
    bits = row.view(np.int32)
    for p in range(row.shape[0]):
        bits[p] += exponents[p] << 23


@njit(fastmath=True, cache=True, nogil=True, inline="always")
def _exp_shifted_f64(row, top, exponents):  # pragma: no cover - compiled
    for p in range(row.shape[0]):
        row[p] = math.exp(row[p] - top)


@overload(exp_shifted, inline="always")
def _exp_shifted_impl(row, top, exponents):
    """float32 rows take the vectorisable polynomial, float64 rows math.exp."""
    if row.dtype == numba.types.float32:
        return lambda row, top, exponents: _exp_shifted_f32(row, top, exponents)
    return lambda row, top, exponents: _exp_shifted_f64(row, top, exponents)


@njit(fastmath=True, cache=True, nogil=True, parallel=True)
def decode_kernel(q, key_cache, value_cache, block_tables, seq_lens, requests,
                   token_rows, scale, out, window, soft_cap, quantized, k_scale,
                   v_scale):  # pragma: no cover - compiled, not traced
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    for i in prange(requests.shape[0]):
        r, t = requests[i], token_rows[i]
        end = seq_lens[r]
        # positions [lo, end): the window's (scores[h, p - lo]); blocks before lo unread
        lo = max(end - window, 0) if window > 0 else 0
        seq_len = end - lo
        scores = np.empty((num_heads, seq_len), dtype=q.dtype)
        acc = np.zeros((num_heads, head_dim), dtype=q.dtype)
        qs = np.empty((num_heads, head_dim), dtype=q.dtype)
        inverse = np.empty(num_heads, dtype=q.dtype)
        exponents = np.empty(seq_len, dtype=np.int32)
        # NOTE: a zero of the query's dtype. A literal `0` is an int64, which numba
        # promotes float32 sums to float64 with: a convert per multiply-add made the
        # float32 dot products 1.7x slower (measured: 1.97 -> 1.18 ms for 64 x 300 x 9).
        zero = acc[0, 0]
        for h in range(num_heads):
            for d in range(head_dim):
                qs[h, d] = q[t, h, d] * scale
        for p in range(seq_len):  # scores: one pass over K
            block = block_tables[r, (lo + p) // block_size]
            offset = (lo + p) % block_size
            for kh in range(num_kv_heads):
                for g in range(group):
                    h = kh * group + g
                    s = zero
                    for d in range(head_dim):
                        s += qs[h, d] * key_cache[block, offset, kh, d]
                    if quantized:
                        s *= k_scale[block, offset, kh]
                    scores[h, p] = s
        if soft_cap > 0:
            for h in range(num_heads):  # float64 cap: exact for float64 scores
                for p in range(seq_len):
                    scores[h, p] = soft_cap * math.tanh(scores[h, p] / soft_cap)
        for h in range(num_heads):  # softmax over positions, per head
            row = scores[h]
            top = row[0]
            for p in range(1, seq_len):
                top = max(top, row[p])
            exp_shifted(row, top, exponents)
            total = zero
            for p in range(seq_len):
                total += row[p]
            inverse[h] = 1  # the output row is normalised, not every weight
            inverse[h] /= total
        for p in range(seq_len):  # weighted sum: one pass over V
            block = block_tables[r, (lo + p) // block_size]
            offset = (lo + p) % block_size
            for kh in range(num_kv_heads):
                for g in range(group):
                    h = kh * group + g
                    w = scores[h, p]
                    if quantized:
                        w *= v_scale[block, offset, kh]
                    for d in range(head_dim):
                        acc[h, d] += w * value_cache[block, offset, kh, d]
        for h in range(num_heads):
            for d in range(head_dim):
                out[t, h, d] = acc[h, d] * inverse[h]
