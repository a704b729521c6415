"""AI2's OLMo 2 (`Olmo2ForCausalLM`): a Llama whose norms sit after the blocks, not before.

    h   = x + post_attention_layernorm(attn(x))        no norm on the block's input
    out = h + post_feedforward_layernorm(mlp(h))

and whose q/k norms are RMSNorms over the whole q (and k) projection, one weight of
heads * head_dim, before the heads are split and rotated (Qwen3's are per head). With tensor
parallelism each rank holds its heads' features and the sum of squares is all-reduced
(`ShardedRMSNorm`); a KV head replicated on several ranks would be counted more than once, so
that case is refused.
"""

from __future__ import annotations

import torch

from ..layers import RMSNorm, ShardedRMSNorm
from .llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    ModelArgs,
    base_fields,
)

ARCHITECTURES = ("Olmo2ForCausalLM",)


def parse_model_args(config: dict, architecture: str = "Olmo2ForCausalLM") -> ModelArgs:
    return ModelArgs(**base_fields(config, architecture))


class Olmo2Attention(LlamaAttention):
    def __init__(self, args: ModelArgs, tp, backend):
        super().__init__(args, tp, backend)
        qkv, d = self.qkv_proj, args.head_dim
        if args.num_key_value_heads < tp.size:
            raise ValueError(f"Olmo2ForCausalLM: tensor_parallel_size={tp.size} exceeds "
                             f"num_key_value_heads={args.num_key_value_heads} (the k norm spans "
                             "every KV head, which would be replicated)")
        self.q_norm = ShardedRMSNorm(qkv.total_num_heads * d, args.rms_norm_eps, tp,
                                     tp.rank * qkv.num_heads * d, qkv.num_heads * d)
        self.k_norm = ShardedRMSNorm(qkv.total_num_kv_heads * d, args.rms_norm_eps, tp,
                                     qkv.kv_head_start * d, qkv.num_kv_heads * d)

    def project(self, rope, x):
        num_tokens, d = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q, k, v = self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)
        qk = torch.cat((self.q_norm(q.contiguous()), self.k_norm(k.contiguous())), dim=-1)
        q, k = self.ops.rotate_split(qk.view(num_tokens, -1, d), rope.cos, rope.sin,
                                     self.num_heads)
        return q, k, v.view(num_tokens, self.num_kv_heads, d)


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Olmo2Attention

    def __init__(self, args: ModelArgs, tp, backend, index: int = 0):
        super().__init__(args, tp, backend, index)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, rope, x, kv_cache, attn_inputs) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, attn_inputs))
        return h + self.post_feedforward_layernorm(self.mlp(h))

    def cpu_parts(self):
        return None  # norms after the blocks, q/k norms


class Olmo2Model(LlamaModel):
    layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
    fused_layers_lack = "OLMo 2's norms after attention and MLP and its q/k norms"


def build_model(args: ModelArgs, tp, backend, max_model_len: int, pp) -> Olmo2ForCausalLM:
    return Olmo2ForCausalLM(args, tp, backend, max_model_len, pp)
