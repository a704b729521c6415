"""Qwen2-MoE (Qwen2MoeForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM): Qwen2's / Qwen3's
attention (q/k/v bias by `qkv_bias`; per-head q/k norms), sparse blocks (`mlp`) of
`num_experts` experts of `moe_intermediate_size` in the layers `decoder_sparse_step` picks
and `mlp_only_layers` does not (a dense MLP of `intermediate_size` in the others). Routing as
transformers' Qwen2MoeTopKRouter / Qwen3MoeTopKRouter: softmax in float32, top
`num_experts_per_tok`, renormalised only with `norm_topk_prob`, cast to the activations' dtype.
Qwen2-MoE adds a shared expert (`shared_expert_intermediate_size`) scaled by
sigmoid(`shared_expert_gate`(x))."""

from __future__ import annotations

from ..moe import Routing
from .moe_decoder import MoeArgs, base_fields, build_model, expert_count, top_k

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def parse_model_args(config: dict, arch: str = "Qwen2MoeForCausalLM") -> MoeArgs:
    qwen2 = arch == "Qwen2MoeForCausalLM"
    num_experts = expert_count(config, "num_experts", "num_local_experts")
    missing = [k for k in ("moe_intermediate_size", "intermediate_size") if k not in config]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)} (architecture {arch})")
    if qwen2:  # bias on q/k/v (qkv_bias, default true), none on o
        attention = dict(qkv_bias=bool(config.get("qkv_bias", True)), o_bias=False)
    else:
        bias = bool(config.get("attention_bias", False))
        attention = dict(qkv_bias=bias, o_bias=bias, qk_norm=True)
    step = int(config.get("decoder_sparse_step", 1) or 1)
    only_dense = set(config.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(config.get("num_hidden_layers", 0))
                  if i in only_dense or (i + 1) % step)
    shared = int(config.get("shared_expert_intermediate_size") or 0) if qwen2 else 0
    return MoeArgs(**base_fields(config, arch, config["intermediate_size"], **attention),
                   num_experts=num_experts,
                   moe_intermediate_size=config["moe_intermediate_size"],
                   routing=Routing(top_k(config, num_experts), "softmax_topk",
                                   renormalize=bool(config.get("norm_topk_prob", False))),
                   shared_expert_intermediate_size=shared, dense_layers=dense)


__all__ = ["ARCHITECTURES", "build_model", "parse_model_args"]
