"""Google Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`).

What differs from a Llama:

    norms        (1 + weight) RMSNorm in float32 (`layers.OffsetRMSNorm`), four a layer:
                 h   = x + post_attention_layernorm(attn(input_layernorm(x)))
                 out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    embedding    times sqrt(hidden_size), rounded to the activations' dtype first
    MLP          gelu (tanh approximation) of gate, times up
    attention    scale query_pre_attn_scalar^-1/2; Gemma 2 caps the scores at
                 attn_logit_softcapping (c * tanh(s / c)); Gemma 3 norms q and k per head
    layers       `layer_types` (else Gemma 2's alternation, Gemma 3's `sliding_window_pattern`)
                 marks each layer sliding (a window of `sliding_window` keys, transformers'
                 convention: positions > p - window) or full; Gemma 3's sliding layers rotate
                 with their own base (`rope_local_base_freq`, or rope_parameters'
                 `sliding_attention`), its full ones with `rope_theta` and any scaling
    logits       capped at final_logit_softcapping (Gemma 2)

The window and the score cap are the attention kernels' (`PagedAttention(sliding_window=...,
logits_soft_cap=...)`).

Gemma3ForConditionalGeneration (the 4B-27B checkpoints) runs as its text model alone: the
config's `text_config` (its missing keys at Gemma3TextConfig's defaults, as transformers fills
them), the weights under `language_model.model.` / `model.language_model.`; the vision tower
and the projector are skipped, so prompts are text only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import PagedAttention
from ..layers import OffsetRMSNorm, RotaryEmbedding
from .llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    ModelArgs,
    base_fields,
)

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
MULTIMODAL = "Gemma3ForConditionalGeneration"
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
    sliding_window=4096, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0, max_position_embeddings=131072,
    hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
    attn_logit_softcapping=None)
"""transformers' Gemma3TextConfig defaults: the multimodal checkpoints' `text_config` gives
only what differs from them (gemma-3-4b-it: hidden and intermediate sizes, layers, the
window, the global rope's scaling)."""
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True)
class GemmaArgs(ModelArgs):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    window: int | None = None
    """The sliding layers' window (`sliding_window` is left None: that field means a window
    the attention cannot apply, which a Gemma's is not)."""
    sliding_layers: tuple[bool, ...] = ()
    """Per layer: sliding (True) or full attention."""
    local_rope_theta: float = 10000.0
    local_rope_scaling: dict | None = None
    qk_norm_per_head: bool = False

    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5


def parse_model_args(config: dict, architecture: str) -> GemmaArgs:
    if architecture == MULTIMODAL:
        config = _text_config(config)
    gemma3 = architecture in ("Gemma3ForCausalLM", MULTIMODAL)
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{architecture}: use_bidirectional_attention is not supported")
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", 6) if gemma3 else 2
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{architecture}: layer_types must name sliding_attention or "
                         f"full_attention for each of the {layers} layers; got {types}")
    config = {**config, "tie_word_embeddings": config.get("tie_word_embeddings", True)}
    global_rope, local_rope = _gemma_rope(config, gemma3)
    config["rope_parameters"] = global_rope
    fields = base_fields(config, architecture, activations=ACTIVATIONS)
    fields["sliding_window"] = None
    local_theta = float(local_rope.get("rope_theta", 10000.0))
    local_kind = local_rope.get("rope_type", local_rope.get("type", "default"))
    return GemmaArgs(
        **fields,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
        attn_logit_softcapping=config.get("attn_logit_softcapping"),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        window=int(config["sliding_window"]) if config.get("sliding_window") else None,
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        local_rope_theta=local_theta,
        local_rope_scaling=None if local_kind == "default" else dict(local_rope),
        qk_norm_per_head=gemma3,
    )


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{MULTIMODAL}: config.json has no text_config")
    text = {**GEMMA3_TEXT_DEFAULTS, **text}
    for key in ("eos_token_id", "tie_word_embeddings"):
        if key not in text and key in config:
            text[key] = config[key]
    return text


