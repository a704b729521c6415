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

The kernel lives in `numba_decode.py`, imported on first use (`kernels()`), so a process
whose attention never reaches it does not import numba. Compiled on first use for each dtype
(about 4 s) and cached on disk next to that file (`cache=True`), so later processes load it in
well under a second; `NumbaBackend.warm_up` does it at start-up.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import NUMBA_DTYPES
from .kv_quant import KVScales
from .metadata import AttentionMetadata
from .torch_attention import PrefillChunk, TorchBackend, _prefill, split_requests



def installed() -> bool:
    """Whether numba can be imported (it is a dependency; tolerated absent), without
    importing it."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def kernels():
    """The compiled kernel's module (`numba_decode.py`), imported on first use: numba's
    import and the kernel's load from its disk cache are paid by a process that runs it."""
    from . import numba_decode

    _match_torch_threads(numba_decode.numba)
    return numba_decode


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


def decode_plan(meta: AttentionMetadata,
                order: Callable[[np.ndarray], np.ndarray]) -> NumbaAttentionPlan:
    """The decode requests as numpy arrays for a decode kernel, in the order `order` gives
    for their sequence lengths (a permutation), and the prefill chunks."""
    decodes, prefills = split_requests(meta)
    if not decodes:
        return NumbaAttentionPlan(None, prefills)
    seq_lens = np.ascontiguousarray(meta.seq_lens.numpy())
    requests = np.array([request for request, _ in decodes], dtype=np.int64)
    token_rows = np.array([row for _, row in decodes], dtype=np.int64)
    permutation = order(seq_lens[requests])
    return NumbaAttentionPlan(NumbaDecode(
        block_tables=np.ascontiguousarray(meta.block_tables.numpy()), seq_lens=seq_lens,
        requests=requests[permutation], token_rows=token_rows[permutation]), prefills)


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
        return decode_plan(meta, lambda lens: balanced_order(
            lens, kernels().numba.get_num_threads()))

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


def _match_torch_threads(numba) -> None:
    """Run the kernel on as many threads as torch's intra-op pool has (a worker confined to
    fewer cores than the machine's keeps numba there too), at most numba's pool size.
    numba keeps this setting per calling thread: the worker process loads (and warms up)
    and runs its steps on the same thread, so setting it once, when `kernels()` first
    imports the kernel, holds for every step."""
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
    kernels().decode_kernel(q.numpy(), key_cache.detach().numpy(),
                            value_cache.detach().numpy(), block_tables, seq_lens, requests,
                            token_rows, float(scale), result.numpy(), int(window),
                            float(soft_cap), kv_scales is not None, k_scale, v_scale)
    if result is not out:
        out.index_copy_(0, torch.from_numpy(token_rows),
                        result.index_select(0, torch.from_numpy(token_rows)).to(out.dtype))


_NO_SCALES = np.ones((1, 1, 1), dtype=np.float32)
"""The scales argument of a cache in the compute dtype (never read: `quantized` False)."""
