"""Paged decode attention compiled with numba: `NumbaBackend`, the CPU default for float32
and float64.

Decode attention on the CPU is memory-bound: every step reads each running request's whole
K/V. The torch backend (`kernels/attention/torch_attention.py`) must first gather a request's blocks
into a contiguous copy before a batched op can read them, so each byte crosses the memory bus
about three times (read, write the copy, read the copy). This kernel reads K and V once,
straight from the paged cache, one request per loop iteration (`prange`: spread over threads
when the worker has several):

    for request r (its query row t, seq_len L, block table row):
        scores[h, p] = scale * q[t, h] . K[slot(p), h // group]      p < L, every head h
        e[h, p]      = exp(scores[h, p] - max_p scores[h, p])         (`exp_shifted`)
        out[t, h]    = sum_p e[h, p] * V[slot(p), h // group] / sum_p e[h, p]

with slot(p) = (table[p // block_size], p % block_size). Positions at or past `seq_len` are
never read, so the cache may hold anything there. A layer with a sliding window W runs p over
the window only, seq_len - W <= p < seq_len (earlier blocks are never read); a soft cap c
replaces each score s by c * tanh(s / c) before the softmax. Arithmetic is in the query's dtype
(float32 or float64 only: `select_attention_backend` refuses this backend for others).
`fastmath` lets the compiler reorder the 64-term dot products into SIMD sums, so float32
results differ from the reference by rounding only (tested at the reference tolerances).
Prefill chunks (more than one new token) take the torch backend's SDPA path unchanged:
`NumbaBackend` subclasses `TorchBackend` and replaces only the decodes.

An int8 cache (`kv_cache_dtype=int8`, `kv_quant.py`) is read in place the same way, each
row dequantized in the loop: a score is k_scale[slot, kv_head] * (q . K_q[slot]) (the int8
values widen to the query's dtype in the multiply-add), a V row's weight w * v_scale[slot,
kv_head]. Caches in the compute dtype take the same code with `quantized` False (a branch per
position and KV head, not per element). numpy has no fp8 type: fp8 caches go to the torch
backend (`select_attention_backend`).

Compiled on first use for each dtype (about 4 s) and cached on disk next to this file
(`cache=True`), so later processes load it in well under a second; `NumbaBackend.warm_up`
does it at start-up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import NUMBA_DTYPES
from .kv_quant import KVScales
from .metadata import AttentionMetadata
from .torch_attention import PrefillChunk, TorchBackend, _prefill, split_requests

try:
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - numba is a dependency; tolerate its absence
    numba = None


@dataclass
class NumbaDecode:
    """The step's decode requests, as the compiled kernel takes them (host numpy arrays)."""

    block_tables: np.ndarray  # [num_seqs, max_blocks] int32: the metadata's, all requests
    seq_lens: np.ndarray  # [num_seqs] int32
    requests: np.ndarray  # [num_decode] int64: rows of the two above, in `balanced_order`
    token_rows: np.ndarray  # [num_decode] int64: their query rows


@dataclass
class NumbaAttentionPlan:
    """`NumbaBackend`'s view of one step, built once by `prepare` and read by every layer."""

    decode: NumbaDecode | None
    """The decode requests (None when the step has none), in `balanced_order` for the
    kernel's threads (each request writes its own query row, so any order is correct)."""
    prefills: list[PrefillChunk]
    """The requests with more than one new token, in batch order (the torch path's SDPA)."""


