"""The CPU op seam: the ops a model calls beside attention (the GEMM of a weight, RMSNorm, the
rotary rotation, the decoder layers in one call), as one `CpuOps` chosen once when a worker
loads (`select_cpu_ops`) from the machine and the `cpu_kernels` setting:

    auto      each C kernel that builds here (`native.py`: a C compiler and the instructions
              each kernel needs) and oneDNN and numba for the rest:
                gemm            the panel GEMM of small batches (`small_m_gemm.c`; float
                                panels with AVX-512, a de-quantized GGUF's 4/8-bit blocks up
                                to a few rows with AVX2), AMX for a GGUF's larger products
                                (`amx_gemm.c`), oneDNN's reordered weight for the batches they
                                do not take, `F.linear` above SMALL_BATCH_ROWS (`cpu_gemm.py`)
                rms_norm        `layer_ops.c` for float32 (numba without a compiler), else
                                torch's ops
                rotate_split    `layer_ops.c` for float32 (numba without a compiler), numba
                                for float64, else torch's ops
                decoder_layers  every layer of a step in one C call (`decoder_layers.c`,
                                `fused_layers.py`) for the steps it takes
    torch     torch's own ops only: `F.linear`, transformers' RMSNorm and rotation (the
              specification, for comparisons; what every model runs off the CPU)

`auto` may be followed by options, comma-separated: `no-amx`, `no-panels` (no C GEMM: oneDNN
takes every small batch, AMX and the one-call layers go with it), `no-fused` (the layers call
their kernels one by one), `march=CPU` (every C kernel, attention's too, built for gcc's
`-march=CPU` instead of this machine: `march=haswell` runs the AVX2 paths on an AVX-512 CPU).
`parse_cpu_kernels` is the one place the setting is read.

Where a kernel sits (row thresholds included) is the seam's business: a model hands its
weights and layers to `gemm` and `decoder_layers` at load and calls `rms_norm` and
`rotate_split` in its forward, and takes whatever they chose. `CpuOps.summary` is the
worker's start-up line: what was built, what was not and why, and what runs instead; a
library that did not build for want of a compiler makes it a WARNING.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..attention import cpu_attention
from . import amx_gemm, cpu_fused, fused_layers, native, small_m_gemm
from .cpu_gemm import SmallBatchGemm, small_batch_gemm_available

CPU_KERNELS = ("auto", "torch")
"""The choices of `cpu_kernels` (the engine config keeps the same tuples of strings,
`engine_core.config.CPU_KERNELS` and `CPU_KERNEL_OPTIONS`, without importing torch)."""
CPU_KERNEL_OPTIONS = ("no-amx", "no-panels", "no-fused", "march=")
"""What may follow `auto`, comma-separated (`march=` takes a CPU name)."""


@dataclass(frozen=True)
class KernelChoice:
    """`cpu_kernels`, parsed: which kernel families may be used where they build."""

    spec: str = "torch"
    """The setting as given."""
    kernels: bool = False
    """Anything beyond torch's ops (`auto`)."""
    panels: bool = False
    amx: bool = False
    fused: bool = False
    march: str = "native"


def parse_cpu_kernels(spec: str) -> KernelChoice:
    """`cpu_kernels` as a `KernelChoice`; ValueError naming the setting for anything else."""
    base, *options = spec.split(",")
    march = [o[len("march="):] for o in options if o.startswith("march=")]
    unknown = [o for o in options
               if o not in CPU_KERNEL_OPTIONS[:-1] and not (o.startswith("march=") and o[6:])]
    if base not in CPU_KERNELS or (base == "torch" and options) or unknown or len(march) > 1:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNELS}, auto optionally followed "
                         f"by comma-separated {', '.join(CPU_KERNEL_OPTIONS)}CPU; got {spec!r}")
    if base == "torch":
        return KernelChoice(spec)
    panels = "no-panels" not in options
    return KernelChoice(spec, True, panels, panels and "no-amx" not in options,
                        panels and "no-fused" not in options, (march or ["native"])[0])


@dataclass(frozen=True)
class Library:
    """One C library as this process found it, for the start-up line."""

    name: str
    """The source's stem (`small_m_gemm`)."""
    built: bool
    note: str = ""
    """What it takes where built (`AVX2: 4/8-bit blocks up to 8 rows`); where not, what runs
    instead."""
    why_not: str = ""
    """Where not built: why (no compiler, a failed build, what this CPU lacks)."""
    no_compiler: bool = False
    """Not built for want of a compiler (or a failed build): a WARNING."""
    off: bool = False
    """Not built because `cpu_kernels` leaves it out."""


