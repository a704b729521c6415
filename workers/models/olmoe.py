"""OLMoE (OlmoeForCausalLM): Llama attention with one RMSNorm over all of q and one over all
of k (not per head) and an optional `clip_qkv`, every layer sparse (`mlp`, experts of
`intermediate_size`). Routing as transformers' OlmoeTopKRouter: softmax in float32, top
`num_experts_per_tok`, renormalised only with `norm_topk_prob`."""

from __future__ import annotations

from ..moe import Routing
from .moe_decoder import MoeArgs, base_fields, build_model, expert_count, top_k

ARCHITECTURES = ("OlmoeForCausalLM",)


def parse_model_args(config: dict, arch: str = "OlmoeForCausalLM") -> MoeArgs:
    num_experts = expert_count(config, "num_experts", "num_local_experts")
    if "intermediate_size" not in config:
        raise ValueError(f"config.json lacks intermediate_size (architecture {arch})")
    inter = config["intermediate_size"]
    bias = bool(config.get("attention_bias", False))
    clip = config.get("clip_qkv")
    return MoeArgs(**base_fields(config, arch, inter, qkv_bias=bias, o_bias=bias),
                   num_experts=num_experts, moe_intermediate_size=inter,
                   routing=Routing(top_k(config, num_experts), "softmax_topk",
                                   renormalize=bool(config.get("norm_topk_prob", False))),
                   full_qk_norm=True, clip_qkv=None if clip is None else float(clip))


__all__ = ["ARCHITECTURES", "build_model", "parse_model_args"]
