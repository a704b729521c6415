"""A Llama decoder's layers in one C call per step on the CPU (`decoder_layers.c`): the same
kernels the layers otherwise call one by one from Python (the panel GEMM, RMSNorm and rotary
rotation in C, the K/V write and the C attention's rows and chunks), in the same order, with
no Python between them.

Why: steps of a few tokens of a small model were mostly Python. The 7M-parameter Llama of the
benchmarks (hidden 256, 4 layers), a decode step of 4 requests on the 2-vCPU Xeon: 1.75 ms,
of which ~1 ms module dispatch, output allocation and ctypes argument conversion around ~40
kernel calls (cProfile and a per-part timer, 2026-12-02; benchmarks/archive/BENCHMARKS.md,
"One C call for the decoder layers").

What it costs: it is a second writing of the Llama decoder layer's order, so a model feature
it lacks (biases, per-head norms today) must be added to `decoder_layers.c` or keep the model
on the layers' own calls (`LlamaDecoderLayer.cpu_parts` returns None). What it pays
(`benchmarks/cpu_ops.py`, `auto` against `auto,no-fused`, interleaved, 2026-12-03): SmolLM2
Q4_1's decode steps on the 2-vCPU AVX2 EPYC 2.15x / 1.24x / 1.29x faster at 1 / 4 / 8 requests
(2 threads), level at 16 where it does not run there; the 7M model's on the AVX-512 Xeon
1.3-1.7x at 1-32 requests (2026-12-02). `cpu_kernels=auto,no-fused` turns it off.

A model hands the CPU op seam its layers as `DecoderLayerParts` (`ops.CpuOps.decoder_layers`:
a layer with biases, per-head norms or tensor parallelism has none, and then every step runs
the layers from Python); `fuse` makes one `FusedLayers` per range of step sizes over which no
projection switches weights (a de-quantized GGUF's 4/8-bit blocks up to the panel kernel's
block rows, float panels above), up to SMALL_BATCH_ROWS. A `FusedLayers` takes a step of
float32 activations, `min_tokens` to `max_tokens` tokens, with the `cpu` attention backend's
plan and no chunk left for SDPA (`DecoderLayers.for_step`); any other step (other dtypes, AMX
products, more tokens) runs the layers from Python as before. Results equal that path's but
for silu, whose exp is `decoder_layers.c`'s own polynomial (within 2 ulp of the exact value;
torch's within 1): float32 rounding, as between any two GEMM libraries.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..attention import cpu_attention
from . import cpu_fused, native, small_m_gemm
from .cpu_gemm import SMALL_BATCH_ROWS, SmallBatchGemm

SOURCE = Path(__file__).with_name("decoder_layers.c")

_p, _n, _i, _f = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("gemm", "norm", "rotate", "write_kv", "rows", "chunk")]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _i), ("num_heads", _i), ("num_kv_heads", _i), ("head_dim", _i),
                ("intermediate", _i), ("block_size", _i), ("eps", _f), ("scale", _f),
                ("num_slots", _n), ("block_stride", _n), ("pos_stride", _n),
                ("head_stride", _n)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("input_norm", "post_norm", "qkv", "o", "gate", "up",
                                         "down", "key_cache", "value_cache")] + [
        (name, _i) for name in ("qkv_type", "o_type", "gate_type", "up_type", "down_type")]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _n), ("cos", _p), ("sin", _p), ("table_stride", _n),
                ("slots", _p), ("tables", _p), ("max_blocks", _n), ("lens", _p),
                ("requests", _p), ("rows", _p), ("n_rows", _n), ("chunks", _p),
                ("n_chunks", _n)]


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("xn", "qkv", "q", "k", "attn", "h2", "gate", "m")]


def _declare(library: ctypes.CDLL) -> None:
    P = ctypes.POINTER
    library.tidal_decoder_layers.argtypes = [P(_Kernels), P(_Shape), P(_Layer), _i, P(_Step),
                                             P(_Scratch), _p]
    library.tidal_decoder_layers.restype = _n
    library.tidal_silu.argtypes = [_p, _n]
    library.tidal_silu.restype = None
    library.tidal_exp.argtypes = [_p, _n, _p]
    library.tidal_exp.restype = None
    library.tidal_layer_times.argtypes = [_p, _i]
    library.tidal_layer_times.restype = _i


PARTS = ("norm", "qkv", "rotate", "write_kv", "rows", "chunks", "o", "norm2", "gate", "silu",
         "up", "down")
"""`decoder_layers.c`'s timed parts, in its order (P_NORM ..)."""


