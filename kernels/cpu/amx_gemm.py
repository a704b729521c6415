"""The AMX GEMM of `amx_gemm.c`: float32 linear layers of a de-quantized GGUF model (every
weight exactly d q + m or d q over its run of 32 inputs, `small_m_gemm.q4_blocks` /
`q8_blocks`) on Intel CPUs with AMX-BF16, for the batches above the panel kernel's block
rows: prefill chunks and large decode batches.

The input is split into three bfloat16 parts that sum to it exactly and the weights' q are
small integers, so the tile products are exact and only the float32 additions round, in
another order than F.linear's (the error against a float64 product is below F.linear's on
the shapes tested). Measured on this project's 2-vCPU Xeon (Sapphire Rapids, two threads),
SmolLM2-135M's four layer shapes, one layer's weights in cache
(benchmarks/archive/BENCHMARKS.md, "AMX for a GGUF's weights"):

    rows        32        64        128       256       512
    panels      0.81 ms   1.28 ms   2.28 ms   4.83 ms   10.21 ms
    F.linear    1.07 ms   1.61 ms   2.65 ms   5.16 ms    9.20 ms
    AMX         0.48 ms   0.79 ms   1.44 ms   2.81 ms    6.16 ms

Built by `native.build_and_load` like the other kernels; `load()` is None on a CPU without
AMX (every AMD CPU, Intel before Sapphire Rapids), where the kernel's build has no tiles, where
Linux refuses this process the tile registers; `cpu_kernels=auto,no-amx` leaves it out
(`ops.py`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).with_name("amx_gemm.c")

_OPS = {None: 0, "add": 1, "mul": 2}
"""The post-op argument of both C GEMMs (this one and small_m_gemm.c): nothing, or `other`
added to / multiplied with the finished product."""
_Q4, _Q8 = 3, 4  # the block kinds, the same numbers in both C sources


def build() -> native.Build:
    """The compiled kernel, or why AMX cannot run here."""
    return native.build(SOURCE, "tidal_amx_available", _declare)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where AMX cannot run here."""
    return build().library


def _declare(library: ctypes.CDLL) -> None:
    library.tidal_amx_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long,
                                       ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p]
    library.tidal_amx_pack.restype = ctypes.c_int
    library.tidal_amx_gemm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int]
    library.tidal_amx_gemm.restype = ctypes.c_int


class AmxBlockGemm:
    """`x @ weight.T` (and with a fused add or mul) for a weight given as small_m_gemm's 4- or
    8-bit blocks, any number of rows; results float32. Build with `from_blocks`."""

    def __init__(self, tiles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 out_features: int, in_features: int):
        self.tiles, self.scales, self.offsets = tiles, scales, offsets
        """B tiles of q: [N / 16][K / 32][256] bytes of 4-bit q (widened to bfloat16 in the
        kernel), or [N / 16][K / 32][16][32] bfloat16 (int16 storage) of 8-bit q; d
        [N / 16][K / 32][16] float32, and m as bfloat16 tiles
        [N / 16][groups of 32 runs][2][16][32] (None for 8-bit blocks: no m)."""
        self.out_features, self.in_features = out_features, in_features
        self._kernel = load().tidal_amx_gemm

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, kind: int, out_features: int,
                    in_features: int) -> AmxBlockGemm | None:
        """The kernel's copy of `blocks` (`small_m_gemm`'s [N / 32][K / 32][bytes], `kind`
        3: 4-bit, 4: 8-bit), or None where AMX is not here or some d q + m is not exact in
        float32 (then the products would not be of the layer's weights)."""
        library = load()
        if library is None or kind not in (_Q4, _Q8):
            return None
        n, k = out_features, in_features
        tiles = (torch.empty(n // 16, k // 32, 256, dtype=torch.uint8) if kind == _Q4 else
                 torch.empty(n // 16, k // 32, 16, 32, dtype=torch.int16))
        scales = torch.empty(n // 16, k // 32, 16, dtype=torch.float32)
        offsets = (torch.empty(n // 16, (k // 32 + 31) // 32, 2, 16, 32, dtype=torch.int16)
                   if kind == _Q4 else None)
        exact = library.tidal_amx_pack(blocks.data_ptr(), kind, n, k, tiles.data_ptr(),
                                       scales.data_ptr(),
                                       offsets.data_ptr() if offsets is not None else None)
        return cls(tiles, scales, offsets, n, k) if exact else None

    def bytes_read(self) -> int:
        """Bytes of weight one product streams: the tiles, d and m."""
        return self.tiles.nbytes + self.scales.nbytes + (
            self.offsets.nbytes if self.offsets is not None else 0)

    def __call__(self, x2: torch.Tensor, other: torch.Tensor | None = None,
                 op: str | None = None) -> torch.Tensor:
        """x2 [rows, in] contiguous float32 -> [rows, out]; `op` "add"/"mul" with `other`
        [rows, out] contiguous applies it to the finished product."""
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows == 0:
            return y
        status = self._kernel(x2.data_ptr(), rows, self.in_features, self.tiles.data_ptr(),
                              self.scales.data_ptr(),
                              self.offsets.data_ptr() if self.offsets is not None else None,
                              self.out_features, y.data_ptr(),
                              other.data_ptr() if other is not None else None, _OPS[op])
        if status != 0:
            raise MemoryError(f"AMX GEMM could not allocate its scratch for {rows} rows")
        return y
