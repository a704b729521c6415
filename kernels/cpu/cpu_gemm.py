"""float32 linear layers for small batches on the CPU: oneDNN's matmul on a weight reordered
once at load (torch's `mkldnn._reorder_linear_weight` / `mkldnn._linear_pointwise`, the path
vLLM's CPU backend and torch.compile's weight freezing take too).

Decode steps multiply a few rows by every weight, so they stream the weights from memory.
`F.linear` hands MKL the weight as stored, [out, in], on every call; oneDNN reads a copy laid
out for its kernel instead. Measured on this project's 2-core Xeon (AVX-512, 2 threads),
SmolLM2-135M's four projections in 30 layers, each weight read from memory (425 MB):

    rows       8          24         64
    F.linear   49.1 ms    58.2 ms    81.9 ms
    oneDNN     35.5 ms    49.7 ms    76.2 ms

On this project's 2-vCPU AMD EPYC VM (AVX2) the gap is wider and lasts to a few hundred
rows: the LM head of a 49k vocabulary ([49152, 576]) took 39.1 / 57.1 / 84.7 / 146.3 ms
with `F.linear` at 32 / 64 / 128 / 200 rows and 16.5 / 29.6 / 54.5 / 89.2 ms with oneDNN;
a whole SmolLM2 decode step at batch 128 went from 536 to 447 ms when 65-256 rows moved
to oneDNN. From 512 rows up (prefill chunks) the two were level here, and oneDNN was
slower on some shapes on the Xeon (a [512, 576] x [576, 960] product: 3.2 ms against
2.3 ms), so rows above `SMALL_BATCH_ROWS` (256: the default `max_num_seqs`, every
decode-only step) keep `F.linear` and the layer keeps both copies of its weight (twice the
weight memory, on the CPU only).
Except where MKL runs no AVX-512 code (`mkl_runs_avx512`: any CPU but Intel's): on a 2-vCPU
AMD EPYC with AVX-512 (Zen 4), `F.linear` took MKL's AVX2 kernel for Zen and oneDNN's copy
beat it on every prefill shape measured, 2048 rows x SmolLM2's and the 7M model's projections
(GFLOP/s, F.linear / oneDNN): 154 / 195 gate-up, 159 / 199 QKV, 161 / 201 down, 148 / 191
o_proj, 86 / 135 the 7M LM head; the 7M model's 2048-token prefill steps went from 128 to
103 ms (medians of 4 interleaved offline runs, 2026-12-03). There the copy takes the large
products too (`large_rows_on_onednn`), beside the panels on an AVX-512 build.
Results equal `F.linear`'s up to float32 rounding (a different summation order).

On a CPU with AVX-512 and a C compiler, the panel kernel of `small_m_gemm.py` takes these
batches instead of oneDNN (16-31% faster at 8-64 rows on the Xeon: it prefetches the weight
stream that oneDNN's kernel waits on); with AVX2 it takes a de-quantized GGUF weight's 4/8-bit
blocks and other float weights' panels at up to 8 rows (`small_m_gemm.AVX2_PANEL_ROWS`);
oneDNN stays the path everywhere else.

`add` and `mul` fold the elementwise op that follows a projection in a decoder layer (the
residual add after o_proj and down_proj, `silu(gate) * up` in the MLP) into the GEMM as a
oneDNN binary post-op: the product is combined with `other` in the kernel's own output pass
instead of a second torch op that allocates, forks the OpenMP pool once more and reads both
tensors back. The post-op is applied to the finished float32 product, so `add`/`mul` equal
`self(x) + other` / `self(x) * other` bit for bit (checked in tests/kernels/test_cpu_gemm.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import native
from .small_m_gemm import PanelGemm, panel_gemm_applies

SMALL_BATCH_ROWS = 256
"""Most rows that take the reordered-weight path."""

REORDER_ROWS = 64
"""The row count oneDNN lays the weight out for (its reorder takes a batch-size hint); one
layout serves every row count up to SMALL_BATCH_ROWS."""


@functools.cache
def mkl_runs_avx512() -> bool:
    """Whether `F.linear`'s float32 GEMM (MKL's sgemm) runs AVX-512 code here: on an Intel
    CPU with AVX-512 only, as MKL picks its kernels by vendor. On an AMD EPYC with AVX-512
    (Zen 4) perf shows its AVX2 kernel for Zen (`mkl_blas_def_sgemm_kernel_0_zen`), while
    oneDNN picks its code by the instruction set alone."""
    return (native.cpu_vendor() == "GenuineIntel"
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512"))


def small_batch_gemm_available(weight: torch.Tensor) -> bool:
    """Whether `SmallBatchGemm` can take this weight: 2-D float32 on the CPU, oneDNN built."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.numel() > 0
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class SmallBatchGemm:
    """`x @ weight.T` with a oneDNN copy of `weight` for inputs of at most SMALL_BATCH_ROWS
    rows; larger inputs go to `F.linear` on the original. Built by the CPU op seam
    (`ops.CpuOps.gemm`), which says whether the panel kernel and AMX may take part."""

    def __init__(self, weight: torch.Tensor, panels: bool = True, amx: bool = True):
        """`panels`: whether the panel kernel (`small_m_gemm.py`) takes the batches it serves
        where it is built here; `amx`: whether it may hand a GGUF's blocks to AMX."""
        if not small_batch_gemm_available(weight):
            raise ValueError(f"no oneDNN path for a {weight.dtype} {tuple(weight.shape)} "
                             f"weight on {weight.device}")
        self.weight = weight
        panels = PanelGemm(weight, amx=amx) if panels and panel_gemm_applies(weight) else None
        self.panels = panels if panels is not None and panels.max_rows > 0 else None
        """The panel kernel (`small_m_gemm.py`) where it builds here and takes this weight: it
        takes batches of up to `panel_rows` rows (every small batch with AVX-512: 16-31%
        faster than oneDNN at 8-64 rows, level at 128, 6% slower at 256)."""
        self.panel_rows = self.panels.max_rows if self.panels is not None else 0
        self.large_rows_on_onednn = (not mkl_runs_avx512() and not (
            self.panels is not None and self.panels.takes_any_rows))
        """Whether products above SMALL_BATCH_ROWS (prefill chunks) take oneDNN's copy too
        instead of `F.linear`: where MKL does not run its AVX-512 code (`mkl_runs_avx512`)."""
        self.uses_onednn = not (self.panel_rows >= SMALL_BATCH_ROWS
                                and not self.large_rows_on_onednn)
        """Whether some products take oneDNN's copy (`reordered`): the small batches the
        panels do not take and, where `large_rows_on_onednn`, the large ones."""
        self._reordered: torch.Tensor | None = None
        self._panel_rows_direct = self.panel_rows if (
            self.panels is not None and self.panels.takes_any_rows) else min(
            self.panel_rows, SMALL_BATCH_ROWS)
        """The most rows the panel kernel takes: up to `panel_rows` of a small batch, any
        number where it runs on AMX. A decode step's contiguous [rows, in] input goes
        straight there, without the general path's reshapes (~3 us a call, a few hundred
        calls a step)."""

    @property
    def reordered(self) -> torch.Tensor | None:
        """oneDNN's copy of the weight (None where no product takes it), made at its first
        use or by `prepare` (a worker calls that while idle, `Worker.idle_chore`), not at
        load: SmolLM2's 151 reorders took 0.37 s of its worker's start on the AVX2 EPYC,
        and with a GGUF's blocks no product of up to 8 rows (a first decode step) needs
        them."""
        if self._reordered is None and self.uses_onednn:
            self._reordered = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                      REORDER_ROWS)
        return self._reordered

    @property
    def prepared(self) -> bool:
        """Whether nothing is left to make before a product of any size (`prepare`)."""
        return self._reordered is not None or not self.uses_onednn

    def prepare(self) -> None:
        """Make oneDNN's copy now, where a product will need it."""
        _ = self.reordered

    def bytes_read(self, rows: int) -> int:
        """Bytes of weight a product of `rows` rows streams (the weight as that path stores
        it: 4- or 8-bit blocks, narrower panels or float32)."""
        if self._panels_take(rows):
            return self.panels.bytes_read(rows)
        return self.weight.nbytes

    @property
    def block_rows(self) -> int:
        """The most rows whose products read the weight's 4/8-bit blocks (0: none do)."""
        return self.panels.block_rows if self.panels is not None else 0

    def kernel_weights(self, rows: int) -> tuple[torch.Tensor, int] | None:
        """(weights, their panel-kernel type number) that a product of `rows` contiguous rows
        reads where the panel kernel takes it (`PanelGemm.kernel_weights`): the same for
        every row count on one side of `block_rows`; else None."""
        if self.panels is None or not self._panels_take(rows):
            return None
        return self.panels.kernel_weights(rows)

    def _panels_take(self, rows: int) -> bool:
        """Whether the panel kernel takes a product of `rows` rows."""
        return 0 < rows <= self._panel_rows_direct

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= self._panel_rows_direct and x.is_contiguous():
            return self.panels(x)
        rows = _rows(x)
        path = self._path(rows)
        if path == "linear":
            return F.linear(x, self.weight)
        x2 = x.reshape(rows, x.shape[-1]).contiguous()
        if path == "panels":
            y = self.panels(x2)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.reordered, None, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T + other` (other: the output's shape), the add fused into the GEMM."""
        return self._binary(x, other, "add")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T * other` (other: the output's shape), the product fused into the GEMM."""
        return self._binary(x, other, "mul")

    def _binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        if (x.dim() == 2 and 0 < x.shape[0] <= self._panel_rows_direct and x.is_contiguous()
                and other.shape == (x.shape[0], self.panels.out_features)
                and other.is_contiguous()):
            return self.panels(x, other, op)
        rows = _rows(x)
        path = self._path(rows)
        if path == "linear":
            y = F.linear(x, self.weight)
            return y + other if op == "add" else y * other
        x2 = x.reshape(rows, x.shape[-1]).contiguous()
        other2 = other.reshape(rows, other.shape[-1]).contiguous()
        if path == "panels":
            y = self.panels(x2, other2, op)
        else:
            y = torch.ops.mkldnn._linear_pointwise.binary(x2, other2, self.reordered, None, op)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _path(self, rows: int) -> str:
        """Which kernel takes a product of `rows` rows: "panels", "onednn" (the reordered
        copy: small batches the panels do not take, and every larger one where
        `large_rows_on_onednn`), else "linear" (`F.linear` on the original)."""
        if self._panels_take(rows):
            return "panels"
        if self.uses_onednn and 0 < rows and (
                rows <= SMALL_BATCH_ROWS or self.large_rows_on_onednn):
            return "onednn"
        return "linear"


def _rows(x: torch.Tensor) -> int:
    """Rows of `x` seen as a matrix of its last dimension (0 when that dimension is empty)."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0
