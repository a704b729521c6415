"""Llama-family decoder models: Llama 2/3, Mistral (its sliding window included), Qwen2
(qkv bias) and Qwen3 (per-head q/k RMSNorm), one implementation with a registry by the
`architectures` name in config.json.

Module names mirror the Hugging Face checkpoints, except two fused projections that the
loader fills from separate checkpoint tensors (`packed_modules_mapping`):

    self_attn.qkv_proj  <- q_proj, k_proj, v_proj
    mlp.gate_up_proj    <- gate_proj, up_proj

With pipeline parallelism a model holds one stage: its run of decoder layers (keyed by
their global index, so `model.layers.7.*` loads into stage 1's layer 7 unchanged), the
embedding only on the first stage, the final norm and the LM head only on the last; a tied
LM head on a last stage without the embedding loads `model.embed_tokens.weight` itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...kernels.attention import AttentionBackend
from ...kernels.cpu.fused_layers import DecoderLayerParts, DecoderLayers, LayerShape
from ...kernels.cpu.ops import TORCH_OPS, CpuOps
from ..attention import AttentionInputs, KVCache, PagedAttention
from ..distributed import PipelineParallel, TensorParallel
from ..layers import (
    GemmLayer,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RopeTables,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class Flavour:
    """What distinguishes one architecture of the family from the others."""

    qkv_bias: bool | None = None
    """Force a bias on q/k/v (Qwen2); None reads `attention_bias` from the config."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before rotary (Qwen3)."""


ARCHITECTURES: dict[str, Flavour] = {
    "LlamaForCausalLM": Flavour(),
    "MistralForCausalLM": Flavour(),
    "Qwen2ForCausalLM": Flavour(qkv_bias=True),
    "Qwen3ForCausalLM": Flavour(qk_norm=True),
}


@dataclass(frozen=True)
class ModelArgs:
    """The fields of a Hugging Face config.json that the model needs, validated."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    """Attention window from the config (Mistral v0.1 style): every layer's queries see the
    last `sliding_window` positions (`PagedAttention`); None: full attention."""

    def attention_scale(self) -> float:
        """The factor on q.k in attention (head_dim^-1/2; another family's args may differ)."""
        return self.head_dim ** -0.5

    def check_max_model_len(self, max_model_len: int) -> None:
        """Nothing to refuse: a sliding window runs at any length (`PagedAttention`)."""


def parse_model_args(config: dict, arch: str | None = None) -> ModelArgs:
    """Build `ModelArgs` from config.json contents for `arch` (by default the first of
    its `architectures` this family implements); ValueError naming any bad field."""
    if arch is None:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch or '(none in config.json)'} is not a Llama-"
                         f"family one ({', '.join(ARCHITECTURES)})")
    return ModelArgs(**base_fields(config, arch, ARCHITECTURES[arch]))


def base_fields(config: dict, arch: str, flavour: Flavour = Flavour(),
                activations: tuple[str, ...] = ("silu",)) -> dict:
    """`ModelArgs`' fields from config.json for `arch`, for this family and the families built
    on it (which add their own fields); ValueError naming any bad field."""
    act = config.get("hidden_activation") or config.get("hidden_act", activations[0])
    if act not in activations:
        raise ValueError(f"hidden_act {act!r} is not supported by {arch} (supported: "
                         f"{', '.join(activations)})")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)} (architecture {arch})")
    heads = config["num_attention_heads"]
    theta, rope = _rope_config(config)
    attention_bias = bool(config.get("attention_bias", False))
    forced_qkv_bias = flavour.qkv_bias is not None  # Qwen2: bias on q/k/v, none on o
    return dict(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=flavour.qkv_bias if forced_qkv_bias else attention_bias,
        o_bias=False if forced_qkv_bias else attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=flavour.qk_norm,
        eos_token_ids=_as_list(config.get("eos_token_id")),
        sliding_window=_sliding_window(config),
    )


def _sliding_window(config: dict) -> int | None:
    """The attention window when the config turns one on (Mistral v0.1 style), else None.
    Qwen2/3 configs carry a window but switch it off with use_sliding_window=false."""
    window = config.get("sliding_window")
    if not window or not config.get("use_sliding_window", True):
        return None
    return int(window)


