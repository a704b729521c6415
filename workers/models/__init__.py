"""Model definitions, one module per family, and the registry that picks one by the
`architectures` name in config.json.

A family module offers:

    ARCHITECTURES    the config.json architecture names it implements (a dict or tuple)
    parse_model_args(config: dict, architecture: str) -> its frozen args (a `ModelConfig`),
                     ValueError naming any field it cannot run
    build_model(args, tp, backend, max_model_len, pp) -> a `CausalLM` (one pipeline stage)

Adding an architecture is a module built from the shared layers (`workers/layers.py`) and a
line in `FAMILIES`; the worker and the model runner see only the two protocols below.
"""

from __future__ import annotations

from typing import Protocol

import torch

from . import gemma, granite, granite_moe, llama, mixtral, olmo2, olmoe, phi3, qwen_moe

FAMILIES = (llama, granite, olmo2, phi3, gemma, mixtral, qwen_moe, olmoe, granite_moe)
"""Every family module; the first that lists an architecture implements it."""

_BY_ARCHITECTURE = {}
for _family in FAMILIES:
    for _arch in _family.ARCHITECTURES:
        _BY_ARCHITECTURE.setdefault(_arch, _family)

ARCHITECTURES: tuple[str, ...] = tuple(_BY_ARCHITECTURE)
"""The config.json architecture names tidal runs."""


class ModelConfig(Protocol):
    """What the worker and the model runner read of a family's args."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    eos_token_ids: list[int]

    def check_max_model_len(self, max_model_len: int) -> None:
        """ValueError when the model cannot serve sequences of max_model_len tokens."""


class CausalLM(Protocol):
    """A decoder with its LM head, as the model runner drives it."""

    packed_modules_mapping: dict
    num_layers: int  # decoder layers on this stage, each with its own KV cache

    def checkpoint_name(self, name: str) -> str | None: ...

    def use_cpu_ops(self, ops) -> str: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 attn_inputs, hidden: torch.Tensor | None = None) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def parse_model_args(config: dict) -> ModelConfig:
    """The args of config.json's architecture; ValueError naming it when tidal lacks it."""
    names = config.get("architectures") or []
    arch = next((a for a in names if a in _BY_ARCHITECTURE), None)
    if arch is None:
        shown = ", ".join(names) if names else "(config.json names none)"
        raise ValueError(f"architecture {shown} is not supported by tidal; supported: "
                         f"{', '.join(ARCHITECTURES)} (docs/models.md)")
    return _BY_ARCHITECTURE[arch].parse_model_args(config, arch)


def build_model(args: ModelConfig, tp, backend, max_model_len: int, pp) -> CausalLM:
    """The model (one pipeline stage of it) for `args.architecture`."""
    return _BY_ARCHITECTURE[args.architecture].build_model(args, tp, backend, max_model_len,
                                                           pp)


__all__ = ["ARCHITECTURES", "FAMILIES", "CausalLM", "ModelConfig", "build_model",
           "parse_model_args"]
