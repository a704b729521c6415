"""`attention_backend=cpu`: the numba backend with its float32 decodes and prefill chunks in
the C kernels of `decode_attention.c`, the CPU default where they build (a C compiler and
AVX-512, or AVX2 with FMA: the same arithmetic in 8-float vectors).

Decodes and short prefill chunks go row by row: each row reads its K and V once, in place in
the paged cache, prefetching each KV head's rows through the block table ahead of its loops,
which the numba kernel cannot, and splitting the work by request and KV head instead of by
request only. Measured on the 2-vCPU Xeon (SmolLM2-135M's geometry, 9 query and 3 KV heads of
64, 32 requests x 257 positions, 30 layers' caches in turn, 2 threads): 0.69 ms a layer
against numba's 0.90; its AVX2 build, run there, 0.85 (level with numba's in a whole decode
step). Longer prefill chunks go through the blocked kernel (`tidal_prefill_attention`,
AVX-512 builds: ROW_CHUNK_TOKENS) or, in AVX2 builds, the torch backend's SDPA path
(AVX2_ROW_CHUNK_TOKENS).

An int8 cache (`kv_cache_dtype=int8`) keeps the numba backend's plan and prefill path; its
decodes go to the C int8 row kernel (`tidal_decode_attention_int8`: rows widened to float a
tile of positions at a time) and its K/V writes to `tidal_write_kv_int8`, which took
SmolLM2's whole decode step at 8 x 4096 positions from 1.36x float32's (numba's int8 kernel)
to 0.84x, same run (docs/kv-cache-dtype.md). What the C kernels do not
take goes to the numba kernel unchanged: float64, head sizes other than 16..128 in steps of
16 and 256. Results differ from the reference by float32 rounding only.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..cpu import native
from .metadata import AttentionMetadata
from .numba_attention import NumbaAttentionPlan, NumbaBackend, decode_plan
from .torch_attention import PrefillChunk, split_requests

SOURCE = Path(__file__).with_name("decode_attention.c")


def build() -> native.Build:
    """The compiled kernel (built the first time on this machine), or why it cannot run
    here."""
    return native.build(SOURCE, "tidal_decode_attention_available", _declare)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot run here."""
    return build().library


def _declare(library: ctypes.CDLL) -> None:
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    library.tidal_decode_attention.argtypes = [p, p, p, p, n, p, p, p, n, i, i, i, i, n, n, n,
                                               ctypes.c_float, p]
    library.tidal_decode_attention.restype = ctypes.c_int
    library.tidal_prefill_attention.argtypes = [p, p, p, p, i, i, n, i, i, i, i, n, n, n,
                                                ctypes.c_float, p]
    library.tidal_prefill_attention.restype = ctypes.c_int
    # the same with (window, soft cap) before out: 0 for none
    library.tidal_decode_attention_window.argtypes = [p, p, p, p, n, p, p, p, n, i, i, i, i, n,
                                                      n, n, ctypes.c_float, i, ctypes.c_float,
                                                      p]
    library.tidal_decode_attention_window.restype = ctypes.c_int
    library.tidal_prefill_attention_window.argtypes = [p, p, p, p, i, i, n, i, i, i, i, n, n,
                                                       n, ctypes.c_float, i, ctypes.c_float, p]
    library.tidal_prefill_attention_window.restype = ctypes.c_int
    library.tidal_prefill_attention_available.restype = ctypes.c_int
    library.tidal_decode_attention_head_dim_ok.argtypes = [i]
    # over an int8 cache: the int8 K and V caches, then their float32 scales, ..., the scales'
    # strides (block, position, KV head) after the caches'
    library.tidal_decode_attention_int8.argtypes = [p, p, p, p, p, p, n, p, p, p, n, i, i, i,
                                                    i, n, n, n, n, n, n, ctypes.c_float, i,
                                                    ctypes.c_float, p]
    library.tidal_decode_attention_int8.restype = ctypes.c_int
    library.tidal_write_kv.argtypes = [p, p, n, n, n, n, p, p, p, n, i, i, i, n, n, n, n]
    library.tidal_write_kv.restype = ctypes.c_long
    # the same into an int8 cache: after the caches their scales, and after the caches'
    # strides the scales' (block, position, KV head)
    library.tidal_write_kv_int8.argtypes = [p, p, n, n, n, n, p, p, p, p, p, n, i, i, i, n, n,
                                            n, n, n, n, n]
    library.tidal_write_kv_int8.restype = ctypes.c_long