def _rope_config(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` pair."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        return theta, (None if kind == "default" else dict(params))
    theta = float(config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) != "default":
        return theta, dict(scaling)
    return theta, None


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]


# ---------------------------------------------------------------------------------------------
# modules


class LlamaAttention(nn.Module):
    def __init__(self, args: ModelArgs, tp: TensorParallel, backend: AttentionBackend):
        super().__init__()
        d = args.head_dim
        self.qkv_proj = QKVParallelLinear(args.hidden_size, d, args.num_attention_heads,
                                          args.num_key_value_heads, args.qkv_bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(args.num_attention_heads * d, args.hidden_size,
                                        args.o_bias, tp)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, args.attention_scale(),
                                   backend, sliding_window=args.sliding_window)
        self.ops = TORCH_OPS  # the rotation's (`use_cpu_ops`)

    def use_cpu_ops(self, ops: CpuOps) -> bool:
        self.ops = ops
        return True

    def forward(self, rope: RopeTables, x: torch.Tensor, kv_cache: KVCache,
                attn_inputs: AttentionInputs, residual: torch.Tensor | None = None
                ) -> torch.Tensor:
        """residual + attention(x) (the add fused into o_proj where it can be); attention(x)
        alone without a residual."""
        q, k, v = self.project(rope, x)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_inputs), residual)

    def project(self, rope: RopeTables, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> rotated q [tokens, heads, d], rotated k and v [tokens,
        kv_heads, d]."""
        num_tokens, d = x.shape[0], self.head_dim
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # [tokens, (heads + 2 kv_heads) * d]: q heads | k heads | v heads
        qk = qkv[:, :(num_heads + num_kv_heads) * d].view(num_tokens, -1, d)
        v = qkv[:, (num_heads + num_kv_heads) * d:].view(num_tokens, num_kv_heads, d)
        if self.qk_norm:  # per-head norms with their own weights, then rotary
            qk = torch.cat((self.q_norm(qk[:, :num_heads]), self.k_norm(qk[:, num_heads:])),
                           dim=1)
        # q and k heads side by side: one rotation
        q, k = self.ops.rotate_split(qk, rope.cos, rope.sin, num_heads)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, args: ModelArgs, tp: TensorParallel):
        super().__init__()
        inter = args.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(args.hidden_size, [inter, inter],
                                                       args.mlp_bias, tp)
        self.down_proj = RowParallelLinear(inter, args.hidden_size, args.mlp_bias, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + mlp(x) (mlp(x) without a residual)."""
        return self.down_proj(self.gate_up_proj.silu_and_mul(x), residual)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    mlp_cls = LlamaMLP

    def __init__(self, args: ModelArgs, tp: TensorParallel, backend: AttentionBackend,
                 index: int = 0):
        super().__init__()
        self.self_attn = self.attention_cls(args, tp, backend)
        self.mlp = self.mlp_cls(args, tp)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, rope: RopeTables, x: torch.Tensor, kv_cache: KVCache,
                attn_inputs: AttentionInputs) -> torch.Tensor:
        h = self.self_attn(rope, self.input_layernorm(x), kv_cache, attn_inputs, residual=x)
        return self.mlp(self.post_attention_layernorm(h), residual=h)

    def cpu_parts(self) -> DecoderLayerParts | None:
        """This layer as the CPU op seam's one-call decoder layers compute it (norms, then
        each projection's GEMM from the seam), or None where it has what they do not: biases,
        per-head norms, tensor parallelism, a projection on F.linear."""
        attn, mlp = self.self_attn, self.mlp
        linear = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        gemms = (attn.qkv_proj.cpu_gemm, attn.o_proj.cpu_gemm, mlp.down_proj.cpu_gemm)
        if (attn.qk_norm or any(m.bias is not None for m in linear) or attn.o_proj.tp.size != 1
                or None in gemms or mlp.gate_up_proj.shard_gemms is None):
            return None
        qkv, o, down = gemms
        return DecoderLayerParts(self.input_layernorm.weight, self.post_attention_layernorm.weight,
                                 qkv, o, *mlp.gate_up_proj.shard_gemms, down)


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer
    """Built for every layer index of the stage (`layer_cls(args, tp, backend, index)`)."""

    def __init__(self, args: ModelArgs, tp: TensorParallel, backend: AttentionBackend,
                 max_model_len: int, pp: PipelineParallel):
        super().__init__()
        self.pp = pp
        if pp.is_first:
            self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        self.rotary = self.rotary_embedding(args, max(max_model_len, 1))
        # keyed "7" for layer 7 wherever it sits: parameter names match the checkpoint's
        self.layers = nn.ModuleDict({str(i): self.layer_cls(args, tp, backend, i)
                                     for i in pp.layers(args.num_hidden_layers)})
        if pp.is_last:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.args = args
        self.fused: DecoderLayers | None = None
        """Every layer in one C call a step, for the steps it takes (`use_cpu_ops`)."""

    lora_step = None
    """The LoRA step state (`workers/lora.py`) when the engine serves adapters: the one-call C
    layers cannot add an adapter's product, so a step that uses one takes the per-module
    path."""

    def rotary_embedding(self, args: ModelArgs, max_position: int) -> RotaryEmbedding:
        return RotaryEmbedding(args.head_dim, max_position, args.rope_theta, args.rope_scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input to the first layer."""
        return self.embed_tokens(input_ids)

    def use_cpu_ops(self, ops: CpuOps) -> bool:
        """Ask the CPU op seam for the decoder layers in one call (its modules already took
        the seam's ops); True when it gave them. One pipeline stage only: the call ends with
        the last layer, and the final norm follows."""
        layers = list(self.layers.values())
        if self.pp.size != 1 or not layers or self.args.sliding_window is not None:
            return False  # the one-call layers attend over the whole context
        a, attn = self.args, layers[0].self_attn
        shape = LayerShape(a.hidden_size, attn.num_heads, attn.num_kv_heads, a.head_dim,
                           a.intermediate_size, a.rms_norm_eps, attn.attn.scale)
        self.fused = ops.decoder_layers([layer.cpu_parts() for layer in layers], shape)
        return self.fused is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_inputs: AttentionInputs,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's output: final (normed) hidden states on the last stage, else the
        residual stream after its last layer. `hidden`: the previous stage's output (every
        stage but the first)."""
        h = self.embed(input_ids) if self.pp.is_first else hidden
        rope = self.rotary.tables(positions, h.dtype)  # gathered once for every layer
        fused = (self.fused.for_step(h, attn_inputs.plan) if self.fused is not None and (
            self.lora_step is None or not self.lora_step.active) else None)
        if fused is not None:
            fused(h, rope.cos, rope.sin, kv_caches, attn_inputs.meta.slot_mapping,
                  attn_inputs.plan)  # h: this step's own embeddings, updated in place
            return self.norm(h)
        for layer, kv_cache in zip(self.layers.values(), kv_caches):
            h = layer(rope, h, kv_cache, attn_inputs)
        return self.norm(h) if self.pp.is_last else h


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head. `forward` returns final hidden states for every new
    token; `compute_logits` turns the few rows that sample into full-vocabulary logits."""

    model_cls = LlamaModel
    fused_layers_lack: str | None = None
    """Why this architecture's layers never take the one-call decoder layers (for the
    start-up line), or None where they may."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, args: ModelArgs, tp: TensorParallel, backend: AttentionBackend,
                 max_model_len: int, pp: PipelineParallel = PipelineParallel()):
        super().__init__()
        self.args = args
        self.pp = pp
        self.model = self.model_cls(args, tp, backend, max_model_len, pp)
        if pp.is_last:
            self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp)
            if args.tie_word_embeddings and pp.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        """Decoder layers on this stage (each has its own KV cache)."""
        return len(self.model.layers)

    def checkpoint_name(self, name: str) -> str | None:
        """The name under which this stage loads checkpoint tensor `name`, or None when
        another stage holds it."""
        pp = self.pp
        if pp.size == 1:
            return name
        if name.startswith("model.layers."):
            return name if name.split(".")[2] in self.model.layers else None
        if name.startswith("model.embed_tokens."):
            if pp.is_first:
                return name
            if pp.is_last and self.args.tie_word_embeddings:  # the tied LM head's weights
                return "lm_head." + name[len("model.embed_tokens."):]
            return None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if pp.is_last else None
        return name

    def use_cpu_ops(self, ops: CpuOps) -> str:
        """Hand every module the CPU op seam's `ops` (`kernels/cpu/ops.py`), once the weights
        are loaded: each weight its GEMM, the norms and the rotation theirs, the decoder its
        layers in one call where the seam gives them. What the model took, in words (for the
        worker's start-up line)."""
        gemms = sum(m.use_cpu_ops(ops) for m in self.modules() if isinstance(m, GemmLayer))
        for m in self.modules():
            if isinstance(m, (RMSNorm, LlamaAttention)):
                m.use_cpu_ops(ops)
        taken = f"{gemms} linear layers on the small-batch GEMMs"
        if self.model.use_cpu_ops(ops):
            ranges = ", ".join(f"{low}-{high}" for low, high in self.model.fused.ranges)
            taken += f", the decoder layers in one C call for steps of {ranges} tokens"
        elif self.fused_layers_lack and ops.fused:
            taken += (f", the decoder layers module by module ({self.fused_layers_lack}, "
                      "which the one-call layers lack)")
        return taken

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_inputs: AttentionInputs,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden] (a later
        stage also takes the previous stage's `hidden`)."""
        return self.model(input_ids, positions, kv_caches, attn_inputs, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab_size], identical on every rank."""
        return self.lm_head(hidden)


def build_model(args: ModelArgs, tp: TensorParallel, backend: AttentionBackend,
                max_model_len: int, pp: PipelineParallel = PipelineParallel()
                ) -> LlamaForCausalLM:
    """The model (one pipeline stage of it) for `args.architecture` (all registered ones
    share this class)."""
    return LlamaForCausalLM(args, tp, backend, max_model_len, pp)