def _gemma_rope(config: dict, gemma3: bool) -> tuple[dict, dict]:
    """(full layers' rope parameters, sliding layers'): transformers 5 writes Gemma 3's per
    layer type; older configs give rope_theta (+ rope_scaling) for the full layers and
    rope_local_base_freq for the sliding ones. Gemma 2's layers share one."""
    params = config.get("rope_parameters")
    if gemma3 and isinstance(params, dict) and "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    if isinstance(params, dict) and params:
        full = dict(params)
    else:
        full = dict(config.get("rope_scaling") or {})
        full.setdefault("rope_theta", config.get("rope_theta", 1e6 if gemma3 else 10000.0))
    full.setdefault("rope_type", full.get("type", "default"))
    if not gemma3:
        return full, full
    return full, {"rope_type": "default",
                  "rope_theta": config.get("rope_local_base_freq", 10000.0)}


class GemmaAttention(LlamaAttention):
    def __init__(self, args: GemmaArgs, tp, backend, sliding: bool):
        super().__init__(args, tp, backend)
        kwargs = {}  # passed only when set: a model without them runs on any PagedAttention
        if sliding and args.window is not None:
            kwargs["sliding_window"] = args.window
        if args.attn_logit_softcapping:
            kwargs["logits_soft_cap"] = float(args.attn_logit_softcapping)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   args.attention_scale(), backend, **kwargs)
        if args.qk_norm_per_head:  # Gemma 3: per head, before rotary (LlamaAttention.project)
            self.q_norm = OffsetRMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = OffsetRMSNorm(args.head_dim, args.rms_norm_eps)
            self.qk_norm = True


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor, residual=None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, residual)


class GemmaDecoderLayer(LlamaDecoderLayer):
    mlp_cls = GemmaMLP

    def __init__(self, args: GemmaArgs, tp, backend, index: int = 0):
        self.sliding = args.sliding_layers[index]
        super().__init__(args, tp, backend, index)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(d, eps)
        self.post_attention_layernorm = OffsetRMSNorm(d, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(d, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(d, eps)

    def attention_cls(self, args, tp, backend):  # called by LlamaDecoderLayer.__init__
        return GemmaAttention(args, tp, backend, self.sliding)

    def forward(self, rope, x, kv_cache, attn_inputs) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(x), kv_cache, attn_inputs)
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def cpu_parts(self):
        return None


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer

    def __init__(self, args: GemmaArgs, tp, backend, max_model_len: int, pp):
        super().__init__(args, tp, backend, max_model_len, pp)
        if pp.is_last:
            self.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        local = (args.local_rope_theta, args.local_rope_scaling)
        self.local_rotary = (None if local == (args.rope_theta, args.rope_scaling) else
                             RotaryEmbedding(args.head_dim, max(max_model_len, 1), *local))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * torch.tensor(math.sqrt(self.args.hidden_size), dtype=h.dtype)

    def forward(self, input_ids, positions, kv_caches, attn_inputs, hidden=None):
        h = self.embed(input_ids) if self.pp.is_first else hidden
        full = self.rotary.tables(positions, h.dtype)
        local = full if self.local_rotary is None else self.local_rotary.tables(positions,
                                                                               h.dtype)
        for layer, kv_cache in zip(self.layers.values(), kv_caches):
            h = layer(local if layer.sliding else full, h, kv_cache, attn_inputs)
        return self.norm(h) if self.pp.is_last else h


class GemmaForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel
    fused_layers_lack = "Gemma's four norms a layer, GELU and sliding windows"

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap


class Gemma3TextOfMultimodal(GemmaForCausalLM):
    """Gemma3ForConditionalGeneration's language model: its checkpoint names mapped onto
    Gemma3ForCausalLM's, the vision tower's and the projector's skipped."""

    PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                ("language_model.lm_head.", "lm_head."))

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                            "model.multi_modal_projector.")):
            return None
        for old, new in self.PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith("lm_head.") and self.args.tie_word_embeddings:
            return None  # the embedding's own matrix
        return super().checkpoint_name(name)


def build_model(args: GemmaArgs, tp, backend, max_model_len: int, pp) -> GemmaForCausalLM:
    if args.architecture == MULTIMODAL:
        return Gemma3TextOfMultimodal(args, tp, backend, max_model_len, pp)
    return GemmaForCausalLM(args, tp, backend, max_model_len, pp)
