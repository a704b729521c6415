"""The panel GEMM of `small_m_gemm.c`: float32 linear layers for decode batches on AVX-512
CPUs, where it beats oneDNN (`cpu_gemm.py`) by streaming the weights with prefetches, and on
AVX2 CPUs for a de-quantized GGUF's 4/8-bit blocks at a few rows.

Measured on this project's 2-core Xeon VM (AVX-512, two threads), SmolLM2-135M's four layer
shapes in 30 layers, each weight streamed from memory (benchmarks/archive/BENCHMARKS.md,
"On the Xeon again"):

    rows     8        16       32       64       128      256
    oneDNN   25.1 ms  31.7 ms  41-44 ms 67.3 ms  97.9 ms  167.7 ms
    panels   20.7 ms  25.3 ms  33.6 ms  58.1 ms  94.6 ms  178.0 ms

so `SmallBatchGemm` gives it every small batch. A weight that bfloat16 (or float16) holds
exactly, as a checkpoint saved in that type and widened to float32 at load, is stored in it,
and the kernel widens it back in registers: the same float32 products from half the bytes
(2026-12-02, same loop, bfloat16 against float32 panels: 1 row 6.6 / 14.6 ms, 8 rows 8.4 /
17.8, 32 rows 20.9 / 26.4, 128 and 256 rows level).

The C source is built by `native.build_and_load` (the machine's C compiler, cached on disk)
for AVX-512 or, failing that, AVX2 with FMA and F16C (the same arithmetic in 8-float vectors:
bit-identical results, tested); a machine without a compiler or without AVX2 keeps oneDNN:
`load()` returns None. With AVX2 only, the panels take a weight's blocks up to
AVX2_BLOCK_ROWS rows and float weights up to AVX2_PANEL_ROWS (`_reach`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import native
from .amx_gemm import _OPS, _Q4, _Q8, AmxBlockGemm

SOURCE = Path(__file__).with_name("small_m_gemm.c")

_WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# _Q4, _Q8: the kernel's weight types for 4-bit and 8-bit blocks (amx_gemm's numbers)
_BLOCK_BYTES = {_Q4: 768, _Q8: 1152}
"""Bytes of one run of 32 inputs over a pair's 32 columns (`small_m_gemm.c`'s
Q4_BLOCK_BYTES, Q8_BLOCK_BYTES)."""
BLOCK_ROWS = 48
"""With AVX-512, the most rows that take a weight's 4- or 8-bit blocks where it has them; more
rows take its float panels. Widening the blocks costs arithmetic that pays while the weight
stream is the bound (SmolLM2's layers, 2 threads: 5.6 against 16.3 ms at 1 row, 25.8 / 30.0 at
32, 36.6 / 39.1 at 48, level at 64). On a 2-vCPU Zen 4 EPYC, whose memory reads faster, the
crossing comes sooner (SmolLM2 decode steps through the fused layers, interleaved: blocks
15.7 / 24.5 / 34.9 ms at 4 / 8 / 12 requests against float panels' 24.6 / 37.9 / 43.7, level
at 16-24, 87.8 / 82.5 at 32): `AMD_BLOCK_ROWS` there."""
AMD_BLOCK_ROWS = 16
"""BLOCK_ROWS on an AMD CPU (measured on the Zen 4 EPYC VM: SmolLM2's offline run, tidal
alone, two interleaved pairs, decode steps 71.1 / 77.4 ms a step with 48 against 66.2 / 74.4
with 16, walls 32.7 / 35.9 against 32.3 / 34.3 s)."""
AMX_BLOCK_ROWS = 28
"""Where AMX is here (`amx_gemm.py`), the most rows that take the blocks through the panel
kernel; more take the AMX kernel (SmolLM2 decode step, Xeon: 50.5 / 52.8 ms at 24 rows with
the blocks / AMX, 63.9 / 60.7 at 32, 80.9 / 76.3 at 40, 122.8 ms on float panels / 102.2 at
64)."""
AVX2_BLOCK_ROWS = 8
"""With AVX2 only (16 ymm registers: row blocks of 2, not 12), the most rows that take the
blocks. The AVX2 build run on the Xeon, SmolLM2's layers: blocks 4.9 / 19.3 / 36.0 ms at 1 /
8 / 16 rows against oneDNN's 21.3 / 28.0 / 31.4 (oneDNN with AVX-512 there; on an AVX2 CPU it
runs at about half that rate, so 8 is the cautious bound until measured on one)."""
AVX2_PANEL_ROWS = 8
"""With AVX2 only, the most rows that take the float panels (bfloat16 where the weight is
exactly that, `exact_storage_dtype`); oneDNN takes larger small batches. Until 2026-12-04
AVX2 kept no float panels: measured on the Xeon against oneDNN's AVX-512 code (float32 panels
16.5 / 27.0 / 39.0 ms at 1 / 8 / 16 rows, oneDNN 21.3 / 28.0 / 31.4), they lost beyond a few
rows. Against oneDNN's AVX2 code (ONEDNN_MAX_CPU_ISA=AVX2 on the Zen 4 EPYC, the kernel built
-march=haswell, SmolLM2's shapes in 30 layers, one thread, least of 12 interleaved rounds,
load ~5, 2026-12-04): bfloat16 panels 22.5 / 21.0 / 32.6 / 37.8 / 36.1 ms at 1 / 2 / 3 / 5 / 8
rows, oneDNN 76.4 / 79.3 / 92.5 / 98.0 / 102.0; the real SmolLM2's float32 panels (its Q4_1
weights are not bfloat16-exact; `benchmarks/panel_gemm_ab.py --march haswell --storage
float32 --onednn`, load ~6) 17.9 / 24.8 / 24.1 / 44.1 least, 36.6 / 54.3 / 47.7 / 60.1
median at 1 / 3 / 5 / 8 rows, oneDNN 54.7 / 39.6 / 62.6 / 46.4 least, 60.6 / 71.9 / 80.0 /
86.6 median. 8 rows: a verification step's (1 request and 4 drafts: 5) and 2-4 requests'
with drafts. Not yet measured on an AVX2 CPU."""

def build() -> native.Build:
    """The compiled kernel (built the first time on this machine), or why it cannot run here."""
    return native.build(SOURCE, "tidal_panel_gemm_available", _declare)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot run here."""
    return build().library