@dataclass(frozen=True)
class CpuOps:
    """The CPU ops a model calls, chosen once (`select_cpu_ops`); `TORCH_OPS` are torch's own,
    on any device. A worker hands the same object to every layer."""

    choice: KernelChoice = KernelChoice()
    layer_ops: ctypes.CDLL | None = None
    """`layer_ops.c` (RMSNorm and rotation in C), where chosen and built."""
    numba: bool = False
    """Whether numba's RMSNorm and rotation take what C does not (`cpu_fused.py`)."""
    onednn: bool = False
    """Whether weights get a small-batch GEMM (`cpu_gemm.SmallBatchGemm`; oneDNN built)."""
    panels: bool = False
    """Whether that GEMM may use the panel kernel (built here and chosen)."""
    amx: bool = False
    fused: bool = False
    """Whether `decoder_layers` may fuse (its library and its kernels' built and chosen)."""
    libraries: tuple[Library, ...] = field(default=())

    # -- the ops -----------------------------------------------------------------------------

    def gemm(self, weight: torch.Tensor) -> SmallBatchGemm | None:
        """The small-batch GEMM of this [out, in] weight, or None where `F.linear` keeps it
        (torch's ops, a dtype other than float32, off the CPU)."""
        if not self.onednn or not small_batch_gemm_available(weight):
            return None
        return SmallBatchGemm(weight, panels=self.panels, amx=self.amx)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm as transformers computes it (statistics in float32, the scale in x's
        dtype): float32 CPU rows in one C (or numba) call, equal to float32 rounding;
        anything else through torch's ops, bit for bit."""
        if (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 1
                and x.is_contiguous() and weight.dtype == torch.float32
                and weight.is_contiguous()):
            if self.layer_ops is not None:
                return cpu_fused.rms_norm(x, weight, eps, self.layer_ops)
            if self.numba:
                return cpu_fused.rms_norm(x, weight, eps)
        return torch_rms_norm(x, weight, eps)

    def rotate_split(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [tokens, num_heads + kv_heads, head_dim] (q heads then k heads, any strides) ->
        rotated contiguous q [tokens, num_heads, head_dim] and k, by cos / sin [tokens, 1,
        head_dim / 2]: one C call for float32 on the CPU, numba's for float64, torch's six
        ops otherwise; the same arithmetic, bit-identical (`rotate`)."""
        if (qk.device.type == "cpu" and qk.dim() == 3 and qk.stride(-1) == 1
                and cos.dtype == qk.dtype):
            if self.layer_ops is not None and qk.dtype == torch.float32:
                return cpu_fused.rotate_split(qk, cos, sin, num_heads, self.layer_ops)
            if self.numba and qk.dtype in (torch.float32, torch.float64):
                return cpu_fused.rotate_split(qk, cos, sin, num_heads)
        rotated = rotate(qk, cos, sin)
        return rotated[:, :num_heads].contiguous(), rotated[:, num_heads:]

    def decoder_layers(self, layers: list[fused_layers.DecoderLayerParts] | None,
                       shape: fused_layers.LayerShape) -> fused_layers.DecoderLayers | None:
        """Every decoder layer of a step in one C call, for the steps of the sizes where each
        layer's projections take the panel kernel (`fused_layers.fuse`); None where the
        fused call is not chosen or built, or a layer has no parts (None in `layers`)."""
        if not self.fused or not layers or None in layers:
            return None
        return fused_layers.fuse(layers, shape)

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile (or load from numba's disk cache) the numba kernels a model of `dtype`
        calls under this choice: none where `layer_ops.c` takes float32 (numba is then not
        even imported: about a second of a worker's start-up)."""
        if self.numba and (self.layer_ops is None or dtype != torch.float32):
            cpu_fused.warm_up()

    # -- the start-up line -------------------------------------------------------------------

    @property
    def no_compiler(self) -> bool:
        """Whether some library did not build for want of a compiler: the line is a WARNING."""
        return any(lib.no_compiler for lib in self.libraries)

    def summary(self) -> str:
        """One line: the choice, the C libraries built and not (why, and what runs instead)."""
        c = self.choice
        if not c.kernels:
            return (f"CPU ops (cpu_kernels={c.spec}): torch's own (F.linear, RMSNorm and "
                    "rotary as transformers computes them); no C kernel, oneDNN copy or numba")
        built = [lib.name + (f" ({lib.note})" if lib.note else "")
                 for lib in self.libraries if lib.built]
        target = f", built for -march={c.march}" if c.march != "native" else ""
        line = f"CPU ops (cpu_kernels={c.spec}{target}): C built: {', '.join(built) or 'none'}"
        missing = [lib for lib in self.libraries if not lib.built and not lib.off]
        for why in dict.fromkeys(lib.why_not for lib in missing):  # grouped, in order
            line += f"; not built ({why}): " + "; ".join(
                f"{lib.name} ({lib.note})" for lib in missing if lib.why_not == why)
        off = [f"{lib.name} ({lib.note})" for lib in self.libraries if lib.off]
        if off:
            line += f"; left out: {'; '.join(off)}"
        return line


TORCH_OPS = CpuOps()
"""torch's own ops: every model's until a worker on the CPU hands it its `select_cpu_ops`."""


def select_cpu_ops(spec: str) -> CpuOps:
    """The ops for `cpu_kernels=spec` on this machine: every library the choice may use built
    (or found in the cache) and loaded now, so that nothing is decided in a step."""
    c = parse_cpu_kernels(spec)
    if not c.kernels:
        return CpuOps(c)
    native.march = c.march  # before any library of this process is loaded
    numba = cpu_fused.available()
    onednn = (torch.backends.mkldnn.is_available()
              and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    found = _Libraries("oneDNN" if onednn else "F.linear")
    layer_ops = found.add("layer_ops", cpu_fused.c_build, True, "RMSNorm and rotary take "
                          + ("numba, ~10 us a call more" if numba else "torch's ops"))
    panels = found.add("small_m_gemm", small_m_gemm.build, c.panels, found.panels_instead())
    amx = found.add("amx_gemm", amx_gemm.build, c.amx, found.amx_instead(panels))
    attention = found.add("decode_attention", cpu_attention.build, True,
                          "attention_backend=auto takes numba's kernels")
    fused = found.add("decoder_layers", fused_layers.build, c.fused,
                      "the layers call their kernels one by one")
    return CpuOps(c, cpu_fused.c_library() if layer_ops else None, numba, onednn, panels,
                  amx and panels, fused and panels and attention and layer_ops,
                  tuple(found.libraries))


class _Libraries:
    """The libraries `select_cpu_ops` found, each with what it takes or what runs instead."""

    CPU_LACKS = {
        "small_m_gemm": "neither AVX-512 nor AVX2 with FMA and F16C on this CPU",
        "amx_gemm": "no AMX on this CPU, or Linux refuses it the tiles",
        "decode_attention": "neither AVX-512 nor AVX2 with FMA on this CPU",
    }

    def __init__(self, gemm_fallback: str):
        self.gemm_fallback = gemm_fallback
        self.libraries: list[Library] = []

    def add(self, name: str, build: Callable[[], native.Build], chosen: bool,
            instead: str) -> bool:
        """Record library `name` (`build` makes it, called only where `chosen`; `instead`:
        what runs where there is none); whether it is loaded and chosen."""
        if not chosen:
            self.libraries.append(Library(name, False, instead, off=True))
            return False
        built = build()
        if built.library is not None:
            self.libraries.append(Library(name, True, self._takes(name)))
            return True
        why = built.why_not if built.no_compiler else self.CPU_LACKS.get(name, built.why_not)
        self.libraries.append(Library(name, False, instead, why, built.no_compiler))
        return False

    def _takes(self, name: str) -> str:
        if name != "small_m_gemm":
            return ""
        rows = small_m_gemm.block_rows()
        if small_m_gemm.float_panels():
            return f"AVX-512: float panels, a GGUF's 4/8-bit blocks up to {rows} rows"
        return (f"AVX2: a GGUF's 4/8-bit blocks up to {rows} rows, float panels up to "
                f"{small_m_gemm.AVX2_PANEL_ROWS}, {self.gemm_fallback} above")

    def panels_instead(self) -> str:
        return (f"small batches take {self.gemm_fallback}, a GGUF's weights read as float32 "
                "at 4-8x the bytes of its blocks")

    def amx_instead(self, panels: bool) -> str:
        if not panels:
            return f"a GGUF's larger products take {self.gemm_fallback}"
        rest = "float panels" if small_m_gemm.float_panels() else self.gemm_fallback
        return f"a GGUF's products above {small_m_gemm.block_rows()} rows take {rest}"


def log_cpu_ops(ops: CpuOps, logger: logging.Logger, prefix: str = "",
                taken: str = "") -> None:
    """`ops.summary()` (then `taken`: what the model took of them) in one line: INFO, or a
    WARNING, which names the slower paths, where a library did not build for want of a
    compiler."""
    level = logging.WARNING if ops.no_compiler else logging.INFO
    logger.log(level, "%s%s%s", prefix, ops.summary(), f"; {taken}" if taken else "")


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: the statistics in float32, the scale applied in x's dtype (so
    float64 runs match transformers bit for bit)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The neox rotation (rotate_half) of x [tokens, heads, head_dim] (any strides) by cos /
    sin [tokens, 1, head_dim / 2], into a new contiguous tensor. transformers' `x * cos +
    rotate_half(x) * sin` term for term (each half: two rounded products, one rounded sum or
    difference, and a - b == a + (-b) exactly), so bit-identical to it."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=first)
    first.sub_(x2 * sin)
    torch.mul(x2, cos, out=second)
    second.add_(x1 * sin)
    return out

