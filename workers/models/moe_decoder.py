"""The decoder that tidal's mixture-of-experts families share (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, Granite-MoE; one short module each picks its config fields): llama.py's classes
(`MoeDecoderLayer`, `MoeModel`, `MoeForCausalLM` subclass its layer, model and LM: the layer
order norm, attention, residual add, norm, MLP, residual add), the dense MLP replaced by a
sparse block in every layer the config makes sparse. A family's quirks stay in its own module
(Granite-MoE's multipliers: granite.py's mixins, composed in granite_moe.py).

Module names mirror the checkpoints (so most tensors load by name):

    layers.N.<block>.gate                  router [E, hidden], replicated (Granite-MoE's
                                           `router.layer` loads into it)
    layers.N.<block>.experts.w13 / w2      the stacked experts (`workers/moe.py`), filled from
                                           `experts.E.{w1,w3,w2}` (Mixtral),
                                           `experts.E.{gate,up,down}_proj` (Qwen, OLMoE) or the
                                           stacked forms (`param_for`)
    layers.N.<block>.shared_expert[_gate]  Qwen2-MoE's always-on expert and its sigmoid gate
    layers.N.mlp.gate_up_proj / down_proj  a dense layer's MLP (Qwen2/3-MoE `mlp_only_layers`)

<block> is `mlp` or `block_sparse_moe` (Mixtral and Granite-MoE checkpoints). Tensor
parallelism: attention as in llama.py; each expert's intermediate dimension split over the
ranks (`FusedMoE`), the router replicated, one all-reduce per sparse block after the combine.
The CPU op seam's one-call decoder layers do not take these layers (no router or experts in
the C path); the layers call the seam's kernels one by one, the experts' GEMMs included.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...kernels.attention import AttentionBackend
from ...kernels.cpu.ops import CpuOps
from ..attention import AttentionInputs, KVCache
from ..distributed import PipelineParallel, TensorParallel
from ..layers import (
    GemmLayer,
    RMSNorm,
    RopeTables,
    _check_shape,
    _copy,
    _param,
    _take,
)
from ..moe import STACKED, FusedMoE, Routing, route
from . import llama
from .llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    ModelArgs,
)


@dataclass(frozen=True)
class MoeArgs(ModelArgs):
    """llama.py's fields (`intermediate_size`: the dense layers' MLP) and the MoE ones."""

    num_experts: int = 0
    moe_intermediate_size: int = 0
    """Each routed expert's intermediate size."""
    routing: Routing = Routing(top_k=1)
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert (0: none)."""
    dense_layers: tuple[int, ...] = ()
    """Layers with a dense MLP instead of experts (Qwen2/3-MoE `mlp_only_layers`,
    `decoder_sparse_step`)."""
    block_name: str = "mlp"
    """The sparse block's module name in the checkpoint (`mlp`, `block_sparse_moe`)."""
    full_qk_norm: bool = False
    """OLMoE: one RMSNorm over all of q and one over all of k (not per head)."""
    clip_qkv: float | None = None
    """OLMoE: clamp q, k and v to [-clip, clip] after the projection."""