def _declare(library: ctypes.CDLL) -> None:
    library.tidal_panel_gemm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_int, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    library.tidal_panel_gemm.restype = None
    library.tidal_find_blocks.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                          ctypes.c_int, ctypes.c_void_p]
    library.tidal_find_blocks.restype = ctypes.c_int
    library.tidal_panel_gemm_vector_floats.restype = ctypes.c_int


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
    the products are the float32 products of the same values, at half the bytes streamed.

    Each type is tried on the weight's first `_EXACT_SAMPLE` values before all of them: a
    weight saved in float32 (or de-quantized from a GGUF file) fails there, and is spared two
    round trips and comparisons over every value (six passes; SmolLM2-135M's de-quantized
    weights took 0.08-0.19 s on one thread, 1-4 s on two threads beside busy neighbours,
    2-vCPU EPYC, 2026-12-04). The answer is the same: a value that is not exact in the sample
    is not exact in the whole."""
    flat = weight.reshape(-1)
    for dtype in (torch.bfloat16, torch.float16):
        if _holds_exactly(flat[:_EXACT_SAMPLE], dtype) and _holds_exactly(flat, dtype):
            return dtype
    return torch.float32


_EXACT_SAMPLE = 4096
"""Values of a weight `exact_storage_dtype` checks before the whole weight."""


def _holds_exactly(values: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.equal(values.to(dtype).to(torch.float32), values)


def q4_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as 4-bit blocks for the kernel (`small_m_gemm.c`, wtype 3), or None unless
    every value is exactly fl(fl(d q) + m) over its run of 32 k, q in 0..15 and d, m float16
    values: what a GGUF Q4_1 tensor becomes when de-quantized to float32 (transformers' GGUF
    loading; the SmolLM2 of this project's benchmarks). The check (`tidal_find_blocks`)
    rebuilds every weight from its parts as the kernel does, so a weight it accepts is stored
    without loss; one pass over the weight (SmolLM2-135M's de-quantized weights: 0.21-0.24 s
    on one thread of the 2-vCPU EPYC, 0.48-0.63 s before the check went to vectors with
    prefetches, 2026-12-04)."""
    return _find_blocks(weight, _Q4)


