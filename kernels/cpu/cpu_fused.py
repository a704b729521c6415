"""Decoder-layer glue compiled with numba for the CPU: RMSNorm and rotary embedding, each one
call instead of a chain of torch ops.

Measured on this project's 2-vCPU AMD EPYC VM (AVX2), SmolLM2-135M, one decode step at batch
64: the 61 RMSNorms took 15 ms as torch ops (to, pow, mean, add, rsqrt, mul, to, mul: eight
dispatches and five temporaries each) and the 30 rotations 7.5 ms plus a copy of q; both are
a few microseconds of arithmetic on a few hundred KB. One compiled loop per call runs on the
calling thread (a `prange` fork/join would cost more than the work at decode sizes).

* `rms_norm(x, weight, eps)`: float32 only. The sum of squares is a float32 SIMD sum in
  another order than torch's `mean`, so results differ from transformers' by float32
  rounding (relative 1e-7); the seam keeps torch's ops for other dtypes, so float64 runs
  stay bit-identical to transformers.
* `rotate_split(qk, cos, sin, num_heads)`: the neox rotation of q and k heads that sit side
  by side, written into a new contiguous q and k. Compiled *without* fastmath, so no
  multiply-add is contracted into an FMA: each half is two rounded products and one rounded
  sum or difference, as in transformers' `x * cos + rotate_half(x) * sin`: bit-identical
  (tested) for float32 and float64.

The kernels live in `numba_layer_ops.py`, imported on first use (`kernels()`). Compiled on
first use per dtype and cached on disk next to that file (`cache=True`); `warm_up` does it at
start-up where numba takes calls (`ops.CpuOps.warm_up`). Where a C compiler is at hand, float32 calls go to the same
arithmetic in C instead (`layer_ops.c`, through ctypes: numba's dispatch cost ~10 us a call,
the whole of a decode step's RMSNorm of a few rows); numba keeps float64 and machines
without a compiler. Which one a call takes, and whether torch's own ops take it instead, the
CPU op seam decides (`ops.CpuOps.rms_norm`, `rotate_split`): these functions only compute.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch

from . import native



SOURCE = Path(__file__).with_name("layer_ops.c")


def _declare(library: ctypes.CDLL) -> None:
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    library.tidal_rms_norm.argtypes = [p, n, i, p, ctypes.c_float, p]
    library.tidal_rms_norm.restype = None
    library.tidal_rotate_split.argtypes = [p, n, i, i, n, n, p, p, n, i, p, p]
    library.tidal_rotate_split.restype = None


def c_build() -> native.Build:
    """`layer_ops.c` built and loaded (once), or why not (no C compiler)."""
    return native.build(SOURCE, "tidal_layer_ops_available", _declare)


def c_library() -> ctypes.CDLL | None:
    """`layer_ops.c`'s library, or None without a C compiler."""
    return c_build().library


def available() -> bool:
    """Whether the numba kernels can run (numba installed), without importing numba."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def kernels():
    """The compiled kernels' module (`numba_layer_ops.py`), imported on first use."""
    from . import numba_layer_ops

    return numba_layer_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             library: ctypes.CDLL | None = None) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, last dim) + eps) for float32 `x` on the CPU, rows
    contiguous, and a float32 contiguous `weight`: through `library` (`c_library()`) where
    given, else numba's kernel."""
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    if library is not None:
        library.tidal_rms_norm(x.data_ptr(), x.numel() // hidden if hidden else 0, hidden,
                               weight.data_ptr(), eps, out.data_ptr())
        return out
    kernels().rms_norm_kernel(x.detach().view(-1, hidden).numpy(), weight.detach().numpy(),
                     np.float32(eps), out.view(-1, hidden).numpy())
    return out


def rotate_split(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 library: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate qk [tokens, num_heads + kv_heads, head_dim] (on the CPU, head_dim contiguous) by
    cos / sin [tokens, head_dim / 2] (qk's dtype) into contiguous q [tokens, num_heads,
    head_dim] and k [tokens, kv_heads, head_dim]: through `library` (`c_library()`, float32
    only) where given, else numba's kernel (float32 or float64)."""
    tokens, heads, head_dim = qk.shape
    q = torch.empty((tokens, num_heads, head_dim), dtype=qk.dtype)
    k = torch.empty((tokens, heads - num_heads, head_dim), dtype=qk.dtype)
    if library is not None and tokens:
        cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
        if cos.stride(1) == 1 and sin.stride() == cos.stride():
            library.tidal_rotate_split(qk.data_ptr(), tokens, heads, head_dim, qk.stride(0),
                                       qk.stride(1), cos.data_ptr(), sin.data_ptr(),
                                       cos.stride(0), num_heads, q.data_ptr(), k.data_ptr())
            return q, k
    kernels().rotate_kernel(qk.detach().numpy(), cos.detach().reshape(tokens, -1).numpy(),
                   sin.detach().reshape(tokens, -1).numpy(), q.numpy(), k.numpy())
    return q, k


def warm_up() -> None:
    """Compile (or load from the disk cache) the numba kernels for the dtypes they take."""
    if not available():
        return
    rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6)
    for dtype in (torch.float32, torch.float64):
        qk = torch.ones(1, 2, 4, dtype=dtype)
        rotate_split(qk, torch.ones(1, 2, dtype=dtype), torch.ones(1, 2, dtype=dtype), 1)
