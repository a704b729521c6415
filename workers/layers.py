"""Model building blocks: tensor-parallel linear layers, vocab-parallel embedding / LM head,
RMSNorm and rotary embedding.

Sharding (rank r of size P):

    ColumnParallelLinear   weight [out/P, in]   rows r*out/P.. of the checkpoint tensor
    RowParallelLinear      weight [out, in/P]   columns r*in/P..; outputs are all-reduced
    VocabParallelEmbedding weight [ceil(V/P), hidden]; rows outside the checkpoint are zero

Every parameter carries a `weight_loader(param, loaded, shard_id)` that checks the full
checkpoint shape and copies this rank's slice, and a `shard_ids` tuple naming the checkpoint
tensors it is made of (`(None,)` for a plain one, `("q", "k", "v")` for the fused qkv, `(0, 1)`
for gate/up). `loaded` is a torch tensor or a lazy safetensors slice: only the slice this rank
needs is read from disk.

The arithmetic beside attention goes through the CPU op seam (`kernels/cpu/ops.py`): every
module starts on torch's own ops (`TORCH_OPS`) and a worker on the CPU hands each one its
chosen `CpuOps` once the weights are loaded (`use_cpu_ops`): the GEMM of each weight, RMSNorm,
the rotation. Which kernel takes which product is the seam's decision, not the layers'.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu.cpu_gemm import SmallBatchGemm
from ..kernels.cpu.ops import TORCH_OPS, CpuOps
from .distributed import TensorParallel


# ---------------------------------------------------------------------------------------------
# loading helpers


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a torch tensor or a safetensors slice, without reading it."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def _take(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start+size) of `loaded` as a tensor."""
    index = (slice(None),) * dim + (slice(start, start + size),)
    return loaded[index]


def _check_shape(param: nn.Parameter, loaded: Any, expected: tuple[int, ...]) -> None:
    got = loaded_shape(loaded)
    if got != tuple(expected):
        name = getattr(param, "checkpoint_name", "a tensor")
        raise ValueError(f"shape mismatch for {name}: the checkpoint has {list(got)}, "
                         f"the model config expects {list(expected)}")


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype))


def _param(*shape: int, loader, shard_ids=(None,)) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    param.shard_ids = shard_ids
    return param


# ---------------------------------------------------------------------------------------------
# linear layers