def base_fields(config: dict, arch: str, intermediate_size: int, *, qkv_bias: bool,
                o_bias: bool, qk_norm: bool = False) -> dict:
    """The llama.py `ModelArgs` fields of an MoE config (ValueError naming a missing one)."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported by {arch} (only silu)")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)} (architecture {arch})")
    heads = config["num_attention_heads"]
    theta, rope = llama._rope_config(config)
    return dict(
        architecture=arch, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=intermediate_size, num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=rope, max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
        o_bias=o_bias, mlp_bias=False, qk_norm=qk_norm,
        eos_token_ids=llama._as_list(config.get("eos_token_id")),
        sliding_window=llama._sliding_window(config))


def expert_count(config: dict, *names: str) -> int:
    """The number of experts under the first of `names` the config has; ValueError if none."""
    for name in names:
        if config.get(name):
            return int(config[name])
    raise ValueError(f"config.json lacks {' / '.join(names)} (the number of experts)")


def top_k(config: dict, num_experts: int) -> int:
    k = int(config.get("num_experts_per_tok") or 0)
    if not 1 <= k <= num_experts:
        raise ValueError(f"num_experts_per_tok={k} must be between 1 and the number of "
                         f"experts ({num_experts})")
    return k


# ---------------------------------------------------------------------------------------------
# modules


class ReplicatedLinear(GemmLayer):
    """y = x W^T with the whole weight on every rank (a router, a shared expert's gate)."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.weight = _param(output_size, input_size, loader=self.load_full)

    def load_full(self, param: nn.Parameter, loaded: Any, shard_id=None) -> None:
        _check_shape(param, loaded, tuple(param.shape))
        _copy(param, loaded[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the gated shared expert; `forward(x, residual)`
    -> residual + the block's output, all-reduced once over the TP group."""

    def __init__(self, args: MoeArgs, tp: TensorParallel):
        super().__init__()
        self.tp, self.routing = tp, args.routing
        self.gate = ReplicatedLinear(args.hidden_size, args.num_experts)
        self.experts = FusedMoE(args.num_experts, args.hidden_size, args.moe_intermediate_size,
                                tp)
        self.has_shared = args.shared_expert_intermediate_size > 0
        if self.has_shared:
            shared = dataclasses.replace(args,
                                         intermediate_size=args.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared, tp)
            self.shared_expert_gate = ReplicatedLinear(args.hidden_size, 1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.routing, x.dtype)
        out = self.experts(x, weights, ids)  # this rank's partial sums
        if self.has_shared:  # its down projection split like the experts': reduced with them
            mlp = self.shared_expert
            act = mlp.gate_up_proj.silu_and_mul(x)  # an adapter's gate/up product included
            shared = mlp.down_proj.lora_add(act, mlp.down_proj.matmul(act))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        out = self.tp.all_reduce(out)
        return out if residual is None else residual + out


class ShardedRMSNorm(nn.Module):
    """OLMoE's q / k norm: RMSNorm over every head of q (or k) together, each rank holding its
    heads' slice of the weight; the sum of squares is all-reduced (a replicated KV head is
    counted on each of its ranks, and so is its share of the width: the mean is the same)."""

    def __init__(self, full_width: int, local_width: int, start: int, eps: float,
                 tp: TensorParallel):
        super().__init__()
        self.full_width, self.local_width, self.start = full_width, local_width, start
        self.eps, self.tp = eps, tp
        self.weight = _param(local_width, loader=self.load_slice)

    def load_slice(self, param: nn.Parameter, loaded: Any, shard_id=None) -> None:
        _check_shape(param, loaded, (self.full_width,))
        _copy(param, _take(loaded, 0, self.start, self.local_width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        if self.tp.size == 1:  # transformers' arithmetic exactly
            variance = x32.pow(2).mean(-1, keepdim=True)
        else:
            variance = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / (
                self.local_width * self.tp.size)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)


class OlmoeAttention(LlamaAttention):
    """Llama attention with OLMoE's full-width q / k norms before rotary and its clip."""

    def __init__(self, args: MoeArgs, tp: TensorParallel, backend: AttentionBackend):
        super().__init__(args, tp, backend)
        d, proj = args.head_dim, self.qkv_proj
        self.q_norm = ShardedRMSNorm(args.num_attention_heads * d, self.num_heads * d,
                                     tp.rank * self.num_heads * d, args.rms_norm_eps, tp)
        self.k_norm = ShardedRMSNorm(args.num_key_value_heads * d, self.num_kv_heads * d,
                                     proj.kv_head_start * d, args.rms_norm_eps, tp)
        self.clip = args.clip_qkv

    def forward(self, rope: RopeTables, x: torch.Tensor, kv_cache: KVCache,
                attn_inputs: AttentionInputs, residual: torch.Tensor | None) -> torch.Tensor:
        num_tokens, d = x.shape[0], self.head_dim
        q_width, k_width = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj(x)  # [tokens, q heads | k heads | v heads]
        q = self.q_norm(qkv[:, :q_width])
        k = self.k_norm(qkv[:, q_width:q_width + k_width])
        v = qkv[:, q_width + k_width:]
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        qk = torch.cat((q, k), dim=-1).view(num_tokens, -1, d)
        q, k = self.ops.rotate_split(qk, rope.cos, rope.sin, self.num_heads)
        out = self.attn(q, k, v.reshape(num_tokens, self.num_kv_heads, d), kv_cache,
                        attn_inputs)
        return self.o_proj(out, residual)


class MoeDecoderLayer(LlamaDecoderLayer):
    """llama.py's layer (its forward: norm, attention, residual add, norm, block, residual
    add) with the block sparse unless the layer is dense, under the checkpoint's module name
    (`mlp` or `block_sparse_moe`); `mlp` reads it whatever its name."""

    def __init__(self, args: MoeArgs, tp: TensorParallel, backend: AttentionBackend,
                 index: int = 0):
        nn.Module.__init__(self)
        attention = OlmoeAttention if args.full_qk_norm else LlamaAttention
        self.self_attn = attention(args, tp, backend)
        dense = index in args.dense_layers
        self.block_name = "mlp" if dense else args.block_name
        self.add_module(self.block_name, LlamaMLP(args, tp) if dense
                        else SparseMoeBlock(args, tp))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mlp(self) -> nn.Module:
        try:
            return self._modules[self.block_name]
        except KeyError:  # before __init__ adds it (add_module asks hasattr)
            raise AttributeError("mlp") from None

    def cpu_parts(self) -> None:
        return None  # no router or experts in the one-call C layers


class MoeModel(LlamaModel):
    layer_cls = MoeDecoderLayer

    def use_cpu_ops(self, ops: CpuOps) -> bool:
        return False  # the one-call C layers have no router or experts


# a checkpoint's per-expert tensor: <prefix>.experts.<e>.<projection>.weight
_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>w1|w3|w2|gate_proj|up_proj|"
                     r"down_proj)\.weight$")
_EXPERT_SHARD = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1),
                 "up_proj": ("w13", 1), "w2": ("w2", None), "down_proj": ("w2", None)}
# stacked forms: transformers 5's (a GGUF conversion writes them) and Granite-MoE's
_STACKED = {".experts.gate_up_proj": ".experts.w13", ".experts.down_proj": ".experts.w2",
            ".input_linear.weight": ".experts.w13", ".output_linear.weight": ".experts.w2"}


class MoeForCausalLM(LlamaForCausalLM):
    """The MoE decoder plus the LM head; llama.py's pipeline-stage naming, forward and
    packed projections, with the experts' names (`param_for`)."""

    model_cls = MoeModel

    def param_for(self, name: str) -> tuple[str, object] | None:
        """(parameter, shard id) of an expert tensor or Granite's router; None for the rest
        (loaded by name and `packed_modules_mapping`)."""
        m = _EXPERT.match(name)
        if m:
            param, shard = _EXPERT_SHARD[m["proj"]]
            return f"{m['experts']}.{param}", (int(m["e"]), shard)
        for suffix, param in _STACKED.items():
            if name.endswith(suffix):
                return name[:-len(suffix)] + param, STACKED
        if name.endswith(".router.layer.weight"):  # Granite-MoE's router
            return name[:-len(".router.layer.weight")] + ".gate.weight", None
        return None

    def use_cpu_ops(self, ops: CpuOps) -> str:
        """Every GEMM from the seam (experts' per expert), RMSNorm and rotary its; no
        one-call decoder layers. What the model took, for the worker's start-up line."""
        gemms = sum(m.use_cpu_ops(ops) for m in self.modules() if isinstance(m, GemmLayer))
        experts = [m for m in self.modules() if isinstance(m, FusedMoE)]
        took = sum(m.use_cpu_ops(ops) for m in experts)
        for m in self.modules():
            if isinstance(m, (RMSNorm, LlamaAttention)):
                m.use_cpu_ops(ops)
        return (f"{gemms} linear layers and the experts of {took} of {len(experts)} MoE "
                "layers on the small-batch GEMMs; the decoder layers in one C call: not for "
                "MoE models (no router or experts in it), their kernels are called one by one")


def build_model(args: MoeArgs, tp: TensorParallel, backend: AttentionBackend,
                max_model_len: int, pp: PipelineParallel = PipelineParallel()
                ) -> MoeForCausalLM:
    """The model (one pipeline stage of it) for any MoE family's args."""
    return MoeForCausalLM(args, tp, backend, max_model_len, pp)
