"""`attention_backend=cpu`: the numba backend with its float32 decodes in the C kernel of
`decode_attention.c`, the CPU default where that kernel builds (a C compiler and AVX-512, or
AVX2 with FMA: the same arithmetic in 8-float vectors).

Both kernels read K and V once, in place in the paged cache; the C one prefetches each KV
head's rows through the block table ahead of its loops, which the numba kernel cannot, and
splits the work by request and KV head instead of by request only. Measured on the 2-vCPU
Xeon (SmolLM2-135M's geometry, 9 query and 3 KV heads of 64, 32 requests x 257 positions, 30
layers' caches in turn, 2 threads): 0.69 ms a layer against numba's 0.90; its AVX2 build, run
there, 0.85 (level with numba's in a whole decode step).

What the C kernel does not take goes to the numba kernel unchanged: float64, head sizes other
than 16..128 in steps of 16 and 256. Prefill chunks take the torch backend's SDPA path, as
under `numba`. Results differ from the reference by float32 rounding only.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from tidal.kernels import native
from tidal.kernels.numba_attention import NumbaAttentionPlan, NumbaBackend

SOURCE = Path(__file__).with_name("decode_attention.c")

_library: ctypes.CDLL | None = None
_tried = False


def load() -> ctypes.CDLL | None:
    """The compiled kernel (built the first time on this machine), or None where it cannot
    run here; tried once per process."""
    global _library, _tried
    if not _tried:
        _tried = True
        _library = _build_and_load()
    return _library


def _build_and_load() -> ctypes.CDLL | None:
    library = native.build_and_load(SOURCE, "tidal_decode_attention_available")
    if library is None:
        return None
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    library.tidal_decode_attention.argtypes = [p, p, p, p, n, p, p, p, n, i, i, i, i,
                                               ctypes.c_float, p]
    library.tidal_decode_attention.restype = ctypes.c_int
    library.tidal_decode_attention_head_dim_ok.argtypes = [i]
    return library


def available() -> bool:
    """Whether the C decode kernel builds and runs on this machine."""
    return load() is not None


class CpuBackend(NumbaBackend):
    """Decodes through the C kernel where it applies (float32, a head size it takes), the
    numba kernel otherwise; prefills through SDPA. CPU tensors only."""

    name = "cpu"

    def warm_up(self, dtype: torch.dtype) -> float:
        """Build or load the C kernel, and the numba kernel that takes what it does not."""
        start = time.perf_counter()
        load()
        return super().warm_up(dtype) + (time.perf_counter() - start)

    def _attend_decodes(self, query, key_cache, value_cache, plan: NumbaAttentionPlan,
                        scale: float, out: torch.Tensor) -> None:
        d = plan.decode
        if d is None:
            return
        library = load()
        if (library is None or query.dtype != torch.float32 or key_cache.dtype != torch.float32
                or not (key_cache.is_contiguous() and value_cache.is_contiguous())
                or not library.tidal_decode_attention_head_dim_ok(query.shape[2])):
            super()._attend_decodes(query, key_cache, value_cache, plan, scale, out)
            return
        q = query.detach().contiguous()
        direct = out.is_contiguous() and out.dtype == torch.float32
        result = out if direct else torch.empty_like(q)
        key, value = key_cache.detach(), value_cache.detach()
        status = library.tidal_decode_attention(
            q.data_ptr(), key.data_ptr(), value.data_ptr(), d.block_tables.ctypes.data,
            d.block_tables.shape[1], d.seq_lens.ctypes.data, d.requests.ctypes.data,
            d.token_rows.ctypes.data, len(d.requests), q.shape[1], key.shape[2], q.shape[2],
            key.shape[1], scale, result.data_ptr())
        if status != 0:
            raise MemoryError(f"decode attention kernel failed (status {status})")
        if not direct:
            rows = torch.from_numpy(d.token_rows)
            out.index_copy_(0, rows, result.index_select(0, rows).to(out.dtype))
