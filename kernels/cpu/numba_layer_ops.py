"""The compiled kernels of `cpu_fused.py` (its docstring says what they compute), in their own
module so that numba is imported only by a process that runs them: where `layer_ops.c` builds,
a float32 model never calls them, and `import numba` plus loading cached kernels cost a worker
about a second at start-up (measured on this project's 2-vCPU VM). `cpu_fused.kernels()`
imports this module on first use."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(fastmath=True, cache=True, nogil=True)
def rms_norm_kernel(x, weight, eps, out):  # pragma: no cover - compiled
    rows, hidden = x.shape
    for i in range(rows):
        total = np.float32(0.0)
        for j in range(hidden):
            total += x[i, j] * x[i, j]
        # torch's rsqrt and 1 / sqrt agree to float32 rounding; the mean is sum / n
        scale = np.float32(1.0) / np.sqrt(total / np.float32(hidden) + eps)
        for j in range(hidden):
            out[i, j] = weight[j] * (x[i, j] * scale)


@njit(cache=True, nogil=True)
def rotate_kernel(qk, cos, sin, q, k):  # pragma: no cover - compiled
    tokens, heads, head_dim = qk.shape
    num_heads = q.shape[1]
    half = head_dim // 2
    for t in range(tokens):
        for h in range(heads):
            dst = q[t, h] if h < num_heads else k[t, h - num_heads]
            for j in range(half):
                x1, x2 = qk[t, h, j], qk[t, h, j + half]
                c, s = cos[t, j], sin[t, j]
                dst[j] = x1 * c - x2 * s
                dst[j + half] = x2 * c + x1 * s