class GemmLayer(nn.Module):
    """A module that multiplies by `self.weight` [out, in] through `matmul`, which switches
    to the GEMM the CPU op seam gives the weight (`CpuOps.gemm`) once `use_cpu_ops` ran."""

    cpu_gemm: SmallBatchGemm | None = None
    lora = None
    """The LoRA slots of this projection (`workers/lora.py` LoRAProjection), when the engine
    serves adapters; its product is added only in steps where a token uses one."""

    def lora_add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each token's adapter product for input x, in steps that use adapters."""
        lora = self.lora
        if lora is None or not lora.step.active:
            return y
        return lora.add(x, y)

    def use_cpu_ops(self, ops: CpuOps) -> bool:
        """Take the seam's GEMM for the loaded weight; False where it has none (torch's ops,
        not float32) and `F.linear` stays."""
        self.cpu_gemm = ops.gemm(self.weight)
        return self.cpu_gemm is not None

    def weight_bytes_read(self, rows: int) -> int:
        """Bytes of weight a product of `rows` rows streams on the path it takes."""
        if self.cpu_gemm is not None:
            return self.cpu_gemm.bytes_read(rows)
        return self.weight.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T, no bias."""
        if self.cpu_gemm is not None:
            return self.cpu_gemm(x)
        return F.linear(x, self.weight)

    def matmul_add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """x W^T + other, the add fused into the CPU GEMM when it runs (bit-identical)."""
        if self.cpu_gemm is not None:
            return self.cpu_gemm.add(x, other)
        return F.linear(x, self.weight) + other


class ColumnParallelLinear(GemmLayer):
    """y = x W^T + b with W split by output rows; the output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.local_output_size = tp.split(output_size, "output size")
        self.weight = _param(self.local_output_size, input_size, loader=self.load_rows)
        self.bias = _param(self.local_output_size, loader=self.load_rows) if bias else None

    def load_rows(self, param: nn.Parameter, loaded: Any, shard_id=None) -> None:
        full = (self.output_size,) + tuple(param.shape[1:])
        _check_shape(param, loaded, full)
        rows = param.shape[0]
        _copy(param, _take(loaded, 0, self.tp.rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lora_add(x, self.matmul(x))
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate/up). Local layout: [shard 0 rows of this rank | shard 1 rows of this rank | ...]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 tp: TensorParallel):
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            tp.split(size, "output size")
        super().__init__(input_size, sum(output_sizes), bias, tp)
        shard_ids = tuple(range(len(output_sizes)))
        self.weight.weight_loader = self.load_shard
        self.weight.shard_ids = shard_ids
        if self.bias is not None:
            self.bias.weight_loader = self.load_shard
            self.bias.shard_ids = shard_ids

    shard_gemms: list[SmallBatchGemm] | None = None

    def use_cpu_ops(self, ops: CpuOps) -> bool:
        """One GEMM per shard instead of one for the whole weight, so `silu_and_mul` can
        fuse the product into the second GEMM (the shards' rows of the same weight tensor)."""
        rows = [size // self.tp.size for size in self.output_sizes]
        gemms = [ops.gemm(w) for w in self.weight.detach().split(rows)]
        self.shard_gemms = None if None in gemms else gemms
        return self.shard_gemms is not None

    def weight_bytes_read(self, rows: int) -> int:
        if self.shard_gemms is not None:
            return sum(gemm.bytes_read(rows) for gemm in self.shard_gemms)
        return super().weight_bytes_read(rows)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard_gemms is not None:
            return torch.cat([gemm(x) for gemm in self.shard_gemms], dim=-1)
        return F.linear(x, self.weight)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for the two shards (gate, up) of this projection of x, as the MLP
        needs it: [..., 2 * local size] -> [..., local size]. With the CPU GEMM the product
        is a post-op of the up GEMM, equal bit for bit to the unfused `F.silu(gate) * up`."""
        if (self.shard_gemms is not None and self.bias is None and len(self.shard_gemms) == 2
                and (self.lora is None or not self.lora.step.active)):
            gate_gemm, up_gemm = self.shard_gemms
            return up_gemm.mul(x, F.silu(gate_gemm(x), inplace=True))
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def load_shard(self, param: nn.Parameter, loaded: Any, shard_id: int) -> None:
        full_rows = self.output_sizes[shard_id]
        _check_shape(param, loaded, (full_rows,) + tuple(param.shape[1:]))
        rows = full_rows // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        _copy(param[offset:offset + rows], _take(loaded, 0, self.tp.rank * rows, rows))


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one rank holds (its KV cache's third dimension): split evenly when there are
    at least as many as ranks, else one replicated head. `QKVParallelLinear` shards by this
    rule and checks that the counts divide."""
    if num_kv_heads >= tensor_parallel_size:
        return num_kv_heads // tensor_parallel_size
    return 1


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused. Query heads are split over ranks; KV heads are split
    when there are at least as many as ranks, otherwise each KV head is replicated on
    `size / num_kv_heads` consecutive ranks. Local layout: [q heads | k heads | v heads]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TensorParallel):
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = tp.split(num_heads, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        if num_kv_heads >= tp.size:
            tp.split(num_kv_heads, "num_key_value_heads")  # ValueError unless it divides
            self.kv_head_start = tp.rank * self.num_kv_heads
        elif tp.size % num_kv_heads == 0:
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        else:
            raise ValueError(f"tensor_parallel_size={tp.size} must divide or be a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local * tp.size, bias, tp)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.load_shard
                param.shard_ids = ("q", "k", "v")

    def load_shard(self, param: nn.Parameter, loaded: Any, shard_id: str) -> None:
        d = self.head_dim
        if shard_id == "q":
            full_heads, start_head, num, offset = (
                self.total_num_heads, self.tp.rank * self.num_heads, self.num_heads, 0)
        else:
            full_heads, start_head, num = (
                self.total_num_kv_heads, self.kv_head_start, self.num_kv_heads)
            offset = self.num_heads + (0 if shard_id == "k" else self.num_kv_heads)
        _check_shape(param, loaded, (full_heads * d,) + tuple(param.shape[1:]))
        _copy(param[offset * d:(offset + num) * d], _take(loaded, 0, start_head * d, num * d))


class RowParallelLinear(GemmLayer):
    """y = x W^T + b with W split by input columns: each rank holds a slice of the input
    features, partial products are all-reduced, the bias is added once after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.local_input_size = tp.split(input_size, "input size")
        self.weight = _param(output_size, self.local_input_size, loader=self.load_columns)
        self.bias = _param(output_size, loader=self.load_full) if bias else None

    def load_columns(self, param: nn.Parameter, loaded: Any, shard_id=None) -> None:
        _check_shape(param, loaded, (self.output_size, self.input_size))
        cols = self.local_input_size
        _copy(param, _take(loaded, 1, self.tp.rank * cols, cols))

    def load_full(self, param: nn.Parameter, loaded: Any, shard_id=None) -> None:
        _check_shape(param, loaded, tuple(param.shape))
        _copy(param, loaded[:])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b) (+ residual): a decoder layer's residual add is fused into the GEMM
        where nothing comes between them (one rank, no bias)."""
        if residual is not None and self.tp.size == 1 and self.bias is None:
            return self.lora_add(x, self.matmul_add(x, residual))
        # an adapter's partial product joins the base's before the all-reduce (workers/lora.py)
        y = self.tp.all_reduce(self.lora_add(x, self.matmul(x)))
        y = y if self.bias is None else y + self.bias
        return y if residual is None else residual + y


# ---------------------------------------------------------------------------------------------
# vocabulary


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split into `ceil(V/P)`-row ranges per rank;
    ids outside this rank's range contribute zeros and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.rows_per_rank = math.ceil(vocab_size / tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = _param(self.rows_per_rank, hidden_size, loader=self.load_vocab_rows)

    def load_vocab_rows(self, param: nn.Parameter, loaded: Any, shard_id=None) -> None:
        _check_shape(param, loaded, (self.vocab_size, self.hidden_size))
        num = max(self.vocab_end - self.vocab_start, 0)
        with torch.no_grad():
            param.zero_()
        if num:
            _copy(param[:num], _take(loaded, 0, self.vocab_start, num))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, GemmLayer):
    """Output projection sharded like the embedding; `forward` all-gathers full logits so
    every rank sees (and samples from) the same [num_tokens, vocab_size] tensor."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[:, :self.vocab_size]


# ---------------------------------------------------------------------------------------------
# norm and rotary


class RMSNorm(nn.Module):
    """RMSNorm as Hugging Face computes it, through the CPU op seam (`CpuOps.rms_norm`):
    torch's ops, bit for bit (so float64 runs match transformers), or on the CPU one compiled
    call for float32 rows (equal up to float32 rounding)."""

    ops: CpuOps = TORCH_OPS

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size, loader=self.load_full)

    def load_full(self, param: nn.Parameter, loaded: Any, shard_id=None) -> None:
        _check_shape(param, loaded, tuple(param.shape))
        _copy(param, loaded[:])

    def use_cpu_ops(self, ops: CpuOps) -> bool:
        self.ops = ops
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, rope: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32) for a rope config, as transformers
    computes them; supports the default, `linear` and `llama3` rope types."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                .to(torch.float32) / head_dim))
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / factor, short ones kept, a smooth
    interpolation in between."""
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RopeTables(NamedTuple):
    """One step's rotary factors, gathered once for every layer: [num_tokens, 1, head_dim / 2]
    cosines and sines of each token's position (the two halves of transformers' duplicated
    tables are equal, so half is kept), already in the activation dtype."""

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half) with a cos/sin table per position,
    computed in float32 like transformers and cast to the activation dtype on use.

    `tables(positions, dtype)` gathers a step's factors once; the rotation itself is the CPU
    op seam's (`CpuOps.rotate_split`: q and k heads rotated in one call where they sit side by
    side in the fused qkv output, transformers' arithmetic term for term, bit-identical).
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, rope: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, rope)
        positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The factors of `positions` [num_tokens], for activations of `dtype`."""
        return RopeTables(self.cos_cache[positions].to(dtype).unsqueeze(1),
                          self.sin_cache[positions].to(dtype).unsqueeze(1))


# ---------------------------------------------------------------------------------------------
# pieces of the families beyond Llama (Granite, OLMo 2, Phi-3, Gemma: workers/models/)


def load_fused_rows(layer: ColumnParallelLinear, param: nn.Parameter, loaded: Any,
                    sizes: list[int], shard_ids: tuple) -> None:
    """A checkpoint tensor that already fuses the shards of `layer` (Phi-3's qkv_proj and
    gate_up_proj: their full rows one after the other, `sizes` of them) into `param`: each
    shard's rows go through the layer's own `load_shard`, which takes this rank's part."""
    _check_shape(param, loaded, (sum(sizes),) + tuple(param.shape[1:]))
    full = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    for shard_id, rows in zip(shard_ids, full.split(sizes)):
        layer.load_shard(param, rows, shard_id)