def available() -> bool:
    """Whether the C decode kernel builds and runs on this machine."""
    return load() is not None


def slot_past_cache(slots: torch.Tensor, bad: int, num_slots: int) -> IndexError:
    """The error for `tidal_write_kv`'s answer `bad` (the first token whose slot is past the
    cache), as torch's indexing would raise it."""
    return IndexError(f"slot_mapping[{bad}] = {int(slots[bad])} is past the cache's "
                      f"{num_slots} slots")


@dataclass
class RowAttention:
    """Query rows for the C kernel, as host arrays: each row attends over the first `lens`
    positions of its request (a decode's whole sequence; row i of a short prefill chunk of
    q_len new tokens, seq_len - q_len + 1 + i), longest first so the threads' dynamic schedule
    ends together."""

    requests: np.ndarray  # [n] int64: rows of the plan's block_tables
    token_rows: np.ndarray  # [n] int64: query rows
    lens: np.ndarray  # [n] int32

    def addresses(self) -> tuple[int, int, int]:
        """The three arrays' data addresses (lens, requests, token_rows), as the kernel takes
        them: found once a step (numpy's `.ctypes.data` builds an object each time)."""
        return self.lens.ctypes.data, self.requests.ctypes.data, self.token_rows.ctypes.data


@dataclass
class CpuAttentionPlan:
    """`CpuBackend`'s view of one step: the rows the C kernel takes one by one (None: none),
    the prefill chunks its blocked kernel takes (AVX-512 builds), and those left for SDPA (AVX2
    builds' long chunks)."""

    block_tables: np.ndarray  # [num_seqs, max_blocks] int32: the metadata's, all requests
    rows: RowAttention | None
    chunks: list[PrefillChunk]  # more than ROW_CHUNK_TOKENS new tokens each
    prefills: list[PrefillChunk] = field(default_factory=list)  # more than AVX2_ROW_CHUNK_TOKENS
    row_call: tuple = field(init=False, default=())
    """The row kernel's arguments that every layer shares (block tables and rows, as
    addresses), made once for the step."""

    def __post_init__(self) -> None:
        if self.rows is not None:
            self.row_call = (self.block_tables.ctypes.data, self.block_tables.shape[1],
                             *self.rows.addresses(), len(self.rows.requests))


ROW_CHUNK_TOKENS = 16
"""Prefill chunks of up to this many new tokens go through the C kernel row by row with the
decodes, in one call (each row reads its request's K/V again), longer ones through its blocked
kernel (`tidal_prefill_attention`: K transposed once, up to 24 query vectors an item). SmolLM2's
geometry, one layer, one prompt, 2 threads (Xeon, 2026-12-02): 17 new tokens over 40 0.025 ms
either way; 128 tokens 0.149 ms blocked, 0.218 in rows, 0.262 with SDPA; 512 tokens 1.44 /
3.04 / 2.65 ms."""

AVX2_ROW_CHUNK_TOKENS = 128
"""Without the blocked kernel (AVX2 builds), prefill chunks of up to this many new tokens go
row by row, longer ones through SDPA (the AVX2 build run on the Xeon, one layer: 128 tokens
0.30 ms in rows or SDPA; 512 tokens 4.35 in rows, 2.83 with SDPA)."""


