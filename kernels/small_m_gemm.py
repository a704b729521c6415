"""The panel GEMM of `small_m_gemm.c`: float32 linear layers for decode batches on AVX-512
CPUs, where it beats oneDNN (`cpu_gemm.py`) by streaming the weights with prefetches.

Measured on this project's 2-core Xeon VM (AVX-512, two threads), SmolLM2-135M's four layer
shapes in 30 layers, each weight streamed from memory (BENCHMARKS.md, "On the Xeon again"):

    rows     8        16       32       64       128      256
    oneDNN   25.1 ms  31.7 ms  41-44 ms 67.3 ms  97.9 ms  167.7 ms
    panels   20.7 ms  25.3 ms  33.6 ms  58.1 ms  94.6 ms  178.0 ms

so `SmallBatchGemm` gives it every small batch. A weight that bfloat16 (or float16) holds
exactly, as a checkpoint saved in that type and widened to float32 at load, is stored in it,
and the kernel widens it back in registers: the same float32 products from half the bytes
(2026-12-02, same loop, bfloat16 against float32 panels: 1 row 6.6 / 14.6 ms, 8 rows 8.4 /
17.8, 32 rows 20.9 / 26.4, 128 and 256 rows level).

The C source is built by `native.build_and_load` (the machine's C compiler, cached on disk);
a machine without a compiler, or a CPU without AVX-512 (the kernel's registers are 16-float
vectors), keeps oneDNN: `load()` returns None.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from tidal.kernels import native

PANEL_ROWS = 128
"""Most rows that take the panel kernel (above, oneDNN's kernel is level or faster)."""
SOURCE = Path(__file__).with_name("small_m_gemm.c")

_OPS = {None: 0, "add": 1, "mul": 2}
_WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_Q4, _Q8 = 3, 4  # the kernel's weight types for 4-bit and 8-bit blocks
BLOCK_ROWS = 48
"""Most rows that take a weight's 4- or 8-bit blocks where it has them; more rows take its
float panels. Widening the blocks costs arithmetic that pays while the weight stream is the
bound (SmolLM2's layers, 2 threads: 5.6 against 16.3 ms at 1 row, 25.8 / 30.0 at 32, 36.6 /
39.1 at 48, level at 64)."""
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
    if os.environ.get("TIDAL_NO_PANEL_GEMM"):
        return None
    library = native.build_and_load(SOURCE, "tidal_panel_gemm_available")
    if library is None:
        return None
    library.tidal_panel_gemm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_int, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    library.tidal_panel_gemm.restype = None
    return library


def panel_gemm_applies(weight: torch.Tensor) -> bool:
    """Whether `PanelGemm` can take this [N, K] weight: float32 on the CPU, N a multiple of
    32, and the kernel loads on this machine."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.shape[0] % 32 == 0 and weight.shape[1] > 0
            and load() is not None)


def exact_storage_dtype(weight: torch.Tensor) -> torch.dtype:
    """The narrowest type that holds every value of this float32 weight exactly: bfloat16 for
    a checkpoint saved in bfloat16 (SmolLM2's, most recent models'), float16 for one saved in
    float16, else float32. The kernel widens the stored weights to float32 in registers, so
    the products are the float32 products of the same values, at half the bytes streamed."""
    for dtype in (torch.bfloat16, torch.float16):
        if torch.equal(weight.to(dtype).to(torch.float32), weight):
            return dtype
    return torch.float32


def q4_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as 4-bit blocks for the kernel (`small_m_gemm.c`, wtype 3), or None unless
    every value is exactly fl(fl(d q) + m) over its run of 32 k, q in 0..15 and d, m float16
    values: what a GGUF Q4_1 tensor becomes when de-quantized to float32 (transformers' GGUF
    loading; the SmolLM2 of this project's benchmarks). The quantizer set m to the block's
    minimum (its q is 0) and d to (max - min) / 15 rounded to float16, so d is looked for
    among the float16 values next to that. The check recomputes every weight from its parts
    in float32, as the kernel does: a weight it accepts is stored without loss."""
    found = _blocks(weight, lambda blocks: blocks.amin(-1, keepdim=True),
                    lambda blocks, low: (blocks.amax(-1, keepdim=True) - low) / 15, 0, 15)
    if found is None:
        return None
    q, scale, low = found
    n, k = weight.shape
    q = q.to(torch.uint8).reshape(n // 32, 2, 16, k // 32, 32)  # [pair, half, j, block, k]
    nibbles = (q[:, 0] | (q[:, 1] << 4)).permute(0, 2, 3, 1)  # [pair, block, k, j]
    return _pack_blocks(torch.stack((scale, low)), nibbles, n, k)


def q8_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as 8-bit blocks (wtype 4), or None unless every value is exactly fl(d q)
    over its run of 32 k, q in -128..127 and d a float16 value: a GGUF Q8_0 tensor
    de-quantized (the quantizer's d is max |w| / 127, rounded to float16)."""
    found = _blocks(weight, lambda blocks: None,
                    lambda blocks, _: blocks.abs().amax(-1, keepdim=True) / 127, -128, 127)
    if found is None:
        return None
    q, scale, _ = found
    n, k = weight.shape
    q = q.to(torch.int8).reshape(n // 32, 32, k // 32, 32).permute(0, 2, 3, 1)  # [pair, block, k, col]
    return _pack_blocks(scale[None], q.contiguous().view(torch.uint8), n, k)


def _blocks(weight, offset_of, scale_guess, q_min, q_max):
    """(q, d, m) with weight == fl(fl(d q) + m) exactly over every run of 32 k (m None: no
    offset, weight == fl(d q)), d and m float16 values; None where no such parts exist. q and
    the weight are [N, K / 32, 32], d and m [N, K / 32, 1].

    The guess for d is right for every block of the GGUF tensors tried; a block it misses
    tries the float16 values next to it, and a tensor where more than 1% of the blocks miss
    is not made of blocks (a few full passes over it: 0.3 s for SmolLM2's 28M-value
    embedding, 4 s when every block tried five values)."""
    n, k = weight.shape
    if n % 32 or k % 32:
        return None
    blocks = weight.detach().reshape(n, k // 32, 32)
    low = offset_of(blocks)
    if low is not None and not torch.equal(low.to(torch.float16).to(torch.float32), low):
        return None
    shifted = blocks if low is None else blocks - low

    def exact(d, shifted, blocks, low):
        q = torch.where(d > 0, shifted / d, 0.0).round_().clamp_(q_min, q_max)
        made = d * q if low is None else d * q + low
        return q, (made == blocks).all(-1)

    scale = scale_guess(blocks, low).to(torch.float16).to(torch.float32)
    q, hit = exact(scale, shifted, blocks, low)
    if hit.numel() - int(hit.sum()) > hit.numel() // 100:
        return None
    for row, block in (~hit).nonzero().tolist():  # the float16 values next to the guess
        one = (slice(row, row + 1), slice(block, block + 1))
        bits = scale[one].to(torch.float16).view(torch.int16)
        for step in (-1, 1, -2, 2):
            d = (bits + step).view(torch.float16).to(torch.float32)
            q_one, hit_one = exact(d, shifted[one], blocks[one], None if low is None else low[one])
            if hit_one.all():
                scale[one], q[one] = d, q_one
                break
        else:
            return None
    return q, scale, low


def _pack_blocks(parts: torch.Tensor, values: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[N / 32, K / 32, bytes]: per pair and run of 32 k, the float32 `parts` ([P, N, K / 32,
    1]: d, or d and m) of the pair's 32 columns, then its `values` bytes ([pair, block, ...])."""
    header = parts.reshape(len(parts), n // 32, 32, k // 32).permute(1, 3, 0, 2).contiguous()
    return torch.cat((header.view(torch.uint8).reshape(n // 32, k // 32, -1),
                      values.reshape(n // 32, k // 32, -1)), dim=-1).contiguous()


def pack_panels(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] -> [N / 16, K, 16] of `dtype`, contiguous: panel p holds output columns
    16p..16p+15. bfloat16 interleaves each pair of panels instead, [N / 32, K, 16, 2]: pair
    q's row k holds column 32q + j at [q, k, j, 0] and 32q + 16 + j at [q, k, j, 1] (the kernel
    widens both halves of one 64-byte load)."""
    n, k = weight.shape
    w = weight.detach()
    if dtype == torch.bfloat16:
        return w.reshape(n // 32, 2, 16, k).permute(0, 3, 2, 1).to(dtype).contiguous()
    return w.reshape(n // 16, 16, k).transpose(1, 2).to(dtype).contiguous()


class PanelGemm:
    """`x @ weight.T` (and with a fused add or mul) through the panel kernel, for inputs of
    1..PANEL_ROWS rows (the caller routes the rest elsewhere). The panels are stored in
    `exact_storage_dtype(weight)`: results are float32 either way."""

    def __init__(self, weight: torch.Tensor, storage: torch.dtype | None = None):
        """`storage`: the panels' type (default `exact_storage_dtype(weight)`)."""
        if not panel_gemm_applies(weight):
            raise ValueError(f"no panel GEMM for a {weight.dtype} {tuple(weight.shape)} weight "
                             f"on {weight.device} here")
        if storage is not None and storage not in _WEIGHT_TYPES:
            raise ValueError(f"storage must be one of {sorted(map(str, _WEIGHT_TYPES))}, "
                             f"got {storage}")
        self.out_features, self.in_features = weight.shape
        self.panels = pack_panels(weight, storage or exact_storage_dtype(weight))
        self._weight_type = _WEIGHT_TYPES[self.panels.dtype]
        self.blocks, self._blocks_type = None, 0
        """The weight's 4- or 8-bit blocks where it is exactly made of them (`q4_blocks`,
        `q8_blocks`), for inputs of up to BLOCK_ROWS rows; None otherwise."""
        if storage is None:
            for find, kind in ((q4_blocks, _Q4), (q8_blocks, _Q8)):
                self.blocks = find(weight)
                if self.blocks is not None:
                    self._blocks_type = kind
                    break
        self._kernel = load().tidal_panel_gemm

    def bytes_read(self, rows: int) -> int:
        """Bytes of weight a product of `rows` rows streams: its blocks' or its panels'."""
        if self.blocks is not None and rows <= BLOCK_ROWS:
            return self.blocks.nbytes
        return self.panels.nbytes

    def __call__(self, x2: torch.Tensor, other: torch.Tensor | None = None,
                 op: str | None = None) -> torch.Tensor:
        """x2 [rows, in] contiguous float32 -> [rows, out]; `op` "add"/"mul" with `other`
        [rows, out] contiguous applies it to the finished product."""
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        weights, weight_type = (
            (self.blocks, self._blocks_type) if self.blocks is not None and rows <= BLOCK_ROWS
            else (self.panels, self._weight_type))
        self._kernel(x2.data_ptr(), rows, self.in_features, weights.data_ptr(),
                     weight_type, self.out_features, y.data_ptr(),
                     other.data_ptr() if other is not None else None, _OPS[op])
        return y
