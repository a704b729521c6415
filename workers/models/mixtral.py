"""Mixtral (MixtralForCausalLM): Mistral's attention, every layer's MLP a sparse block of
`num_local_experts` experts (`block_sparse_moe`, experts `w1` gate / `w3` up / `w2` down).
Routing as transformers' MixtralTopKRouter: softmax over all experts in float32, the top
`num_experts_per_tok`, renormalised, combined in float32."""

from __future__ import annotations

from ..moe import Routing
from .moe_decoder import MoeArgs, base_fields, build_model, expert_count, top_k

ARCHITECTURES = ("MixtralForCausalLM",)


def parse_model_args(config: dict, arch: str = "MixtralForCausalLM") -> MoeArgs:
    num_experts = expert_count(config, "num_local_experts", "num_experts")
    if "intermediate_size" not in config:
        raise ValueError(f"config.json lacks intermediate_size (architecture {arch})")
    inter = config["intermediate_size"]
    return MoeArgs(**base_fields(config, arch, inter, qkv_bias=False, o_bias=False),
                   num_experts=num_experts, moe_intermediate_size=inter,
                   routing=Routing(top_k(config, num_experts), "softmax_topk", renormalize=True,
                                   weights_float32=True),
                   block_name="block_sparse_moe")


__all__ = ["ARCHITECTURES", "build_model", "parse_model_args"]