class NumbaBackend(TorchBackend):
    """`attention_backend=numba`: decodes through the compiled kernel, prefills through the
    torch backend's SDPA path. CPU tensors of float32 or float64 only (checked by
    `select_attention_backend`)."""

    name = "numba"

    def warm_up(self, dtype: torch.dtype) -> float:
        """Size numba's thread pool, then compile (or load from the disk cache) the kernel
        for `dtype` on a one-token batch, so the first real step does not pay for it.
        Returns the seconds it took."""
        if dtype not in NUMBA_DTYPES:
            raise ValueError(f"the numba decode kernel takes {NUMBA_DTYPES}, not {dtype}")
        start = time.perf_counter()
        _match_torch_threads()
        query = torch.zeros(1, 2, 4, dtype=dtype)
        cache = torch.zeros(2, 4, 1, 4, dtype=dtype)
        one = np.ones(1, dtype=np.int32)
        paged_decode_numba(query, cache, cache, np.ones((1, 1), dtype=np.int32), one,
                           np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), 1.0,
                           torch.empty_like(query))
        paged_decode_numba(query, cache, cache, np.ones((1, 1), dtype=np.int32), one,
                           np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), 1.0,
                           torch.empty_like(query), 1, 1.0)  # the capped variant
        if self.kv_dtype == torch.int8:  # the int8 cache's specialisation
            scales = torch.ones(2, 4, 1)
            paged_decode_numba(query, cache.to(torch.int8), cache.to(torch.int8),
                               np.ones((1, 1), dtype=np.int32), one,
                               np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), 1.0,
                               torch.empty_like(query), kv_scales=(scales, scales))
        return time.perf_counter() - start

    def prepare(self, meta: AttentionMetadata, block_size: int, num_kv_heads: int,
                head_dim: int, dtype: torch.dtype) -> NumbaAttentionPlan:
        """The decode requests as numpy arrays for the kernel, and the prefill chunks."""
        decodes, prefills = split_requests(meta)
        if not decodes:
            return NumbaAttentionPlan(None, prefills)
        seq_lens = np.ascontiguousarray(meta.seq_lens.numpy())
        requests = np.array([request for request, _ in decodes], dtype=np.int64)
        token_rows = np.array([row for _, row in decodes], dtype=np.int64)
        order = balanced_order(seq_lens[requests], numba.get_num_threads())
        return NumbaAttentionPlan(NumbaDecode(
            block_tables=np.ascontiguousarray(meta.block_tables.numpy()), seq_lens=seq_lens,
            requests=requests[order], token_rows=token_rows[order]), prefills)

    def attend(self, query, key_cache, value_cache, meta, plan: NumbaAttentionPlan, scale,
               out=None, *, sliding_window=None, soft_cap=None,
               kv_scales=None) -> torch.Tensor:
        """The decodes in the compiled kernel (window and cap included), the prefill chunks
        through the torch backend's SDPA path."""
        if out is None:
            out = torch.empty_like(query)
        self._attend_decodes(query, key_cache, value_cache, plan, scale, out, sliding_window,
                             soft_cap, kv_scales)
        for chunk in plan.prefills:
            _prefill(query, key_cache, value_cache, meta.block_tables[chunk.request], chunk,
                     scale, out, sliding_window, soft_cap, kv_scales)
        return out

    def _attend_decodes(self, query, key_cache, value_cache, plan: NumbaAttentionPlan,
                        scale: float, out: torch.Tensor, window: int | None = None,
                        soft_cap: float | None = None,
                        kv_scales: KVScales | None = None) -> None:
        d = plan.decode
        if d is not None:
            paged_decode_numba(query, key_cache, value_cache, d.block_tables, d.seq_lens,
                               d.requests, d.token_rows, scale, out, window or 0,
                               soft_cap or 0.0, kv_scales)


def balanced_order(lengths: np.ndarray, num_threads: int) -> np.ndarray:
    """An order of the decode requests under which numba's static `prange` schedule (thread
    k takes the k-th of `num_threads` equal runs of iterations) gives every thread about the
    same number of positions: longest first, dealt round-robin, each thread's hand in turn.
    In batch order one thread can get all the long contexts (64 lognormal lengths arriving
    shortest first, 2 threads: 2.38 ms in batch order, 2.28 ms in this order; 3.18 ms on one
    thread)."""
    by_length = np.argsort(-lengths, kind="stable")
    if num_threads <= 1:
        return by_length
    return np.concatenate([by_length[k::num_threads] for k in range(num_threads)])


def _match_torch_threads() -> None:
    """Run the kernel on as many threads as torch's intra-op pool has (a worker confined to
    fewer cores than the machine's keeps numba there too), at most numba's pool size.
    numba keeps this setting per calling thread: the worker process loads (and warms up)
    and runs its steps on the same thread, so setting it once here holds for every step."""
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


def paged_decode_numba(query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, block_tables: np.ndarray,
                       seq_lens: np.ndarray, requests: np.ndarray, token_rows: np.ndarray,
                       scale: float, out: torch.Tensor, window: int = 0,
                       soft_cap: float = 0.0, kv_scales: KVScales | None = None) -> None:
    """Attend the query rows `token_rows` (one new token each) of the requests `requests`
    (row indices of `block_tables` / `seq_lens`) and write them into `out` in place; over
    the last `window` positions only when it is above 0, scores soft-capped at `soft_cap`
    when it is above 0; an int8 cache dequantized with `kv_scales`."""
    q = query.detach().contiguous()
    result = out if out.is_contiguous() and out.dtype == q.dtype else torch.empty_like(q)
    if kv_scales is None:
        k_scale = v_scale = _NO_SCALES
    else:
        k_scale, v_scale = (t.detach().numpy() for t in kv_scales)
    _decode_kernel(q.numpy(), key_cache.detach().numpy(), value_cache.detach().numpy(),
                   block_tables, seq_lens, requests, token_rows, float(scale),
                   result.numpy(), int(window), float(soft_cap), kv_scales is not None,
                   k_scale, v_scale)
    if result is not out:
        out.index_copy_(0, torch.from_numpy(token_rows),
                        result.index_select(0, torch.from_numpy(token_rows)).to(out.dtype))


_NO_SCALES = np.ones((1, 1, 1), dtype=np.float32)
"""The scales argument of a cache in the compute dtype (never read: `quantized` False)."""


def exp_shifted(row, top, exponents):  # pragma: no cover - replaced by the overload below
    """`row[p] = exp(row[p] - top)` in place, for `row <= top`; `exponents` is int32 scratch
    of the row's length. Called from compiled code only (see `_exp_shifted_impl`)."""
    raise NotImplementedError("exp_shifted is compiled into the numba kernel")


if numba is not None:
    from numba.extending import overload

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
    def _decode_kernel(q, key_cache, value_cache, block_tables, seq_lens, requests,
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
