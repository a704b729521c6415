"""Granite-MoE (GraniteMoeForCausalLM): Llama attention with Granite's multipliers
(embeddings x `embedding_multiplier`, each residual branch x `residual_multiplier`, attention
scale `attention_multiplier`, logits / `logits_scaling`), every layer sparse
(`block_sparse_moe`: `router.layer` [E, hidden], experts stacked in `input_linear` [E, 2I,
hidden] gate | up and `output_linear` [E, hidden, I]). Routing as transformers'
GraniteMoeTopKRouter: the top `num_experts_per_tok` logits (float32), softmax over those k.

The multipliers are granite.py's (its mixins over the shared MoE decoder's classes)."""

from __future__ import annotations

from dataclasses import dataclass

from ..moe import Routing
from .granite import GraniteArgs, GraniteEmbedding, GraniteLogits, GraniteResidual, multipliers
from .moe_decoder import (
    MoeArgs,
    MoeDecoderLayer,
    MoeForCausalLM,
    MoeModel,
    base_fields,
    expert_count,
    top_k,
)

ARCHITECTURES = ("GraniteMoeForCausalLM",)


@dataclass(frozen=True)
class GraniteMoeArgs(MoeArgs, GraniteArgs):
    """The MoE fields and Granite's four multipliers (`attention_scale` Granite's)."""


def parse_model_args(config: dict, arch: str = "GraniteMoeForCausalLM") -> GraniteMoeArgs:
    num_experts = expert_count(config, "num_local_experts", "num_experts")
    if "intermediate_size" not in config:
        raise ValueError(f"config.json lacks intermediate_size (architecture {arch})")
    inter = config["intermediate_size"]
    bias = bool(config.get("attention_bias", False))
    return GraniteMoeArgs(**base_fields(config, arch, inter, qkv_bias=bias, o_bias=bias),
                          num_experts=num_experts, moe_intermediate_size=inter,
                          routing=Routing(top_k(config, num_experts), "topk_softmax"),
                          block_name="block_sparse_moe", **multipliers(config))


class GraniteMoeDecoderLayer(GraniteResidual, MoeDecoderLayer):
    pass


class GraniteMoeModel(GraniteEmbedding, MoeModel):
    layer_cls = GraniteMoeDecoderLayer


class GraniteMoeForCausalLM(GraniteLogits, MoeForCausalLM):
    model_cls = GraniteMoeModel


def build_model(args: GraniteMoeArgs, tp, backend, max_model_len: int, pp
                ) -> GraniteMoeForCausalLM:
    return GraniteMoeForCausalLM(args, tp, backend, max_model_len, pp)


__all__ = ["ARCHITECTURES", "build_model", "parse_model_args"]