def timed_build() -> native.Build:
    """Measurement only: `decoder_layers.c` built with its per-part timer
    (-DTIDAL_LAYER_TIMES) and installed as this process's build, so that every
    `FusedLayers` made after runs it; `layer_times()` reads it. The served build has no
    timer (its marks compile to nothing)."""
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "decoder_layers_timed.c"
        source.write_text("#define TIDAL_LAYER_TIMES 1\n" + SOURCE.read_text())
        built = native.build_and_load(source, "tidal_decoder_layers_available")
    if built.library is not None:
        _declare(built.library)
        native._builds[(SOURCE, native.march)] = built
    return built


def layer_times(reset: bool = True) -> dict[str, float] | None:
    """Seconds per part of the layers since the last reset (a `timed_build` run), or None
    in a build without the timer."""
    library = load()
    out = (ctypes.c_double * len(PARTS))()
    if library is None or not library.tidal_layer_times(out, int(reset)):
        return None
    return dict(zip(PARTS, out))


def build() -> native.Build:
    """`decoder_layers.c` built and loaded (once), or why not (no C compiler)."""
    return native.build(SOURCE, "tidal_decoder_layers_available", _declare)


def load() -> ctypes.CDLL | None:
    """`decoder_layers.c`'s library, or None without a C compiler."""
    return build().library


def _kernels() -> _Kernels | None:
    """The addresses of the kernels a layer calls, or None where one of them is not built."""
    gemm, ops, attention = small_m_gemm.load(), cpu_fused.c_library(), cpu_attention.load()
    if gemm is None or ops is None or attention is None:
        return None
    address = lambda fn: ctypes.cast(fn, _p).value  # noqa: E731
    return _Kernels(address(gemm.tidal_panel_gemm), address(ops.tidal_rms_norm),
                    address(ops.tidal_rotate_split), address(attention.tidal_write_kv),
                    address(attention.tidal_decode_attention),
                    address(attention.tidal_prefill_attention))


@dataclass(frozen=True)
class DecoderLayerParts:
    """One Llama decoder layer as the fused call computes it (`decoder_layers.c`'s comment):
    the two norms' weights and each projection's small-batch GEMM (`ops.CpuOps.gemm`), gate and
    up apart; no biases, no per-head norms, one rank."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: SmallBatchGemm
    o: SmallBatchGemm
    gate: SmallBatchGemm
    up: SmallBatchGemm
    down: SmallBatchGemm

    @property
    def gemms(self) -> tuple[SmallBatchGemm, ...]:
        return self.qkv, self.o, self.gate, self.up, self.down

    def weights(self, rows: int) -> LayerWeights | None:
        """The weights a step of `rows` rows reads, or None where the panel kernel does not
        take every projection's product of that many rows (or a norm is not float32)."""
        norms = (self.input_norm.detach(), self.post_norm.detach())
        if any(n.dtype != torch.float32 or not n.is_contiguous() for n in norms):
            return None
        projections = [gemm.kernel_weights(rows) for gemm in self.gemms]
        return None if None in projections else LayerWeights(*norms, *projections)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the fused call reads them: the two norms' float32
    weights and each projection's panel-kernel weights (4/8-bit blocks or float panels) with
    their `small_m_gemm` type number."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: tuple[torch.Tensor, int]
    o: tuple[torch.Tensor, int]
    gate: tuple[torch.Tensor, int]
    up: tuple[torch.Tensor, int]
    down: tuple[torch.Tensor, int]


