"""Granite-MoE (GraniteMoeForCausalLM): Llama attention with Granite's multipliers
(embeddings x `embedding_multiplier`, each residual branch x `residual_multiplier`, attention
scale `attention_multiplier`, logits / `logits_scaling`), every layer sparse
(`block_sparse_moe`: `router.layer` [E, hidden], experts stacked in `input_linear` [E, 2I,
hidden] gate | up and `output_linear` [E, hidden, I]). Routing as transformers'
GraniteMoeTopKRouter: the top `num_experts_per_tok` logits (float32), softmax over those k."""

from __future__ import annotations

from ..moe import Routing
from .moe_decoder import MoeArgs, base_fields, build_model, expert_count, top_k

ARCHITECTURES = ("GraniteMoeForCausalLM",)


def parse_model_args(config: dict, arch: str = "GraniteMoeForCausalLM") -> MoeArgs:
    num_experts = expert_count(config, "num_local_experts", "num_experts")
    if "intermediate_size" not in config:
        raise ValueError(f"config.json lacks intermediate_size (architecture {arch})")
    inter = config["intermediate_size"]
    bias = bool(config.get("attention_bias", False))
    return MoeArgs(**base_fields(config, arch, inter, qkv_bias=bias, o_bias=bias),
                   num_experts=num_experts, moe_intermediate_size=inter,
                   routing=Routing(top_k(config, num_experts), "topk_softmax"),
                   block_name="block_sparse_moe",
                   embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
                   residual_multiplier=float(config.get("residual_multiplier", 1.0)),
                   attention_multiplier=float(config.get("attention_multiplier", 1.0)),
                   logits_scaling=float(config.get("logits_scaling", 1.0)))


__all__ = ["ARCHITECTURES", "build_model", "parse_model_args"]
