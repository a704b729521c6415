"""Microsoft Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`): a Llama whose checkpoint
already fuses the projections tidal fuses (`self_attn.qkv_proj` = q | k | v rows,
`mlp.gate_up_proj` = gate | up rows), loaded straight into the fused layers (each rank takes
its heads' and its columns' rows of each part, `layers.load_checkpoint_fused`); LongRoPE
scaling (`rope_type: longrope`, older configs' `su` / `yarn`: `layers.LongRopeEmbedding`,
short factors below `original_max_position_embeddings`, long ones from there on); and a
partial rotary factor (Phi-4-mini: 0.75, the first 3/4 of each head rotated).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import LongRopeEmbedding, RotaryEmbedding, load_checkpoint_fused, rotate_partial
from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, ModelArgs
from .llama import base_fields

ARCHITECTURES = ("Phi3ForCausalLM",)
LONGROPE_NAMES = ("longrope", "su", "yarn")
"""transformers' Phi-3 config reads `su` and `yarn` as longrope."""


@dataclass(frozen=True)
class Phi3Args(ModelArgs):
    rotary_dim: int = 0
    """Features of each head that rotate: head_dim * partial_rotary_factor."""


def parse_model_args(config: dict, architecture: str = "Phi3ForCausalLM") -> Phi3Args:
    fields = base_fields(config, architecture)
    rope = fields["rope_scaling"]
    if rope is not None:
        kind = rope.get("rope_type", rope.get("type"))
        if kind not in LONGROPE_NAMES:
            raise ValueError(f"{architecture}: rope_scaling type {kind!r} is not supported "
                             "(longrope only)")
        rope = {**rope, "rope_type": "longrope"}
        rope.setdefault("original_max_position_embeddings",
                        config.get("original_max_position_embeddings",
                                   fields["max_position_embeddings"]))
        fields["rope_scaling"] = rope
    partial = (config.get("partial_rotary_factor")
               or (config.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0)
    return Phi3Args(**fields, rotary_dim=int(fields["head_dim"] * partial))


class Phi3Attention(LlamaAttention):
    def __init__(self, args: Phi3Args, tp, backend):
        super().__init__(args, tp, backend)
        load_checkpoint_fused(self.qkv_proj)

    def project(self, rope, x):
        num_tokens, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        split = (self.num_heads + self.num_kv_heads) * d
        qk = qkv[:, :split].view(num_tokens, -1, d)
        q, k = rotate_partial(self.ops, qk, rope, self.num_heads)
        return q, k, qkv[:, split:].view(num_tokens, self.num_kv_heads, d)


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Phi3Attention

    def __init__(self, args: Phi3Args, tp, backend, index: int = 0):
        super().__init__(args, tp, backend, index)
        load_checkpoint_fused(self.mlp.gate_up_proj)
        self.partial_rotary = args.rotary_dim != args.head_dim

    def cpu_parts(self):
        return None if self.partial_rotary else super().cpu_parts()


class Phi3Model(LlamaModel):
    layer_cls = Phi3DecoderLayer

    def rotary_embedding(self, args: Phi3Args, max_position: int) -> RotaryEmbedding:
        if args.rope_scaling is None:
            return RotaryEmbedding(args.rotary_dim, max_position, args.rope_theta, None)
        return LongRopeEmbedding(args.rotary_dim, max_position, args.rope_theta,
                                 args.rope_scaling, args.max_position_embeddings)


class Phi3ForCausalLM(LlamaForCausalLM):
    model_cls = Phi3Model
    packed_modules_mapping = {}  # the checkpoint's names are the model's

    def __init__(self, args: Phi3Args, tp, backend, max_model_len: int, pp):
        super().__init__(args, tp, backend, max_model_len, pp)
        if args.rotary_dim != args.head_dim:
            self.fused_layers_lack = "a partial rotary factor"


def build_model(args: Phi3Args, tp, backend, max_model_len: int, pp) -> Phi3ForCausalLM:
    return Phi3ForCausalLM(args, tp, backend, max_model_len, pp)