def q8_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as 8-bit blocks (wtype 4), or None unless every value is exactly fl(d q)
    over its run of 32 k, q in -128..127 and d a float16 value: a GGUF Q8_0 tensor
    de-quantized."""
    return _find_blocks(weight, _Q8)


def _find_blocks(weight: torch.Tensor, kind: int) -> torch.Tensor | None:
    n, k = weight.shape
    library = load()
    if library is None or n % 32 or k % 32 or weight.dtype != torch.float32:
        return None
    w = weight.detach().contiguous()
    out = torch.empty(n // 32, k // 32, _BLOCK_BYTES[kind], dtype=torch.uint8)
    found = library.tidal_find_blocks(w.data_ptr(), n, k, kind, out.data_ptr())
    return out if found else None


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


def float_panels() -> bool:
    """Whether this machine's build takes every small batch on float panels: AVX-512
    (16-float vectors); an AVX2 build takes a GGUF's 4/8-bit blocks and float panels up to a
    few rows (`_reach`)."""
    return load().tidal_panel_gemm_vector_floats() >= 16


def block_rows() -> int:
    """The most rows whose products read a weight's 4/8-bit blocks with this machine's build
    (where AMX is not): BLOCK_ROWS with AVX-512 (AMD_BLOCK_ROWS on an AMD CPU),
    AVX2_BLOCK_ROWS with AVX2."""
    if not float_panels():
        return AVX2_BLOCK_ROWS
    return AMD_BLOCK_ROWS if native.cpu_vendor() == "AuthenticAMD" else BLOCK_ROWS


def _reach() -> tuple[int, int]:
    """(most rows the blocks take, most rows the float panels take) with this machine's build:
    AVX-512 (`block_rows()`, any), AVX2 (AVX2_BLOCK_ROWS, AVX2_PANEL_ROWS)."""
    return block_rows(), (1 << 62 if float_panels() else AVX2_PANEL_ROWS)


class PanelGemm:
    """`x @ weight.T` (and with a fused add or mul) through the panel kernel, for inputs of
    1..`max_rows` rows (the caller routes the rest elsewhere): the weight's 4- or 8-bit blocks
    where it has them, up to a row count, then on a CPU with AMX the same blocks through
    `amx_gemm.py` for any number of rows, else float panels in `exact_storage_dtype(weight)`;
    results are float32 either way."""

    def __init__(self, weight: torch.Tensor, storage: torch.dtype | None = None,
                 amx: bool = True):
        """`storage`: the panels' type (default `exact_storage_dtype(weight)`); `amx`: whether
        the blocks may take the AMX kernel where it is here."""
        if not panel_gemm_applies(weight):
            raise ValueError(f"no panel GEMM for a {weight.dtype} {tuple(weight.shape)} weight "
                             f"on {weight.device} here")
        if storage is not None and storage not in _WEIGHT_TYPES:
            raise ValueError(f"storage must be one of {sorted(map(str, _WEIGHT_TYPES))}, "
                             f"got {storage}")
        self.out_features, self.in_features = weight.shape
        self.blocks, self._blocks_type = None, 0
        """The weight's 4- or 8-bit blocks where it is exactly made of them (`q4_blocks`,
        `q8_blocks`); None otherwise, or when `storage` asks for float panels."""
        if storage is None:
            for find, kind in ((q4_blocks, _Q4), (q8_blocks, _Q8)):
                self.blocks = find(weight)
                if self.blocks is not None:
                    self._blocks_type = kind
                    break
        self.amx = (AmxBlockGemm.from_blocks(self.blocks, self._blocks_type, *weight.shape)
                    if self.blocks is not None and amx else None)
        """The blocks as the AMX kernel's tiles, where AMX is here: then it takes every product
        above the block rows (prefill chunks, large decode batches) and no float panels are
        kept."""
        block_rows, panel_rows = _reach()
        self._block_rows = block_rows if self.blocks is not None else 0
        if self.amx is not None:
            self._block_rows, panel_rows = min(block_rows, AMX_BLOCK_ROWS), 0
        if storage is not None:
            panel_rows = 1 << 62  # asked for: they take any rows
        keep_panels = panel_rows > self._block_rows
        self.panels = pack_panels(weight, storage or exact_storage_dtype(weight)) if keep_panels else None
        """Float panels (None where the blocks or AMX take every row count they would)."""
        self._weight_type = _WEIGHT_TYPES[self.panels.dtype] if keep_panels else 0
        self.max_rows = (1 << 62 if self.amx is not None else
                         max(self._block_rows, panel_rows if keep_panels else 0))
        """The most rows a call takes (0: none, the weight is no use to this build)."""
        self._kernel = load().tidal_panel_gemm

    @property
    def takes_any_rows(self) -> bool:
        """Whether this is the best path for a product of any size, prefill chunks included
        (AMX); else the caller keeps large inputs for its own."""
        return self.amx is not None

    def bytes_read(self, rows: int) -> int:
        """Bytes of weight a product of `rows` rows streams: its blocks', AMX tiles' or
        panels'."""
        if self._takes_amx(rows):
            return self.amx.bytes_read()
        return self._weights_for(rows)[0].nbytes

    @property
    def block_rows(self) -> int:
        """The most rows whose products read the 4/8-bit blocks (0: none do); products of
        more rows read the float panels (or AMX tiles)."""
        return self._block_rows if self.blocks is not None else 0

    def kernel_weights(self, rows: int) -> tuple[torch.Tensor, int] | None:
        """(weights, their kernel type number) that a product of `rows` rows reads in this
        kernel: the blocks or the float panels; None where AMX or nothing here takes it."""
        if rows <= 0 or rows > self.max_rows or self._takes_amx(rows):
            return None
        return self._weights_for(rows)

    def _takes_amx(self, rows: int) -> bool:
        return self.amx is not None and rows > self._block_rows

    def _weights_for(self, rows: int) -> tuple[torch.Tensor, int]:
        if self.blocks is not None and rows <= self._block_rows:
            return self.blocks, self._blocks_type
        if self.panels is None or rows > self.max_rows:
            raise ValueError(f"{rows} rows: this panel GEMM takes at most {self.max_rows}")
        return self.panels, self._weight_type

    def __call__(self, x2: torch.Tensor, other: torch.Tensor | None = None,
                 op: str | None = None) -> torch.Tensor:
        """x2 [rows, in] contiguous float32 -> [rows, out]; `op` "add"/"mul" with `other`
        [rows, out] contiguous applies it to the finished product."""
        rows = x2.shape[0]
        if self._takes_amx(rows):
            return self.amx(x2, other, op)
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        weights, weight_type = self._weights_for(rows)
        self._kernel(x2.data_ptr(), rows, self.in_features, weights.data_ptr(),
                     weight_type, self.out_features, y.data_ptr(),
                     other.data_ptr() if other is not None else None, _OPS[op])
        return y