@dataclass(frozen=True)
class LayerShape:
    """The decoder's sizes (one rank's, all layers alike)."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class FusedLayers:
    """Every decoder layer of a model in one call a step (`__call__`), for the steps it
    `takes`."""

    def __init__(self, layers: list[LayerWeights], shape: LayerShape, max_tokens: int,
                 min_tokens: int = 1):
        """For steps of `min_tokens` to `max_tokens` rows (the range the weights serve)."""
        self.library, self.kernels = load(), _kernels()
        if self.library is None or self.kernels is None:
            raise ValueError("the fused decoder layers need the C kernels, not built here")
        self.weights, self.shape = layers, shape
        self.min_tokens, self.max_tokens = max(min_tokens, 1), max_tokens
        self._caches: tuple[int, ...] = ()
        self._layers = self._shape = None
        self._scratch: list[torch.Tensor] = []
        self._scratch_rows = 0
        self._scratch_struct: _Scratch | None = None

    @staticmethod
    def available() -> bool:
        """Whether this machine builds every kernel the call needs."""
        return load() is not None and _kernels() is not None

    def takes(self, hidden: torch.Tensor, plan: object) -> bool:
        """Whether this step's activations and attention plan are the fused call's: float32
        rows, `min_tokens` to `max_tokens` of them, every query row for the C attention."""
        return (isinstance(plan, cpu_attention.CpuAttentionPlan) and not plan.prefills
                and hidden.dtype == torch.float32 and hidden.is_contiguous()
                and self.min_tokens <= hidden.shape[0] <= self.max_tokens)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 slot_mapping: torch.Tensor, plan: cpu_attention.CpuAttentionPlan) -> None:
        """Run every layer over `hidden` [tokens, hidden] in place (a step `takes`); cos/sin
        [tokens, 1, head_dim / 2] float32, the caches as the `cpu` backend lays them out."""
        tokens = hidden.shape[0]
        self._bind(kv_caches)
        scratch = self._scratch_for(tokens)
        slots = slot_mapping.to(torch.int64).contiguous()
        cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
        chunks = np.array([(c.request, c.q_end - c.q_start, c.seq_len, c.q_start)
                           for c in plan.chunks], dtype=np.int64).reshape(-1, 4)
        tables = plan.block_tables
        if plan.rows is not None:
            _, _, lens, requests, rows, n_rows = plan.row_call
        else:
            lens = requests = rows = None
            n_rows = 0
        step = _Step(tokens, cos.data_ptr(), sin.data_ptr(), cos.stride(0), slots.data_ptr(),
                     tables.ctypes.data, tables.shape[1], lens, requests, rows, n_rows,
                     chunks.ctypes.data, len(chunks))
        status = self.library.tidal_decoder_layers(
            ctypes.byref(self.kernels), ctypes.byref(self._shape), self._layers,
            len(self.weights), ctypes.byref(step), ctypes.byref(scratch), hidden.data_ptr())
        if status < 0:
            raise cpu_attention.slot_past_cache(slots, -1 - status, self._shape.num_slots)
        if status > 0:
            raise MemoryError(f"decode attention kernel failed (status {status})")

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The per-layer structs for these caches (made again only when they change)."""
        caches = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if caches == self._caches:
            return
        key_cache = kv_caches[0][0]
        if any(k.stride() != key_cache.stride() or v.stride() != key_cache.stride()
               or k.dtype != torch.float32 or v.dtype != torch.float32
               for k, v in kv_caches) or key_cache.stride(3) != 1:
            raise ValueError("the fused decoder layers need float32 caches of one layout, "
                             "head_dim contiguous")
        s = self.shape
        self._shape = _Shape(s.hidden, s.num_heads, s.num_kv_heads, s.head_dim,
                             s.intermediate, key_cache.shape[1], s.eps, s.scale,
                             key_cache.shape[0] * key_cache.shape[1], *key_cache.stride()[:3])
        layers = (_Layer * len(self.weights))()
        for entry, w, (k, v) in zip(layers, self.weights, kv_caches):
            projections = (w.qkv, w.o, w.gate, w.up, w.down)
            entry.input_norm, entry.post_norm = w.input_norm.data_ptr(), w.post_norm.data_ptr()
            entry.qkv, entry.o, entry.gate, entry.up, entry.down = (
                panels.data_ptr() for panels, _ in projections)
            entry.key_cache, entry.value_cache = k.data_ptr(), v.data_ptr()
            (entry.qkv_type, entry.o_type, entry.gate_type, entry.up_type,
             entry.down_type) = (kind for _, kind in projections)
        self._layers, self._caches = layers, caches

    def _scratch_for(self, tokens: int) -> _Scratch:
        """Scratch buffers for `tokens` rows (grown as needed, kept between steps)."""
        if tokens > self._scratch_rows:
            s = self.shape
            q_width, kv_width = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            widths = (s.hidden, q_width + 2 * kv_width, q_width, kv_width, q_width, s.hidden,
                      s.intermediate, s.intermediate)
            rows = max(tokens, min(2 * self._scratch_rows, self.max_tokens))
            self._scratch = [torch.empty(rows, w, dtype=torch.float32) for w in widths]
            self._scratch_rows = rows
            self._scratch_struct = _Scratch(*(t.data_ptr() for t in self._scratch))
        return self._scratch_struct