class CpuBackend(NumbaBackend):
    """Decodes and short prefill chunks through the C row kernel where it applies (float32, a
    head size it takes), longer prefill chunks through its blocked kernel (AVX-512 builds) or
    SDPA (AVX2 builds); the numba backend's plan and kernel otherwise. CPU tensors only."""

    name = "cpu"

    def warm_up(self, dtype: torch.dtype) -> float:
        """Build or load the C kernels, and the numba kernel where they do not take this
        model's caches (not float32, or quantized other than int8); a head size the C kernels
        refuse loads numba's at the first step instead (its disk cache: a few tenths of a
        second, once). An int8 cache's decodes are the C int8 kernel's: warming numba's up
        for them took 4.2-7.6 s of an int8 worker's start on the loaded 2-vCPU EPYC (import
        and three cached kernels, 2026-12-04), for a kernel it then never ran."""
        start = time.perf_counter()
        library = load()
        if (library is None or dtype != torch.float32
                or self.kv_dtype not in (None, torch.int8)):
            return super().warm_up(dtype) + (time.perf_counter() - start)
        return time.perf_counter() - start

    def kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Stored head-major, [num_blocks, num_kv_heads, block_size, head_dim] (the tensor is
        that storage seen through the shape every backend indexes), where the C kernels take
        these tensors: a KV head's rows of one block are then one contiguous run of
        block_size x head_dim floats, which the hardware prefetcher follows, where
        position-major they are head_dim floats every num_kv_heads x head_dim. Measured with
        `tidal_decode_attention` on the 2-vCPU Xeon, 32 requests x 256-257 positions, 30
        layers' caches in turn (read from memory): SmolLM2's geometry (9 query and 3 KV heads
        of 64) 0.75-0.80 -> 0.65-0.67 ms a layer, 20 GB/s where a plain read of memory gets 22;
        the 7M model's (4 and 2 heads) 0.50-0.52 -> 0.40-0.41. Four layers' caches (in the L3
        cache): 7M, 256 requests 5.4 -> 4.3 ms a layer, 32 requests 0.29 -> 0.20."""
        if not self._takes(dtype, head_dim):
            return super().kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                    device)
        return torch.empty(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype,
                           device=device).transpose(1, 2)

    def _takes(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the C kernels take caches of this dtype and head size (float32 caches
        only: a quantized one, `kv_dtype`, goes to numba's kernel)."""
        library = load()
        return (library is not None and dtype == torch.float32 and self.kv_dtype is None
                and bool(library.tidal_decode_attention_head_dim_ok(head_dim)))

    @staticmethod
    def _takes_int8(query, key_cache, value_cache, kv_scales) -> bool:
        """Whether the C int8 row kernel takes these decodes: float32 queries over an int8
        cache (K and V alike, head_dim contiguous) with float32 scales, a head size it
        takes. The rest (fp8 is refused at start-up) stays with numba's kernel."""
        library = load()
        return (library is not None and kv_scales is not None
                and query.dtype == torch.float32
                and key_cache.dtype == value_cache.dtype == torch.int8
                and key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
                and kv_scales[0].dtype == kv_scales[1].dtype == torch.float32
                and kv_scales[0].stride() == kv_scales[1].stride()
                and bool(library.tidal_decode_attention_head_dim_ok(query.shape[2])))

    def _attend_int8_decodes(self, query, key_cache, value_cache, kv_scales, decode,
                             scale: float, out: torch.Tensor, window: int | None,
                             soft_cap: float | None) -> None:
        """numba's decode rows (`plan.decode`) through `tidal_decode_attention_int8`: one
        pass over a quarter of float32's bytes, each tile of rows widened to float once.
        Bound by arithmetic on the 2-vCPU AMD EPYC, where float32 is mostly bound by memory:
        one thread, 8 x 4096 positions, 0.75x float32's CPU time a layer; SmolLM2's whole
        decode step 0.72-0.99x float32's at 2048-4096 positions (docs/kv-cache-dtype.md)."""
        q = query.detach().contiguous()
        direct = out.is_contiguous() and out.dtype == torch.float32
        result = out if direct else torch.empty_like(q)
        key, value = key_cache.detach(), value_cache.detach()
        k_scale, v_scale = (s.detach() for s in kv_scales)
        tables = decode.block_tables
        lens = np.ascontiguousarray(decode.seq_lens[decode.requests], dtype=np.int32)
        requests = np.ascontiguousarray(decode.requests, dtype=np.int64)
        rows = np.ascontiguousarray(decode.token_rows, dtype=np.int64)
        status = load().tidal_decode_attention_int8(
            q.data_ptr(), key.data_ptr(), value.data_ptr(), k_scale.data_ptr(),
            v_scale.data_ptr(), tables.ctypes.data, tables.shape[1], lens.ctypes.data,
            requests.ctypes.data, rows.ctypes.data, len(rows), q.shape[1], key.shape[2],
            q.shape[2], key.shape[1], *key.stride()[:3], *k_scale.stride()[:3], scale,
            window or 0, soft_cap or 0.0, result.data_ptr())
        if status != 0:
            raise MemoryError(f"int8 decode attention kernel failed (status {status})")
        if not direct:
            index = torch.from_numpy(rows)
            out[index] = result[index].to(out.dtype)

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping,
                 kv_scales=None) -> None:
        """float32 K/V into float32 caches by `tidal_write_kv` (row copies through both
        tensors' strides: indexing a head-major cache from torch took 25 us a layer at 32
        tokens, 0.41 ms at 2048, against 16 us / 0.22 ms for a plain cache's index_copy_), into
        int8 caches by `tidal_write_kv_int8` (kv_quant.quantize's arithmetic, bit for bit, in
        one call where torch's took ten); anything else as the torch backend."""
        library = load()
        quantized = kv_scales is not None and key_cache.dtype == torch.int8
        if (library is None or not self._c_writes(key, value, key_cache, value_cache,
                                                  slot_mapping, kv_scales, quantized)):
            super().write_kv(key, value, key_cache, value_cache, slot_mapping, kv_scales)
            return
        slots = slot_mapping.to(torch.int64).contiguous()
        rows = (key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0),
                value.stride(1))
        geometry = (key.shape[0], key.shape[1], key.shape[2], key_cache.shape[1],
                    key_cache.shape[0] * key_cache.shape[1], *key_cache.stride()[:3])
        if quantized:
            bad = library.tidal_write_kv_int8(
                *rows, key_cache.data_ptr(), value_cache.data_ptr(), kv_scales[0].data_ptr(),
                kv_scales[1].data_ptr(), slots.data_ptr(), *geometry,
                *kv_scales[0].stride())
        else:
            bad = library.tidal_write_kv(*rows, key_cache.data_ptr(), value_cache.data_ptr(),
                                         slots.data_ptr(), *geometry)
        if bad >= 0:
            raise slot_past_cache(slots, bad, key_cache.shape[0] * key_cache.shape[1])

    @staticmethod
    def _c_writes(key, value, key_cache, value_cache, slot_mapping, kv_scales,
                  quantized: bool) -> bool:
        """Whether `tidal_write_kv` (float32 caches, no scales) or `tidal_write_kv_int8`
        (`quantized`: int8 caches, float32 scales of one layout) takes this write: float32
        K/V rows with head_dim contiguous, K and V caches of one layout."""
        cache_dtype = torch.int8 if quantized else torch.float32
        if quantized and (kv_scales[0].dtype != torch.float32
                          or kv_scales[1].dtype != torch.float32
                          or kv_scales[0].stride() != kv_scales[1].stride()
                          or kv_scales[0].shape != key_cache.shape[:3]):
            return False
        return ((kv_scales is None or quantized)
                and key.dtype == value.dtype == torch.float32
                and key_cache.dtype == value_cache.dtype == cache_dtype
                and key.stride(2) == 1 and value.stride(2) == 1 and key_cache.stride(3) == 1
                and key_cache.stride() == value_cache.stride()
                and key.shape[1:] == key_cache.shape[2:] and value.shape == key.shape
                and slot_mapping.shape == key.shape[:1])

    def prepare(self, meta: AttentionMetadata, block_size: int, num_kv_heads: int,
                head_dim: int, dtype: torch.dtype) -> CpuAttentionPlan | NumbaAttentionPlan:
        library = load()
        if not self._takes(dtype, head_dim):
            if (library is not None and dtype == torch.float32 and self.kv_dtype == torch.int8
                    and library.tidal_decode_attention_head_dim_ok(head_dim)):
                return self._int8_plan(meta)
            return super().prepare(meta, block_size, num_kv_heads, head_dim, dtype)
        decodes, chunks = split_requests(meta)
        blocked_kernel = library.tidal_prefill_attention_available()
        row_limit = ROW_CHUNK_TOKENS if blocked_kernel else AVX2_ROW_CHUNK_TOKENS
        seq_lens = meta.seq_lens.tolist()
        requests = [request for request, _ in decodes]
        token_rows = [row for _, row in decodes]
        lens = [seq_lens[request] for request in requests]
        blocked, sdpa = [], []
        for chunk in chunks:
            q_len = chunk.q_end - chunk.q_start
            if q_len > row_limit:
                (blocked if blocked_kernel else sdpa).append(chunk)
                continue
            requests += [chunk.request] * q_len
            token_rows += range(chunk.q_start, chunk.q_end)
            lens += range(chunk.seq_len - q_len + 1, chunk.seq_len + 1)
        block_tables = np.ascontiguousarray(meta.block_tables.numpy())
        if not requests:
            return CpuAttentionPlan(block_tables, None, blocked, sdpa)
        lens_array = np.array(lens, dtype=np.int32)
        order = np.argsort(-lens_array, kind="stable")
        return CpuAttentionPlan(block_tables, RowAttention(
            requests=np.array(requests, dtype=np.int64)[order],
            token_rows=np.array(token_rows, dtype=np.int64)[order],
            lens=lens_array[order]), blocked, sdpa)

    @staticmethod
    def _int8_plan(meta: AttentionMetadata) -> NumbaAttentionPlan:
        """numba's plan for an int8 cache whose decodes the C int8 kernel takes: the decodes
        longest first (its threads take items dynamically) where numba's `prepare` orders
        them for numba's static schedule, which imports numba to ask its thread count (a
        worker that never runs numba's kernel then never imports it)."""
        return decode_plan(meta, lambda lens: np.argsort(-lens, kind="stable"))

    def _attend_decodes(self, query, key_cache, value_cache,
                        plan: CpuAttentionPlan | NumbaAttentionPlan, scale: float,
                        out: torch.Tensor, window: int | None = None,
                        soft_cap: float | None = None, kv_scales=None) -> None:
        """Everything the C kernels take: the rows (decodes, short chunks) in one call, then
        each longer prefill chunk through the blocked kernel; within `window` (each row over
        its own window, the blocks before it unread) and soft-capped at `soft_cap`."""
        if isinstance(plan, NumbaAttentionPlan):
            if plan.decode is not None and self._takes_int8(query, key_cache, value_cache,
                                                            kv_scales):
                self._attend_int8_decodes(query, key_cache, value_cache, kv_scales,
                                          plan.decode, scale, out, window, soft_cap)
                return
            super()._attend_decodes(query, key_cache, value_cache, plan, scale, out, window,
                                    soft_cap, kv_scales)
            return
        if plan.rows is None and not plan.chunks:
            return
        q = query.detach().contiguous()
        key, value = key_cache.detach(), value_cache.detach()
        if key.stride() != value.stride() or key.stride(3) != 1:
            raise ValueError(f"the K and V caches must share one layout with head_dim "
                             f"contiguous, got strides {key.stride()} and {value.stride()}")
        direct = out.is_contiguous() and out.dtype == torch.float32
        result = out if direct else torch.empty_like(q)
        library, tables = load(), plan.block_tables
        # heads, KV heads, head size, block size, then the caches' strides: block, position,
        # KV head (any order: `kv_cache`)
        geometry = (q.shape[1], key.shape[2], q.shape[2], key.shape[1], *key.stride()[:3],
                    scale, window or 0, soft_cap or 0.0)
        written = []
        if plan.rows is not None:
            status = library.tidal_decode_attention_window(
                q.data_ptr(), key.data_ptr(), value.data_ptr(), *plan.row_call, *geometry,
                result.data_ptr())
            if status != 0:
                raise MemoryError(f"decode attention kernel failed (status {status})")
            if not direct:
                written.append(torch.from_numpy(plan.rows.token_rows))
        for chunk in plan.chunks:
            status = library.tidal_prefill_attention_window(
                q.data_ptr(), key.data_ptr(), value.data_ptr(),
                tables[chunk.request].ctypes.data, chunk.q_end - chunk.q_start, chunk.seq_len,
                chunk.q_start, *geometry, result.data_ptr())
            if status != 0:
                raise MemoryError(f"prefill attention kernel failed (status {status})")
            if not direct:
                written.append(torch.arange(chunk.q_start, chunk.q_end))
        if not direct:
            index = torch.cat(written)
            out.index_copy_(0, index, result.index_select(0, index).to(out.dtype))