def load_checkpoint_fused(layer: ColumnParallelLinear) -> None:
    """Make `layer` (a `QKVParallelLinear` or a two-way `MergedColumnParallelLinear`) load its
    weight and bias from one fused checkpoint tensor each instead of one per shard."""
    if isinstance(layer, QKVParallelLinear):
        d = layer.head_dim
        sizes = [layer.total_num_heads * d] + [layer.total_num_kv_heads * d] * 2
        shard_ids = ("q", "k", "v")
    else:
        sizes, shard_ids = layer.output_sizes, tuple(range(len(layer.output_sizes)))
    for param in (layer.weight, layer.bias):
        if param is not None:
            param.weight_loader = (lambda p, loaded, shard_id=None:
                                   load_fused_rows(layer, p, loaded, sizes, shard_ids))
            param.shard_ids = (None,)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over features that tensor parallelism splits across ranks (OLMo 2's q/k norms
    over the whole q or k projection): this rank holds features [start, start + size) of
    `full_size` and their weights; the sum of squares is all-reduced. On one rank it is
    `RMSNorm` itself, bit for bit."""

    def __init__(self, full_size: int, eps: float, tp: TensorParallel, start: int = 0,
                 size: int | None = None):
        super().__init__(full_size if size is None else size, eps)
        self.tp, self.full_size, self.start = tp, full_size, start
        self.weight.weight_loader = self.load_slice

    def load_slice(self, param: nn.Parameter, loaded: Any, shard_id=None) -> None:
        _check_shape(param, loaded, (self.full_size,))
        _copy(param, _take(loaded, 0, self.start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        x32 = x.to(torch.float32)
        sum_sq = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        return self.weight * (x32 * torch.rsqrt(sum_sq / self.full_size + self.eps)).to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the normalized rows times (1 + weight), all in float32, cast to the
    activations' dtype once at the end. For float32 activations this is `RMSNorm` with
    weight 1 + w (the same float32 value), so the CPU op seam's kernel takes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.to(torch.float32)
        if x.dtype == torch.float32:
            return self.ops.rms_norm(x, scale, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale).to(x.dtype)


def rotate_partial(ops: CpuOps, qk: torch.Tensor, rope: RopeTables, num_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`CpuOps.rotate_split` of the first 2 * rope.cos.shape[-1] features of each head (a
    partial rotary factor: Phi-4-mini's 0.75), the rest passed through as transformers does."""
    rotary_dim = 2 * rope.cos.shape[-1]
    if rotary_dim == qk.shape[-1]:
        return ops.rotate_split(qk, rope.cos, rope.sin, num_heads)
    q_rot, k_rot = ops.rotate_split(qk[..., :rotary_dim], rope.cos, rope.sin, num_heads)
    q = torch.cat((q_rot, qk[:, :num_heads, rotary_dim:]), dim=-1)
    k = torch.cat((k_rot, qk[:, num_heads:, rotary_dim:]), dim=-1)
    return q, k


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE (Phi-3 `rope_type: longrope`): inverse frequencies 1 / (factor_i *
    theta^(2i/d)) with `short_factor` for positions below `original_max_position_embeddings`
    and `long_factor` from there on, cos and sin times the attention factor (given, else
    sqrt(1 + ln(s) / ln(original)) for s = max_position_embeddings / original > 1).

    transformers picks the factors per forward by the longest sequence in it (`seq_len >
    original`): a decode step at position p uses the long ones when p >= original, which is
    this per-position rule. A prompt longer than `original` in one forward is rotated with the
    long factors throughout there; here its first `original` positions keep the short ones,
    so that a key's rotation depends on its position alone and chunked prefill, batching and
    the prefix cache cannot change it."""

    def __init__(self, head_dim: int, max_position: int, theta: float, rope: dict,
                 max_position_embeddings: int):
        nn.Module.__init__(self)
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor") or max_position_embeddings / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor)
                                                             / math.log(original))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
        tables = []
        for key in ("short_factor", "long_factor"):
            factors = torch.tensor(rope[key], dtype=torch.float32)
            if factors.shape != exponents.shape:
                raise ValueError(f"rope_scaling.{key} has {factors.numel()} entries; the "
                                 f"rotary dimension {head_dim} needs {exponents.numel()}")
            inv_freq = 1.0 / (factors * theta ** exponents)
            tables.append(positions[:, None] * inv_freq[None, :])
        freqs = torch.where(positions[:, None] < original, *tables)
        self.register_buffer("cos_cache", freqs.cos() * attention, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention, persistent=False)