class DecoderLayers:
    """A model's decoder layers in one C call a step, for the step sizes some `FusedLayers`
    serves."""

    def __init__(self, fused: tuple[FusedLayers, ...]):
        self.fused = fused

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """(fewest, most) tokens of the steps each call takes."""
        return [(f.min_tokens, f.max_tokens) for f in self.fused]

    def for_step(self, hidden: torch.Tensor, plan: object) -> FusedLayers | None:
        """The call that takes this step (its activations and attention plan), if one does."""
        return next((f for f in self.fused if f.takes(hidden, plan)), None)


def fuse(layers: list[DecoderLayerParts], shape: LayerShape) -> DecoderLayers | None:
    """The fused calls for steps of up to SMALL_BATCH_ROWS tokens: one per range of row counts
    over which no projection switches weights (a de-quantized GGUF's steps of up to the block
    rows read its 4/8-bit blocks, larger ones float panels; on the Zen 4 EPYC, SmolLM2 at 8
    and 32 requests: 34.7 -> 24.5 ms and 110.6 -> 87.8 ms against the layers' own calls on
    blocks) or leaves the panel kernel (with AVX2, float weights past AVX2_PANEL_ROWS); None
    where no range has every layer's weights on the panel kernel."""
    if not layers:
        return None
    gemms = [gemm for layer in layers for gemm in layer.gemms]
    # where a projection switches weights (blocks to panels) or leaves the panel kernel (an
    # AVX2 build's float panels end at AVX2_PANEL_ROWS)
    switches = ({gemm.block_rows for gemm in gemms}
                | {gemm.panel_rows for gemm in gemms}) - {0}
    bounds = sorted({r for r in switches if r < SMALL_BATCH_ROWS} | {SMALL_BATCH_ROWS})
    fused, low = [], 0
    for high in bounds:  # no projection switches weights inside (low, high]
        weights = [layer.weights(high) for layer in layers]
        if None not in weights:
            fused.append(FusedLayers(weights, shape, high, min_tokens=low + 1))
        low = high
    return DecoderLayers(tuple(fused)) if fused else None


def silu(x: torch.Tensor) -> torch.Tensor:
    """The fused call's silu of a float32 tensor (a copy), for tests."""
    out = x.detach().to(torch.float32).contiguous().clone()
    load().tidal_silu(out.data_ptr(), out.numel())
    return out


def exp(x: torch.Tensor) -> torch.Tensor:
    """The fused call's exp of a float32 tensor, for tests."""
    x = x.detach().to(torch.float32).contiguous()
    out = torch.empty_like(x)
    load().tidal_exp(x.data_ptr(), x.numel(), out.data_ptr())
    return out
