"""IBM Granite 3 (`GraniteForCausalLM`): a Llama with four scalars from config.json.

    embedding_multiplier   the embedding output is multiplied by it
    attention_multiplier   the attention scale (instead of head_dim^-1/2)
    residual_multiplier    each block's output (attention, MLP) is multiplied by it before
                           the residual add: h = x + m * attn(norm(x))
    logits_scaling         the logits are divided by it

The residual multiplier sits between the projection and the add, so the layers take the
per-module path (the one-call C layers add unscaled).

The multipliers live here once, as mixins over any Llama-family layer, model and LM
(`GraniteResidual`, `GraniteEmbedding`, `GraniteLogits`): the dense classes below and
Granite-MoE's (`granite_moe.py`, over the shared MoE decoder) are built from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, ModelArgs, base_fields

ARCHITECTURES = ("GraniteForCausalLM",)


@dataclass(frozen=True)
class GraniteArgs(ModelArgs):
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def attention_scale(self) -> float:
        return self.attention_multiplier


def multipliers(config: dict) -> dict[str, float]:
    """The four scalars of a Granite or Granite-MoE config.json (transformers' default 1)."""
    return {name: float(config.get(name, 1.0)) for name in (
        "embedding_multiplier", "attention_multiplier", "residual_multiplier",
        "logits_scaling")}


def parse_model_args(config: dict, architecture: str = "GraniteForCausalLM") -> GraniteArgs:
    return GraniteArgs(**base_fields(config, architecture), **multipliers(config))


class GraniteResidual:
    """A decoder layer's forward with each branch scaled before its residual add (over a
    layer class with `self_attn`, `mlp`, the two norms; `args` a `GraniteArgs`)."""

    def __init__(self, args: GraniteArgs, tp, backend, index: int = 0):
        super().__init__(args, tp, backend, index)
        self.residual_multiplier = args.residual_multiplier

    def forward(self, rope, x, kv_cache, attn_inputs) -> torch.Tensor:
        m = self.residual_multiplier
        h = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, attn_inputs) * m
        return h + self.mlp(self.post_attention_layernorm(h)) * m

    def cpu_parts(self):
        return None  # the residual multiplier


class GraniteEmbedding:
    """A model's embedding times `embedding_multiplier`."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.args.embedding_multiplier


class GraniteLogits:
    """An LM's logits divided by `logits_scaling`."""

    fused_layers_lack = "Granite's residual multiplier"

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.args.logits_scaling


class GraniteDecoderLayer(GraniteResidual, LlamaDecoderLayer):
    pass


class GraniteModel(GraniteEmbedding, LlamaModel):
    layer_cls = GraniteDecoderLayer


class GraniteForCausalLM(GraniteLogits, LlamaForCausalLM):
    model_cls = GraniteModel


def build_model(args: GraniteArgs, tp, backend, max_model_len: int, pp) -> GraniteForCausalLM:
    return GraniteForCausalLM(args, tp, backend, max_model_len, pp)
